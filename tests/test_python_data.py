"""The input pipeline without TensorFlow (keras.utils.PyDataset): the same evaluation
batches as tf.data, exact resumes, shares of a batch, and a run with TensorFlow
unimportable."""

import json

import numpy as np
import pytest

from keras_vitnorm.training import data as data_lib
from keras_vitnorm.training.data import decoded_images
from keras_vitnorm.training.data import keyed_crops
from keras_vitnorm.training.data import keyed_layers
from keras_vitnorm.training.data import python_pipeline as python_data
from test_training import BACKEND
from test_training import TINY
from test_training import run_python
from test_training import write_image_folder


def batches(dataset):
    return [[np.asarray(part) for part in batch] for batch in dataset]


@pytest.mark.parametrize("spec, size, channels, levels", [
    ("digits", (20, 12), 3, 0), ("folder", (9, 16), 3, 0), ("folder", (12, 12), 1, 1)])
def test_evaluation_batches_are_the_tf_data_ones(tmp_path, spec, size, channels, levels):
    """Digits resized up (8x8 to 20x12, gray to RGB), PNG files resized down and kept:
    the same to float32 rounding; colour files read as grayscale within `levels` grey
    levels (libpng, inside TensorFlow's decoder, and Pillow weight the channels
    differently)."""
    if spec == "folder":
        write_image_folder(tmp_path / "images")
        spec = f"folder:{tmp_path / 'images'}"
    tf_data = data_lib.load_dataset(spec, pipeline="tf.data")
    python = data_lib.load_dataset(spec, pipeline="python")
    for split in ("validation", "test"):
        want = batches(data_lib.eval_dataset(tf_data, getattr(tf_data, split), size, channels, 16,
                                             pad=True))
        got = batches(data_lib.eval_dataset(python, getattr(python, split), size, channels, 16,
                                            pad=True))
        assert len(got) == len(want) == data_lib.padded_size(python.validation.size if split ==
                                                             "validation" else python.test.size,
                                                             16) // 16
        for got_batch, want_batch in zip(got, want):
            for got_part, want_part in zip(got_batch, want_batch):
                assert got_part.shape == want_part.shape and got_part.dtype == want_part.dtype
                np.testing.assert_allclose(got_part, want_part, atol=2e-6 + levels / 127.5)


PARTLY_READ_CACHE = "did not fully read the dataset being cached"


@pytest.mark.parametrize("pipeline", ["tf.data", "python"])
def test_first_evaluation_batch_is_read_without_the_cache(capfd, pipeline):
    """The probes' batch (gradient norms, residual stream) is `eval_dataset`'s first one,
    read past tf.data's cache: a cache read in part is discarded with a warning that
    blames the input pipeline (the control reads it through the cache)."""
    data = data_lib.load_dataset("digits", pipeline=pipeline)
    images, labels = data_lib.first_eval_batch(data, data.validation, (12, 12), 1, 40)
    assert PARTLY_READ_CACHE not in capfd.readouterr().err
    want = batches(data_lib.eval_dataset(data, data.validation, (12, 12), 1, 40))[0]
    assert isinstance(images, np.ndarray) and images.shape == (40, 12, 12, 1)
    np.testing.assert_array_equal(images, want[0])
    np.testing.assert_array_equal(labels, want[1])
    if pipeline == "tf.data":
        next(iter(data_lib.eval_dataset(data, data.validation, (12, 12), 1, 40)))
        if PARTLY_READ_CACHE not in capfd.readouterr().err:
            pytest.skip("this TensorFlow does not warn of a cache read in part: the check "
                        "above could not have failed")


def test_train_batches_resume_exactly_split_into_shares_and_permute_each_pass():
    data = data_lib.load_dataset("digits", pipeline="python")
    augmentation = data_lib.Augmentation(crop="pad", crop_padding=2, flip=True)
    stream = data_lib.train_stream(data, (12, 12), 1, 64, 3, augmentation, 0, 50)
    assert isinstance(stream, python_data.TrainBatches) and len(stream) == 50
    later = data_lib.train_stream(data, (12, 12), 1, 64, 3, augmentation, 7, 50)
    for step in (7, 8, 30):
        for whole, resumed in zip(stream[step], later[step - 7]):
            np.testing.assert_array_equal(whole, resumed)
    halves = [data_lib.train_stream(data, (12, 12), 1, 64, 3, augmentation, 0, 50, share=(i, 2))[5]
              for i in range(2)]
    for part in range(2):
        np.testing.assert_array_equal(np.concatenate([h[part] for h in halves]), stream[5][part])
    size = data.train.size
    first_pass = [stream.example(p)[1] for p in range(size)]
    second_pass = [stream.example(p)[1] for p in range(size, 2 * size)]
    assert sorted(first_pass) == sorted(second_pass) == list(range(size))
    assert first_pass != second_pass
    images, labels = stream[0]
    assert images.shape == (64, 12, 12, 1) and images.dtype == np.float32
    assert images.min() >= -1.0 and images.max() <= 1.0
    np.testing.assert_array_equal(labels.sum(axis=1), 1.0)


