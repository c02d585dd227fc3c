"""Dataset sources: digits, image folders and tfds, each read into three disjoint splits
(docs/training.md, "Datasets")."""

import dataclasses
import os

import numpy as np

from keras_vitnorm.training.data.image_files import OTHER_IMAGE_FORMATS
from keras_vitnorm.training.data.image_files import check_image_file
from keras_vitnorm.training.data.image_files import list_bad_files
from keras_vitnorm.training.data.image_files import unreadable_file_error

DATASET_CHOICES = ("digits", "tfds:<name>", "folder:<path>")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
# Fraction held out as the test split when a source has none (folders without test/).
TEST_FRACTION = 0.2


class Split:
    """One split: its `(raw, label)` pairs, as a tf.data `source` (tfds: encoded images) or
    NumPy `arrays = (raws, labels)` (uint8 images of digits, a folder's file paths)."""

    def __init__(self, name, source=None, size=None, arrays=None):
        self.name, self.source, self.arrays = name, source, arrays
        self.size = len(arrays[1]) if size is None else size


@dataclasses.dataclass
class Dataset:
    """The three splits of a dataset and what the model needs to know about it; `kind`
    (`"digits"`, `"folder"` or `"tfds"`) says how a raw example decodes."""

    name: str
    kind: str
    train: Split
    validation: Split
    test: Split
    num_classes: int
    channels: int
    class_names: list
    files: list = None
    skipped: list = None
    pipeline: object = None

    def describe(self):
        text = (
            f"{self.name}: {self.num_classes} classes, {self.channels} channel(s); "
            f"train {self.train.size} ({self.train.name}), validation "
            f"{self.validation.size} ({self.validation.name}), test {self.test.size} "
            f"({self.test.name})"
        )
        if self.skipped:
            text += (f"; skipped {len(self.skipped)} unreadable image(s): "
                     + list_bad_files(self.skipped))
        return text


def parse_dataset(spec):
    """Splits `"tfds:cifar10"` into `("tfds", "cifar10")`; raises on an unknown form."""
    if not isinstance(spec, str):
        raise ValueError(f"dataset must be a string such as 'digits', got {spec!r}.")
    if spec == "digits":
        return "digits", None
    for kind in ("tfds", "folder"):
        if spec.startswith(kind + ":"):
            argument = spec[len(kind) + 1 :]
            if not argument:
                what = "dataset" if kind == "tfds" else "path"
                raise ValueError(f"dataset={spec!r} names no {kind} {what}.")
            return kind, argument
    raise ValueError(
        f"Unknown dataset={spec!r}. Valid forms: {', '.join(DATASET_CHOICES)} "
        "(e.g. 'tfds:cifar10' or 'folder:/data/flowers')."
    )


def split_off(split, count):
    """`(rest, held_out)` of `split` with `count` examples held out: the last ones
    (tfds order), or a class-stratified draw with seed 0."""
    keep = split.size - count
    if split.arrays is None:
        return (Split(f"first {keep} of {split.name}", split.source.take(keep), keep),
                Split(f"next {count} of {split.name}", split.source.skip(keep).take(count), count))
    raws, labels = split.arrays
    kept, held_out = _stratified_split(labels, count / split.size)
    return (Split(f"{len(kept)} of {split.name}", arrays=(raws[kept], labels[kept])),
            Split(f"{len(held_out)} of {split.name}, held out",
                  arrays=(raws[held_out], labels[held_out])))


def subset(split, count, name):
    """At most `count` examples of `split`: a class-stratified draw with seed 0 (digits,
    folders) or its first `count` (tfds). `name` (the dataset) is for error messages."""
    if count >= split.size:
        return split
    return train_subset(split, count, name)


def train_subset(split, count, name):
    """The first `count` examples of `split` (tfds) or a class-stratified subset."""
    if count > split.size:
        raise ValueError(
            f"train_examples={count} is more than the {split.size} training examples of "
            f"{name} ({split.name})."
        )
    description = f"{count} of {split.name}"
    if split.arrays is None:
        return Split(description, split.source.take(count), count)
    raws, labels = split.arrays
    if count < len(labels):
        from sklearn.model_selection import train_test_split

        indices = np.arange(len(labels))
        try:
            kept, _ = train_test_split(indices, train_size=count, stratify=labels, random_state=0)
        except ValueError:  # fewer examples than classes: a plain random subset
            kept, _ = train_test_split(indices, train_size=count, random_state=0)
        kept = np.sort(kept)
        raws, labels = raws[kept], labels[kept]
    return Split(description + ", stratified", arrays=(raws, labels))


def _stratified_split(labels, fraction):
    """Indices `(kept, held_out)` with `fraction` of every class held out, seed 0."""
    from sklearn.model_selection import train_test_split

    indices = np.arange(len(labels))
    try:
        kept, held_out = train_test_split(indices, test_size=fraction, stratify=labels,
                                          random_state=0)
    except ValueError:  # a class too small for scikit-learn to stratify
        return _split_each_class(labels, fraction)
    return np.sort(kept), np.sort(held_out)


def _split_each_class(labels, fraction):
    """`_stratified_split` for classes too small for scikit-learn: each keeps one, and
    one example is held out overall where a class has two."""
    rng = np.random.default_rng(0)
    groups = [rng.permutation(np.flatnonzero(labels == label)) for label in np.unique(labels)]
    counts = [min(round(len(group) * fraction), len(group) - 1) for group in groups]
    if not sum(counts):
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        counts[largest] = min(1, len(groups[largest]) - 1)
    held_out = np.sort(np.concatenate([group[:count] for group, count in zip(groups, counts)]))
    return np.setdiff1d(np.arange(len(labels)), held_out), held_out.astype(np.int64)


