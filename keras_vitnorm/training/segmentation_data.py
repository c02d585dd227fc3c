"""Segmentation datasets in memory: `"digit_scenes"` (from scikit-learn's digits),
`"tfds:<name>"` and `"folder:<path>"` (docs/segmentation.md, "Datasets")."""

import dataclasses
import os

import numpy as np

from keras_vitnorm.training.data import IMAGE_EXTENSIONS
from keras_vitnorm.training.data.model_range import to_model_range
from keras_vitnorm.validation import did_you_mean

DATASET_CHOICES = ("digit_scenes", "tfds:<name>", "folder:<path>")
#: The label of pixels that no loss or metric counts (the convention of VOC and ADE20k).
IGNORE_CLASS = 255
DIGIT_SCENE_CLASSES = ["background"] + [str(digit) for digit in range(10)]
SPLITS = ("train", "validation", "test")


@dataclasses.dataclass
class SegmentationData:
    """The three splits, each `(images uint8 (n, h, w, 3), masks int32 (n, h, w))`."""

    name: str
    train: tuple
    validation: tuple
    test: tuple
    num_classes: int
    class_names: list
    ignore_class: int = IGNORE_CLASS

    def describe(self):
        return (
            f"{self.name}: {self.num_classes} classes, train {len(self.train[0])}, validation "
            f"{len(self.validation[0])}, test {len(self.test[0])} images of "
            f"{self.train[0].shape[1]}x{self.train[0].shape[2]}"
        )


def model_inputs(images):
    """uint8 images as the model takes them: float32 in [-1, 1]."""
    return to_model_range(images.astype("float32"))


def load_segmentation_data(name, image_size, num_classes=None, scenes=(2000, 400, 400)):
    """Loads the dataset named `name` (see the module docstring) at `image_size`.

    Args:
        image_size: int, the side of the square images the model takes.
        num_classes: int, needed for tfds and folder sources (their masks do not say
            how many classes there are); `digit_scenes` has 11.
        scenes: the train, validation and test sizes of `digit_scenes`.
    """
    classes = len(DIGIT_SCENE_CLASSES)
    if name == "digit_scenes":
        if num_classes not in (None, classes):
            raise ValueError(f"digit_scenes has {classes} classes; got num_classes={num_classes}.")
        splits = [digit_scenes(count, image_size, split) for count, split in zip(scenes, SPLITS)]
        return SegmentationData(name, *splits, classes, list(DIGIT_SCENE_CLASSES))
    if not name.startswith(("tfds:", "folder:")):
        raise ValueError(f"Unknown segmentation dataset {name!r}. Valid: "
                         f"{', '.join(DATASET_CHOICES)}." + did_you_mean(name, ['digit_scenes']))
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"{name!r} needs num_classes (a positive integer): its masks do not "
                         "record it.")
    kind, _, source = name.partition(":")
    if kind == "tfds":
        from keras_vitnorm.training.data import tfds_source

        splits = _complete(tfds_source.segmentation_splits(source, image_size))
    else:
        splits = _complete(_folder_splits(source, image_size))
    for split, (_, masks) in zip(SPLITS, splits):
        check_labels(masks, num_classes, f"{name} ({split})")
    return SegmentationData(name, *splits, num_classes, [str(c) for c in range(num_classes)])


def check_labels(masks, num_classes, source, ignore_class=IGNORE_CLASS):
    """Raises a `ValueError` naming `source` for a label outside `[0, num_classes)`."""
    values = np.unique(masks)
    bad = values[((values < 0) | (values >= num_classes)) & (values != ignore_class)]
    if bad.size:
        raise ValueError(
            f"{source}: masks hold labels {bad[:10].tolist()} outside [0, {num_classes}) (and not "
            f"the ignore label {ignore_class}). Pass the right num_classes or remap the masks.")


