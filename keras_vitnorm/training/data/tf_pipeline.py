"""The tf.data input pipeline: every source, on every backend, with the functions of
`python_pipeline`; RandAugment, MixUp and CutMix run with TensorFlow's ops."""

import contextlib
import importlib.util
import math

import numpy as np

from keras_vitnorm.ops import fast_path_enabled
from keras_vitnorm.training.data.augmentation import batch_mixing
from keras_vitnorm.training.data.augmentation import count_histograms_with_bincount
from keras_vitnorm.training.data.augmentation import randaugment
from keras_vitnorm.training.data.image_files import unreadable_file_error
from keras_vitnorm.training.data.model_range import to_model_range

NAME = "tf.data"


def import_tensorflow():
    """TensorFlow, or an `ImportError` that says how to install it or do without it."""
    try:
        import tensorflow
    except ImportError:
        raise ImportError(
            "The tf.data input pipeline (tfds datasets, input_pipeline='tf.data') needs "
            "TensorFlow: pip install 'keras-vitnorm[tensorflow]' (or tensorflow). Digits and "
            "folder datasets also train without it (input_pipeline='python')."
        ) from None
    return tensorflow


def available():
    """Whether TensorFlow is installed (without importing it)."""
    return importlib.util.find_spec("tensorflow") is not None


@contextlib.contextmanager
def errors_named(data):
    """Turns TensorFlow's decode error inside the pipeline, which names no file, into an
    error naming the files that fail to decode (damaged past `check_image_file`)."""
    try:
        yield
    except Exception as error:
        if type(error).__name__ != "InvalidArgumentError" or not data.files:
            raise
        tf = import_tensorflow()
        bad = []
        for path in data.files:
            try:
                tf.io.decode_image(tf.io.read_file(path), expand_animations=False)
            except Exception as decode_error:  # noqa: BLE001 (TensorFlow's error types vary)
                bad.append((path, f"does not decode ({type(decode_error).__name__})"))
        if not bad:
            raise
        raise unreadable_file_error(bad) from error


def _source(split):
    """The split as a tf.data dataset of `(raw, label)` pairs."""
    if split.source is not None:
        return split.source
    return import_tensorflow().data.Dataset.from_tensor_slices(split.arrays)


def _reader(data, image_size, channels):
    """`raw -> float32 (*image_size, channels)` image in [0, 255], of any source."""
    tf = import_tensorflow()

    def read(raw):
        if data.kind == "digits":
            image = tf.convert_to_tensor(raw)
        else:
            encoded = tf.io.read_file(raw) if data.kind == "folder" else raw
            image = tf.io.decode_image(encoded, channels=data.channels, expand_animations=False)
            if data.kind == "folder":
                image.set_shape([None, None, data.channels])
        have = image.shape[-1]
        if have == 1 and channels == 3:
            image = tf.image.grayscale_to_rgb(image)
        elif have == 3 and channels == 1:
            image = tf.image.rgb_to_grayscale(image)
        image = tf.image.resize(tf.cast(image, "float32"), image_size, method="bilinear")
        return tf.clip_by_value(image, 0.0, 255.0)

    return read