def _hold_out(split, fraction, held_out_name, kept_name=None):
    """`(kept, held_out)` of an arrays `Split`, `fraction` of every class held out."""
    raws, labels = split.arrays
    kept, held = _stratified_split(labels, fraction)
    return (Split(kept_name or split.name, arrays=(raws[kept], labels[kept])),
            Split(held_out_name, arrays=(raws[held], labels[held])))


def digits(val_fraction):
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype("uint8")[..., None]
    labels = digits.target.astype("int64")
    train, test = _hold_out(Split("train", arrays=(images, labels)), TEST_FRACTION,
                            f"{TEST_FRACTION:.0%} of all images")
    train, val = _hold_out(train, val_fraction, f"{val_fraction:.0%} of the non-test images")
    return Dataset("digits", "digits", train, val, test, num_classes=10, channels=1,
                   class_names=[str(i) for i in range(10)])


def _list_images(directory, classes=None):
    """`(Split of the image paths, classes)` of a class-per-folder tree."""
    # Hidden entries (".ipynb_checkpoints", ".DS_Store", ...) are neither classes nor images.
    found = sorted(entry for entry in os.listdir(directory)
                   if not entry.startswith(".") and os.path.isdir(os.path.join(directory, entry)))
    training = classes is None
    if training:
        classes = found
    else:
        extra = sorted(set(found) - set(classes))
        if extra:
            raise ValueError(
                f"{directory} has class folder(s) {extra} that the training folder lacks; "
                f"training classes: {classes}."
            )
    # Files of other image formats are listed too, for the check to name them.
    extensions = IMAGE_EXTENSIONS + tuple(OTHER_IMAGE_FORMATS)
    paths, labels = [], []
    for label, name in enumerate(classes):
        folder = os.path.join(directory, name)
        if not os.path.isdir(folder):
            continue
        for file in sorted(os.listdir(folder)):
            if not file.startswith(".") and file.lower().endswith(extensions):
                paths.append(os.path.join(folder, file))
                labels.append(label)
    present = set(labels)
    empty = [name for label, name in enumerate(classes) if label not in present]
    if paths and empty and training:
        raise ValueError(
            f"class folder(s) {', '.join(empty)} of {directory} hold no images (files ending in "
            f"{', '.join(IMAGE_EXTENSIONS)} directly inside them; subfolders are not read). "
            "Add images, or move the folder(s) out."
        )
    if not paths:
        raise ValueError(
            f"{directory} holds no images in class subfolders (expected "
            f"{directory}/<class>/<image> with extensions {', '.join(IMAGE_EXTENSIONS)})."
        )
    return Split(directory, arrays=(np.array(paths), np.array(labels, "int64"))), classes


def _check_folder_images(splits, skip_bad_images):
    """`(splits without unreadable files, [(path, why), ...])`; raises unless skipping."""
    bad = [(str(file), why) for split in splits for file in split.arrays[0]
           if (why := check_image_file(file))]
    if bad and not skip_bad_images:
        raise unreadable_file_error(bad)
    rejected = {path for path, _ in bad}
    kept = []
    for split in splits:
        paths, labels = split.arrays
        keep = np.array([str(p) not in rejected for p in paths], bool)
        kept.append(Split(split.name, arrays=(paths[keep], labels[keep])))
    return kept, bad


def _channels_of(path):
    """1 for a grayscale image file (with or without alpha), else 3 (read by Pillow)."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            mode = image.mode
    except (OSError, ValueError, SyntaxError) as error:
        raise unreadable_file_error([(str(path), f"does not decode ({error})")]) from None
    return 1 if mode in ("1", "L", "LA", "La", "I", "I;16", "F") else 3


def folder(path, val_fraction, skip_bad_images=False):
    if not os.path.isdir(path):
        raise ValueError(f"dataset folder {path!r} does not exist or is not a directory.")
    train_root = os.path.join(path, "train")
    if os.path.isdir(train_root):
        train, classes = _list_images(train_root)
        test_root = os.path.join(path, "test")
        if os.path.isdir(test_root):
            test = _list_images(test_root, classes)[0]
        else:
            train, test = _hold_out(train, TEST_FRACTION, f"{TEST_FRACTION:.0%} of {train_root}")
        val_roots = [os.path.join(path, name) for name in ("val", "validation")]
        val_root = next((root for root in val_roots if os.path.isdir(root)), None)
        if val_root:
            val = _list_images(val_root, classes)[0]
        else:
            train, val = _hold_out(train, val_fraction, f"{val_fraction:.0%} of {train_root}",
                                   f"the rest of {train_root}")
    else:
        rest, classes = _list_images(path)
        train, test = _hold_out(rest, TEST_FRACTION, f"{TEST_FRACTION:.0%} of {path}", "the rest")
        train, val = _hold_out(train, val_fraction, f"{val_fraction:.0%} of the rest")
    if len(classes) < 2:
        raise ValueError(
            f"dataset folder {path!r} has {len(classes)} class folder(s); need at least 2.")
    (train, val, test), bad = _check_folder_images((train, val, test), skip_bad_images)
    for split in (train, val, test):
        if not split.size:
            raise ValueError(
                f"dataset folder {path!r}: the split {split.name} has no readable images left.")
    return Dataset(
        f"folder:{path}", "folder", train, val, test, num_classes=len(classes),
        channels=_channels_of(train.arrays[0][0]), class_names=list(classes),
        files=[str(p) for split in (train, val, test) for p in split.arrays[0]], skipped=bad,
    )