def test_a_training_split_is_decoded_once_while_it_fits_in_memory(tmp_path, monkeypatch):
    """Two passes over a folder read each file once, keeping images at the model's size as
    the decoder's uint8; past the memory bound the rest is decoded at every read; the
    batches are the same either way."""
    write_image_folder(tmp_path / "images")  # 12 x 12 PNG files
    data = data_lib.load_dataset(f"folder:{tmp_path / 'images'}", pipeline="python")
    augmentation = data_lib.Augmentation(crop="pad", crop_padding=2, flip=True)
    reads = []
    load_image = decoded_images.load_image
    monkeypatch.setattr(decoded_images, "load_image",
                        lambda *a: reads.append(a[0]) or load_image(*a))
    two_passes = data.train.size  # steps of 2 examples
    kept = data_lib.train_stream(data, (12, 12), 3, 2, 0, augmentation, 0, two_passes)
    kept_batches = batches(kept)
    assert sorted(reads) == sorted(set(reads)) and len(reads) == data.train.size
    assert {(image.dtype, image.shape) for image in kept.read.decoded.values()} == {
        (np.dtype("uint8"), (12, 12, 3))}
    resized = data_lib.train_stream(data, (10, 10), 3, 2, 0, augmentation, 0, 1)
    resized[0]
    assert {image.dtype for image in resized.read.decoded.values()} == {np.dtype("float32")}
    reads.clear()
    half = 12 * 12 * 3 * (data.train.size // 2)  # bytes: half of the split, as uint8
    monkeypatch.setattr(decoded_images, "KEEP_DECODED_BYTES", half)
    decoded = data_lib.train_stream(data, (12, 12), 3, 2, 0, augmentation, 0, two_passes)
    for got, want in zip(batches(decoded), kept_batches):
        for got_part, want_part in zip(got, want):
            np.testing.assert_array_equal(got_part, want_part)
    assert decoded.read.kept_bytes == half and len(decoded.read.decoded) == data.train.size // 2
    assert len(reads) == 2 * data.train.size - data.train.size // 2


def randaugment_folder(tmp_path):
    write_image_folder(tmp_path / "images", per_class=8)
    return data_lib.load_dataset(f"folder:{tmp_path / 'images'}", pipeline="python")


def test_randaugment_mixup_and_cutmix_resume_exactly_in_the_python_pipeline(tmp_path):
    """RandAugment is keyed by each image's position and MixUp and CutMix by the step: a
    stream started at a later step gives the full stream's batches there, and a
    process's share of a batch is that share of the whole batch's RandAugment."""
    data = randaugment_folder(tmp_path)
    for mixing in (dict(mixup=0.2), dict(cutmix=1.0), dict(mixup=0.2, cutmix=1.0)):
        augmentation = data_lib.Augmentation(flip=True, randaugment_ops=2, **mixing)
        assert data_lib.resumes_exactly(augmentation, "python")
        assert not data_lib.resumes_exactly(augmentation, "tf.data")
        stream = data_lib.train_stream(data, (12, 12), 3, 4, 1, augmentation, 0, 6)
        whole = batches(stream)
        later = data_lib.train_stream(data, (12, 12), 3, 4, 1, augmentation, 3, 6)
        for step in (3, 5):
            for got, want in zip(later[step - 3], whole[step]):
                np.testing.assert_array_equal(got, want)
        assert not np.array_equal(whole[3][0], whole[4][0])
    augmentation = data_lib.Augmentation(flip=True, randaugment_ops=2)
    whole = data_lib.train_stream(data, (12, 12), 3, 4, 1, augmentation, 0, 3)[2]
    halves = [data_lib.train_stream(data, (12, 12), 3, 4, 1, augmentation, 0, 3, share=(i, 2))[2]
              for i in range(2)]
    for part in range(2):
        np.testing.assert_array_equal(np.concatenate([h[part] for h in halves]), whole[part])


def test_randaugment_augments_each_image_on_its_own():
    """Each image of a batch is Keras' RandAugment on that image alone with the
    generator at the image's key (Keras' layer on a batch would draw one pair of
    operations for the batch and equalize with the batch's histogram), whatever else
    is in the batch: the layer's draws, and the operations they chose applied in turn,
    each to a copy of the image. That is the layer's call under JAX and TensorFlow;
    under PyTorch the layer's call also brightens every image (its RandomBrightness
    adds in place to the image that every operation is given)."""
    import keras

    from keras_vitnorm.training.data import augmentation as augmentation_lib

    augmentation = data_lib.Augmentation(randaugment_ops=2, randaugment_factor=0.9)
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 255, (6, 10, 10, 3)).astype("float32")
    images[3] = 128.0  # a flat image: some operations leave it as it is, others do not
    positions = np.arange(40, 46)
    each = keyed_layers.PerImageRandAugment(augmentation, 3, 5, (10, 10))(images, positions)
    layer = keras.layers.RandAugment(value_range=(0, 255), num_ops=2, factor=0.9, seed=5)
    keys = augmentation_lib.seed_states(5, augmentation_lib.RANDAUGMENT, positions,
                                        layer.generator.state.dtype)
    for image, key, got in zip(images, keys, each):
        layer.generator.state.assign(key)
        draws = layer.get_random_transformation(image, training=True)
        names = list(draws["transforms"])
        want = keras.ops.expand_dims(keras.ops.convert_to_tensor(image), 0)
        for index in keras.ops.convert_to_numpy(draws["layer_idxes"]):
            name = names[int(index)]
            want = getattr(layer, name).transform_images(
                keras.ops.copy(want), draws["transforms"][name], training=True)
        np.testing.assert_allclose(got, keras.ops.convert_to_numpy(want)[0], atol=1e-3)
        if BACKEND != "torch":
            layer.generator.state.assign(key)
            np.testing.assert_allclose(
                got, keras.ops.convert_to_numpy(layer(image, training=True)), atol=1e-3)
    assert not np.allclose(each, images, atol=1)
    # Another batch around the same image at the same position: the same output.
    others = rng.uniform(0, 255, (3, 10, 10, 3)).astype("float32")
    mixed = keyed_layers.PerImageRandAugment(augmentation, 3, 5, (10, 10))(
        np.stack([others[0], images[2], others[1]]), np.array([7, 42, 9]))
    np.testing.assert_array_equal(mixed[1], each[2])


