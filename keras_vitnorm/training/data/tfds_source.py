"""tensorflow-datasets sources, `"tfds:<name>"`: tf.data datasets of encoded images, so
only the tf.data pipeline reads them."""

import numpy as np

try:
    import tensorflow_datasets as tfds
except ModuleNotFoundError as error:
    if error.name != "tensorflow_datasets":
        raise
    raise ModuleNotFoundError(
        "tfds:<name> datasets need tensorflow-datasets, which is not installed: pip install "
        "'keras-vitnorm[train]' (or read a folder of images, folder:<path>, or digits).",
        name=error.name) from None

from keras_vitnorm.training.data.sources import Dataset
from keras_vitnorm.training.data.sources import Split
from keras_vitnorm.training.data.tf_pipeline import resize_images_and_masks


def prepared_tfds_builder(name, features, task, data_dir=None, manual_dir=None):
    """`(builder, split names)` of the tfds dataset `name`, prepared; a `ValueError` where
    it lacks the `features` (e.g. `("image", "label")`) that `task` needs."""
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except Exception as error:  # tfds raises DatasetNotFoundError with its own list
        raise ValueError(f"Unknown tensorflow-datasets dataset {name!r}: {error}") from None
    have = builder.info.features
    if any(feature not in have for feature in features):
        raise ValueError(
            f"tfds:{name} has features {sorted(have.keys())}: it is not a {task} dataset "
            "(one with " + " and ".join(repr(f) for f in features) + " features)."
        )
    download_config = tfds.download.DownloadConfig(manual_dir=manual_dir) if manual_dir else None
    builder.download_and_prepare(download_config=download_config)
    # Mocked and some prepared builders record no splits: train and test are the common pair.
    return builder, set(builder.info.splits.keys()) or {"train", "test"}


def classification(name, val_fraction, data_dir=None, manual_dir=None):
    """The `Dataset` of a tfds classification dataset (splits: docs/training.md, "Datasets")."""
    builder, available = prepared_tfds_builder(name, ("image", "label"), "classification",
                                               data_dir, manual_dir)
    features = builder.info.features
    # Without a test split (imagenet2012): test on validation, validate on a slice of train.
    test_split = "test" if "test" in available else "validation"
    if test_split == "test" and "validation" in available:
        train_split, val_split = "train", "validation"
    else:
        kept = 100 - round(100 * val_fraction)
        train_split, val_split = f"train[:{kept}%]", f"train[{kept}%:]"

    def split(split_name):
        source = builder.as_dataset(split=split_name, as_supervised=True, shuffle_files=False,
                                    decoders={"image": tfds.decode.SkipDecoding()})
        size = int(source.cardinality())
        if size < 0:
            size = int(source.reduce(0, lambda count, _: count + 1))
        return Split(split_name, source, size)

    return Dataset(
        name=f"tfds:{name}", kind="tfds", train=split(train_split),
        validation=split(val_split), test=split(test_split),
        num_classes=features["label"].num_classes, channels=features["image"].shape[-1] or 3,
        class_names=list(features["label"].names),
    )


def segmentation_splits(dataset_name, image_size):
    """`[train, validation or None, test or None]` of a tfds dataset with `image` and
    `segmentation_mask` features, each `(images, masks)` resized to `image_size`."""
    builder, available = prepared_tfds_builder(dataset_name, ("image", "segmentation_mask"),
                                               "segmentation")
    splits = []
    for names in (("train",), ("validation", "val"), ("test",)):
        name = next((n for n in names if n in available), None)
        if name is None:
            splits.append(None)
            continue
        images, masks = [], []
        for example in tfds.as_numpy(builder.as_dataset(split=name)):
            image, mask = example["image"], np.asarray(example["segmentation_mask"])
            mask = mask[..., 0] if mask.ndim == 3 else mask
            if image.shape[:2] != mask.shape[:2]:
                raise ValueError(f"tfds:{dataset_name} ({name}): an image of {image.shape[:2]} "
                                 f"has a mask of {mask.shape[:2]}.")
            resized = resize_images_and_masks(image[None], mask[None].astype(np.int32), image_size)
            images.append(resized[0][0])
            masks.append(resized[1][0])
        splits.append((np.stack(images), np.stack(masks)))
    if splits[0] is None:
        raise ValueError(
            f"tfds:{dataset_name} has no 'train' split (it has {', '.join(available)}).")
    return splits