def digit_scenes(count, image_size=32, split="train"):
    """`count` scenes of scikit-learn digits with per-pixel labels; the splits draw from
    disjoint digit images (60/20/20%), each with its own fixed seed."""
    from sklearn.datasets import load_digits

    if image_size < 16:
        raise ValueError(f"digit_scenes needs image_size >= 16 (a digit is drawn 16 pixels "
                         f"tall), got {image_size}.")
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; valid: {', '.join(SPLITS)}.")
    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.images))
    low, high = {"train": (0, 0.6), "validation": (0.6, 0.8), "test": (0.8, 1.0)}[split]
    pool = order[int(low * len(order)):int(high * len(order))]
    rng = np.random.default_rng(SPLITS.index(split) + 1)
    images = np.empty((count, image_size, image_size, 3), np.uint8)
    masks = np.empty((count, image_size, image_size), np.int32)
    for i in range(count):
        canvas = rng.uniform(0, 60, 3) + rng.normal(0, 12, (image_size, image_size, 3))
        mask = np.zeros((image_size, image_size), np.int32)
        for _ in range(rng.integers(1, 4)):
            index = pool[rng.integers(len(pool))]
            scale = int(rng.integers(2, max(3, image_size // 16 + 1)))
            stroke = np.kron(digits.images[index], np.ones((scale, scale))) / 16.0
            side = stroke.shape[0]
            top, left = rng.integers(0, image_size - side + 1, 2)
            window = (slice(top, top + side), slice(left, left + side))
            ink = stroke > 0
            colour = rng.uniform(120, 255, 3)
            blend = stroke[..., None] * colour + (1 - stroke[..., None]) * canvas[window]
            canvas[window][ink] = blend[ink]
            label = mask[window]
            label[stroke >= 0.5] = digits.target[index] + 1
            label[(stroke > 0) & (stroke < 0.5)] = IGNORE_CLASS
        images[i] = np.clip(canvas, 0, 255).astype(np.uint8)
        masks[i] = mask
    return images, masks


def _folder_pairs(directory):
    image_dir, mask_dir = os.path.join(directory, "images"), os.path.join(directory, "masks")
    if not (os.path.isdir(image_dir) and os.path.isdir(mask_dir)):
        raise ValueError(f"{directory!r} needs images/ and masks/ subfolders (images/<name>.jpg "
                         "with masks/<name>.png).")
    masks = {os.path.splitext(f)[0]: f for f in os.listdir(mask_dir)}
    pairs = []
    for file in sorted(os.listdir(image_dir)):
        stem, extension = os.path.splitext(file)
        if extension.lower() not in IMAGE_EXTENSIONS:
            continue
        if stem not in masks:
            raise ValueError(f"{os.path.join(image_dir, file)} has no mask: expected "
                             f"{os.path.join(mask_dir, stem)}.png.")
        pairs.append((os.path.join(image_dir, file), os.path.join(mask_dir, masks[stem])))
    if not pairs:
        raise ValueError(f"{image_dir!r} holds no images ({', '.join(IMAGE_EXTENSIONS)}).")
    return pairs


def _read_folder(directory, image_size):
    from PIL import Image

    from keras_vitnorm.training.data.tf_pipeline import resize_images_and_masks

    images, masks = [], []
    for image_path, mask_path in _folder_pairs(directory):
        try:
            with Image.open(image_path) as image_file:
                image = np.asarray(image_file.convert("RGB"))
            with Image.open(mask_path) as mask_file:
                if mask_file.mode not in ("L", "P", "I", "I;16"):
                    raise ValueError(f"{mask_path} is a {mask_file.mode} image; a mask is "
                                     "single-channel class indices.")
                mask = np.asarray(mask_file).astype(np.int32)
        except OSError as error:
            raise ValueError(f"{image_path} or its mask cannot be read ({error}).") from error
        if image.shape[:2] != mask.shape:
            raise ValueError(
                f"{mask_path} is {mask.shape[1]}x{mask.shape[0]} but its image {image_path} is "
                f"{image.shape[1]}x{image.shape[0]}: a mask must match its image's size.")
        image, mask = resize_images_and_masks(image[None], mask[None], image_size)
        images.append(image[0])
        masks.append(mask[0])
    return np.stack(images), np.stack(masks)


def _folder_splits(path, image_size):
    if not os.path.isdir(path):
        raise ValueError(f"Segmentation folder {path!r} does not exist.")
    if not os.path.isdir(os.path.join(path, "train")):
        return [_read_folder(path, image_size), None, None]

    def read(*names):  # the first of these subfolders that exists, or None
        folders = [os.path.join(path, name) for name in names]
        folder = next((folder for folder in folders if os.path.isdir(folder)), None)
        return folder and _read_folder(folder, image_size)

    return [read("train"), read("val", "validation"), read("test")]


def _complete(splits):
    """Carves a missing validation or test split off the training split (seed 0)."""
    splits = list(splits)
    images, masks = splits[0]
    order = np.random.default_rng(0).permutation(len(images))
    holdout = max(1, int(round(0.1 * len(images))))  # a tenth each
    for index in (1, 2):  # validation, test
        if splits[index] is None:
            if len(order) <= holdout:
                raise ValueError(f"Too few training images ({len(images)}) to carve off a "
                                 "validation and test split.")
            taken, order = order[:holdout], order[holdout:]
            splits[index] = (images[taken], masks[taken])
    splits[0] = (images[np.sort(order)], masks[np.sort(order)])
    return splits