def test_under_jax_randaugment_on_each_image_compiles_once_not_for_each_image(caplog):
    """RandAugment runs on each image on its own. Under JAX that is one compiled
    program for every image of a size: eager, each image's switch compiled anew (its
    draws are constants there), and a process that held every such program ran out of
    memory mappings within a few thousand images."""
    if BACKEND != "jax":
        pytest.skip("JAX compiles programs; this backend runs the layer eagerly")
    import jax

    augment = keyed_layers.PerImageRandAugment(data_lib.Augmentation(randaugment_ops=2), 3, 0,
                                              (12, 12))
    images = np.random.default_rng(0).uniform(0, 255, (4, 12, 12, 3)).astype(np.float32)
    first = augment(images, np.arange(4))
    with jax.log_compiles(), caplog.at_level("WARNING"):
        later = augment(images, np.arange(4, 8))
    assert sum("Compiling" in record.getMessage() for record in caplog.records) == 0
    assert not np.array_equal(first, later)  # other positions, other draws


def test_seed_states_are_keyed_by_seed_purpose_and_index():
    from keras_vitnorm.training.data import augmentation as augmentation_lib

    states = augmentation_lib.seed_states(3, augmentation_lib.RANDAUGMENT, [0, 5, 2**31 - 1],
                                          "int32")
    assert states.dtype == np.int32 and states[:, 1].tolist() == [0, 5, 2**31 - 1]
    assert len(set(states[:, 0].tolist())) == 1 and 0 <= states[0, 0] < 2**31
    other_purpose = augmentation_lib.seed_states(3, augmentation_lib.BATCH_MIXING, [0], "int32")
    other_seed = augmentation_lib.seed_states(4, augmentation_lib.RANDAUGMENT, [0], "int32")
    assert other_purpose[0, 0] != states[0, 0] != other_seed[0, 0]
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31\); got 2147483648"):
        augmentation_lib.seed_states(3, 0, [2**31], "uint32")