def eval_batches(data, split, image_size, channels, batch_size, pad=False, cache=True):
    """Batched `(images, one-hot labels)` of a split (`data.eval_dataset`); with `cache`,
    the batches of a split under 1 GiB as float32 are kept after the first full pass."""
    tf = import_tensorflow()
    image_size = tuple(image_size)
    read = _reader(data, image_size, channels)

    def prepare(raw, label):
        return to_model_range(read(raw)), tf.one_hot(label, data.num_classes)

    dataset = _source(split).map(prepare, num_parallel_calls=tf.data.AUTOTUNE)
    if pad:
        blanks = -(-split.size // batch_size) * batch_size - split.size
        blank = (tf.zeros((*image_size, channels)), tf.zeros((data.num_classes,)))
        dataset = dataset.map(lambda x, y: (x, y, 1.0)).concatenate(
            tf.data.Dataset.from_tensors((*blank, 0.0)).repeat(blanks))
    dataset = dataset.batch(batch_size)
    if cache and split.size * math.prod(image_size) * channels * 4 < 2**30:
        dataset = dataset.cache()
    return dataset.prefetch(tf.data.AUTOTUNE)


def train_batches(data, image_size, channels, batch_size, seed, augmentation, start_step, end_step,
                  shuffle_buffer, share):
    """Augmented training batches for steps `start_step` up to `end_step`
    (`data.train_stream`); pass `p` is shuffled with the seed `seed + p`."""
    tf = import_tensorflow()
    image_size = tuple(image_size)
    size = data.train.size
    first_pass, offset = divmod(start_step * batch_size, size)
    last_pass = (end_step * batch_size - 1) // size
    source = _source(data.train)
    if size <= 200_000:
        source = source.cache()
    buffer = min(size, shuffle_buffer)
    passes = [source.shuffle(buffer, seed=seed + index, reshuffle_each_iteration=False)
              for index in range(first_pass, last_pass + 1)]
    passes[0] = passes[0].skip(offset)
    lengths = [size - offset] + [size] * (len(passes) - 1)
    order = tf.data.Dataset.from_tensor_slices(tf.range(len(passes), dtype="int64"))
    order = order.flat_map(lambda index: tf.data.Dataset.from_tensors(index).repeat(
        tf.gather(tf.constant(lengths, "int64"), index)))
    stream = tf.data.Dataset.choose_from_datasets(passes, order, stop_on_empty_dataset=False)
    positions = tf.data.Dataset.range(start_step * batch_size, end_step * batch_size)
    stream = tf.data.Dataset.zip((positions, stream))
    keyed = _keyed_augmentation(augmentation, image_size, channels, seed)
    read = _reader(data, image_size, channels)
    index, count = share
    local_batch = batch_size // count
    if count > 1:
        stream = stream.filter(lambda position, _: position % batch_size // local_batch == index)

    def prepare(position, example):
        raw, label = example
        return keyed(read(raw), position), tf.one_hot(label, data.num_classes)

    stream = stream.map(prepare, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    # RandAugment draws from a stateful generator: in order, so that thread timing does
    # not choose which image gets which draws.
    for layer in _stateful_augmentation(augmentation, channels, seed):
        stream = stream.map(lambda image, label: (layer(image), label))
    stream = stream.batch(local_batch, drop_remainder=True)
    stream = tf.data.Dataset.zip((tf.data.Dataset.range(start_step, end_step), stream))
    random_batches = bool(augmentation.mixup or augmentation.cutmix)
    stream = stream.map(_batch_augmentation(augmentation, seed),
                        num_parallel_calls=None if random_batches else tf.data.AUTOTUNE)
    return stream.prefetch(tf.data.AUTOTUNE)


def _keyed_augmentation(augmentation, image_size, channels, seed):
    """`f(image, position)`: its crop and flip, drawn statelessly from `(seed, position)`."""
    tf = import_tensorflow()
    height, width = image_size

    def augment(image, position):
        key = tf.stack([tf.constant(seed, "int64"), position])
        crop_key, flip_key = tf.unstack(tf.random.experimental.stateless_split(key, 2))
        if augmentation.crop == "pad":
            pad = augmentation.crop_padding
            image = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]])
            image = tf.image.stateless_random_crop(image, [height, width, channels], crop_key)
        elif augmentation.crop == "zoom":
            scale = tf.random.stateless_uniform([2], crop_key, 1.0 - augmentation.zoom, 1.0)
            box = tf.concat([0.5 - scale / 2, 0.5 + scale / 2], axis=0)[None]
            image = tf.image.crop_and_resize(image[None], box, [0], [height, width])[0]
        if augmentation.flip:
            image = tf.image.stateless_random_flip_left_right(image, flip_key)
        return image

    return augment


def _stateful_augmentation(augmentation, channels, seed):
    """`randaugment`, counting histograms with TensorFlow's (fast path `bincount_histogram`)."""
    layers = randaugment(augmentation, channels, seed)
    if layers and fast_path_enabled("bincount_histogram"):
        count_histograms_with_bincount(getattr(layers[0], "equalization", None),
                                       {"tensorflow": _count_bins})
    return layers


def _count_bins(bins, nbins):
    """`bincount` of int32 `bins` in `[0, nbins)` in a tf.data graph, whatever the backend."""
    tf = import_tensorflow()
    return tf.math.bincount(bins, minlength=nbins, maxlength=nbins, dtype="int32")


def _batch_augmentation(augmentation, seed):
    tf = import_tensorflow()
    mixup, cutmix = batch_mixing(augmentation, seed)

    def apply(layer, images, labels):
        out = layer({"images": images, "labels": labels})
        return out["images"], out["labels"]

    def augment(step, batch):
        images, labels = batch
        if mixup and cutmix:
            # Drawn statelessly; the key is no example's (positions are >= 0).
            key = tf.stack([tf.constant(seed, "int64"), -1 - step])
            images, labels = tf.cond(tf.random.stateless_uniform([], key) < 0.5,
                                     lambda: apply(mixup, images, labels),
                                     lambda: apply(cutmix, images, labels))
        elif mixup or cutmix:
            images, labels = apply(mixup or cutmix, images, labels)
        return to_model_range(images), labels

    return augment


def resize_images_and_masks(images, masks, image_size):
    """uint8 images (bilinear, antialiased) and integer masks (nearest), NumPy, at `image_size`."""
    tf = import_tensorflow()
    images = tf.image.resize(images, (image_size, image_size), method="bilinear", antialias=True)
    masks = tf.image.resize(masks[..., None], (image_size, image_size), method="nearest")[..., 0]
    return (np.clip(np.round(images.numpy()), 0, 255).astype(np.uint8),
            masks.numpy().astype(np.int32))