def test_a_pad_crop_window_is_the_window_of_the_zero_padded_image():
    image = np.random.default_rng(0).random((7, 5, 3)).astype(np.float32)
    for pad in (0, 1, 4):
        padded = np.pad(image, [(pad, pad), (pad, pad), (0, 0)])
        for top in range(2 * pad + 1):
            for left in range(2 * pad + 1):
                np.testing.assert_array_equal(
                    keyed_crops._window_of_padded(image, pad, top, left, 7, 5),
                    padded[top:top + 7, left:left + 5])


def test_keyed_crops_and_flips_are_the_tf_transformations():
    image = np.arange(6 * 6 * 1, dtype=np.float32).reshape(6, 6, 1)
    rng = np.random.default_rng(0)
    pad = data_lib.Augmentation(crop="pad", crop_padding=2)
    padded = np.pad(image, [(2, 2), (2, 2), (0, 0)])
    windows = {padded[i:i + 6, j:j + 6].tobytes() for i in range(5) for j in range(5)}
    crops = [keyed_crops.keyed_crop_and_flip(image, pad, (6, 6), rng) for _ in range(200)]
    assert all(c.tobytes() in windows for c in crops)
    assert len({c.tobytes() for c in crops}) == 25  # every offset is drawn
    flips = [keyed_crops.keyed_crop_and_flip(image, data_lib.Augmentation(flip=True), (6, 6), rng)
             for _ in range(200)]
    mirrored = sum(np.array_equal(f, image[:, ::-1]) for f in flips)
    assert mirrored + sum(np.array_equal(f, image) for f in flips) == 200 and 60 < mirrored < 140
    # zoom=0 keeps the whole image (crop_and_resize of the full box is the image itself).
    same = keyed_crops.keyed_crop_and_flip(image, data_lib.Augmentation(crop="zoom", zoom=0.0),
                                           (6, 6), rng)
    np.testing.assert_allclose(same, image, atol=1e-5)


def test_pipeline_choice_is_checked():
    with pytest.raises(ValueError, match="'python' reads digits and folder.*tfds:mnist"):
        data_lib.load_dataset("tfds:mnist", pipeline="python")
    with pytest.raises(ValueError, match="input_pipeline.*'tfdata'.*'tf.data'"):
        data_lib.load_dataset("digits", pipeline="tfdata")


def test_a_damaged_image_is_named_by_the_python_pipeline(tmp_path):
    root = tmp_path / "images"
    write_image_folder(root)
    damaged = root / "dog" / "3.png"
    data = data_lib.load_dataset(f"folder:{root}", pipeline="python")
    damaged.write_bytes(damaged.read_bytes()[:40] + b"\x00" * 200 + damaged.read_bytes()[-12:])
    with pytest.raises(ValueError, match=f"{damaged} does not decode"):
        batches(data_lib.eval_dataset(data, data.train, (12, 12), 3, 64))


@pytest.mark.skipif(BACKEND == "tensorflow", reason="the TensorFlow backend is TensorFlow")
def test_training_runs_with_tensorflow_unimportable(tmp_path):
    """The README's command in small, with `import tensorflow` failing as it does where
    TensorFlow is not installed: the python pipeline trains, evaluates and saves."""
    run_dir = tmp_path / "run"
    argv = ["train", "--steps", "6", "--steps-per-epoch", "3", "--batch-size", "32",
            "--warmup-steps", "1", "--crop", "pad", "--flip", "--verbose", "2",
            "--output-dir", str(run_dir),
            *(f"--{key.replace('_', '-')}={value}" for key, value in TINY.items())]
    child = run_python(f"""
        import sys
        sys.modules["tensorflow"] = None  # `import tensorflow` raises ImportError
        from keras_vitnorm.cli import main
        code = main({argv!r})
        assert not any(name.startswith("tensorflow") and sys.modules[name] is not None
                       for name in sys.modules), "TensorFlow was imported"
        raise SystemExit(code)
    """)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "No TensorBoard logs" in child.stdout
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["steps"] == 6
    settings = json.loads((run_dir / "train_config.json").read_text())
    assert settings["input_pipeline"] == "auto"


def png_16_bit_rgb(path, image):
    """Writes `image` (uint16, `(h, w, 3)`) as a 48-bit PNG (Pillow writes none)."""
    import struct
    import zlib

    height, width = image.shape[:2]
    rows = b"".join(b"\x00" + row.astype(">u2").tobytes() for row in image)

    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                     + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def image_modes_folder(root):
    """A folder with a class per image mode and format Pillow writes; returns
    `{path: (expected uint8 RGB image, lossy)}`: the 8-bit image each file holds (16-bit
    values as their high byte), and whether its format is lossy (JPEG)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    expected = {}

    def palette(image):
        with_transparency = image.convert("P")
        with_transparency.info["transparency"] = 0
        return with_transparency

    writers = {  # class: (extension, Pillow image of an RGB array)
        "mode_1": ("png", lambda rgb: rgb.convert("1")),
        "mode_L": ("png", lambda rgb: rgb.convert("L")),
        "mode_P": ("png", lambda rgb: rgb.convert("P")),
        "mode_P_transparency": ("png", palette),
        "mode_RGBA": ("png", lambda rgb: rgb.convert("RGBA")),
        "mode_LA": ("png", lambda rgb: rgb.convert("LA")),
        "grayscale_jpeg": ("jpg", lambda rgb: rgb.convert("L")),
        "rgb_jpeg": ("jpg", lambda rgb: rgb),
        "cmyk_jpeg": ("jpg", lambda rgb: rgb.convert("CMYK")),
        "gif": ("gif", lambda rgb: rgb.convert("P")),
        "bmp": ("bmp", lambda rgb: rgb),
    }
    for name, (extension, write) in writers.items():
        (root / name).mkdir(parents=True)
        for i in range(2):
            path = root / name / f"{i}.{extension}"
            write(Image.fromarray(rng.integers(0, 256, (12, 12, 3)).astype("uint8"))).save(path)
            with Image.open(path) as image:
                expected[str(path)] = (np.asarray(image.convert("RGB")), extension == "jpg")
    for name in ("gray_16_bit_png", "rgb_16_bit_png"):
        (root / name).mkdir()
        for i in range(2):
            path = root / name / f"{i}.png"
            high = rng.integers(0, 65536, (12, 12, 3)).astype("uint16")
            if name == "gray_16_bit_png":
                high = high[..., :1]
                Image.fromarray(high[..., 0]).save(path)
            else:
                png_16_bit_rgb(path, high)
            eight = np.broadcast_to((high >> 8).astype("uint8"), (12, 12, 3))
            expected[str(path)] = (eight, False)
    return expected


@pytest.mark.one_backend
@pytest.mark.parametrize("pipeline", ["tf.data", "python"])
def test_every_image_mode_and_bit_depth_reads_as_its_8_bit_image(tmp_path, pipeline):
    """1, L, P (with transparency too), RGBA, LA, 16-bit grayscale and RGB PNGs,
    grayscale, RGB and CMYK JPEGs, GIF and BMP, read as RGB and as grayscale: each the
    8-bit image it holds (a 16-bit value's high byte; grayscale within a grey level of
    Pillow's weighting; JPEG within 4 levels: TensorFlow's fast IDCT against libjpeg's
    accurate one in Pillow)."""
    expected = image_modes_folder(tmp_path / "images")
    data = data_lib.load_dataset(f"folder:{tmp_path / 'images'}", pipeline=pipeline,
                                 val_fraction=0.5)
    seen = 0
    for split in (data.train, data.validation, data.test):
        for channels in (3, 1):
            images = np.concatenate([np.asarray(batch[0]) for batch in data_lib.eval_dataset(
                data, split, (12, 12), channels, 8)])
            for path, image in zip(split.arrays[0], (images + 1.0) * 127.5):
                want, lossy = expected[str(path)]
                if channels == 1:
                    want = want.astype("float32") @ np.float32([0.299, 0.587, 0.114])[:, None]
                levels = (4.0 if lossy else 0.0) + (1.0 if channels == 1 else 0.0)
                np.testing.assert_allclose(image, want, atol=levels + 1e-3, err_msg=str(path))
                seen += 1
    assert seen == 2 * len(expected)
