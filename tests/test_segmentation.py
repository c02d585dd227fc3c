"""The segmenter, its loss and metrics, its datasets and its training command."""

import json
import os

import keras
import numpy as np
import pytest
from PIL import Image

from keras_vitnorm import ViT
from keras_vitnorm.models.segmenter import PixelAccuracy
from keras_vitnorm.models.segmenter import Segmenter
from keras_vitnorm.models.segmenter import mean_iou
from keras_vitnorm.models.segmenter import segmentation_loss
from keras_vitnorm.training import segmentation_data
from keras_vitnorm.training.segmentation import SegmentationConfig
from keras_vitnorm.training.segmentation import train_segmenter
from keras_vitnorm.training.segmentation_data import IGNORE_CLASS
from keras_vitnorm.training.segmentation_data import load_segmentation_data

TINY = dict(image_size=16, patch_size=4, width=32, depth=2, num_heads=4, mlp_dim=64, num_classes=7)


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def _log_softmax(logits):
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


@pytest.mark.parametrize("pooling", ["cls", "gap"])
def test_segmenter_maps_patch_tokens_to_upsampled_pixel_logits(pooling):
    vit = ViT(**TINY, pooling=pooling, stem="dual_patchnorm")
    segmenter = Segmenter(vit, num_classes=3)
    images = np.random.default_rng(0).uniform(-1, 1, (2, 16, 16, 3)).astype("float32")
    logits = segmenter(images)
    assert tuple(logits.shape) == (2, 16, 16, 3)
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"
    # The encoder is the ViT's own: same variables, and its classifier head is not used.
    vit_weights = {id(v) for v in vit.weights if not v.path.startswith("head/")}
    assert vit_weights <= {id(v) for v in segmenter.weights}
    assert not any(v.path.startswith("head/") for v in segmenter.weights)

    # The head is linear on the patch grid, then a bilinear upsampling of the logit map.
    head = segmenter.get_layer("segmentation_head")
    head.kernel.assign(np.random.default_rng(1).normal(size=head.kernel.shape).astype("float32"))
    tokens = _numpy(vit.backbone()(images)["tokens"])
    patches = tokens[:, 1:] if pooling == "cls" else tokens
    grid = patches.reshape(2, 4, 4, -1) @ _numpy(head.kernel) + _numpy(head.bias)
    expected = _numpy(keras.ops.image.resize(grid, (16, 16), interpolation="bilinear"))
    np.testing.assert_allclose(_numpy(segmenter(images)), expected, atol=2e-5)


def test_a_segmenter_on_a_non_square_vit_predicts_every_pixel_of_its_images():
    vit = ViT(**{**TINY, "image_size": [16, 24]})
    segmenter = Segmenter(vit, num_classes=3)
    assert segmenter.grid_size == (4, 6)
    images = np.zeros((2, 16, 24, 3), "float32")
    assert tuple(segmenter(images).shape) == (2, 16, 24, 3)
    assert segmenter.predict_masks(images).shape == (2, 16, 24)


def test_loss_and_metrics_leave_out_the_ignore_label_as_numpy_does():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 4, 4, 3)).astype("float32")
    labels = rng.integers(0, 3, (2, 4, 4)).astype("int32")
    labels[0, :2] = IGNORE_CLASS
    kept = labels != IGNORE_CLASS
    log_p = _log_softmax(logits.astype("float64"))
    picked = np.take_along_axis(log_p, np.where(kept, labels, 0)[..., None], -1)[..., 0]
    expected_loss = -picked[kept].mean()
    loss = _numpy(segmentation_loss(IGNORE_CLASS)(labels, logits))
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)

    predicted = logits.argmax(-1)
    ious = []
    for c in range(3):
        union = np.sum(((labels == c) | (predicted == c)) & kept)
        if union:
            ious.append(np.sum((labels == c) & (predicted == c) & kept) / union)
    metric = mean_iou(3, IGNORE_CLASS)
    metric.update_state(labels, logits)
    np.testing.assert_allclose(_numpy(metric.result()), np.mean(ious), rtol=1e-5)

    accuracy = PixelAccuracy(IGNORE_CLASS)
    accuracy.update_state(labels, logits)
    np.testing.assert_allclose(_numpy(accuracy.result()), np.mean(predicted[kept] == labels[kept]), rtol=1e-6)


def test_segmenter_config_errors():
    with pytest.raises(ValueError, match="needs a keras_vitnorm ViT"):
        Segmenter(keras.Sequential([keras.layers.Dense(2)]), num_classes=3)
    with pytest.raises(ValueError, match="num_classes must be a positive integer, got 0"):
        Segmenter(ViT(**TINY), num_classes=0)


def test_fit_lowers_the_loss_and_the_saved_segmenter_reloads(tmp_path):
    keras.utils.set_random_seed(0)
    images = np.random.default_rng(0).uniform(-1, 1, (16, 16, 16, 3)).astype("float32")
    masks = (images[..., 0] > 0).astype("int32")
    masks[:, 0] = IGNORE_CLASS
    segmenter = Segmenter(ViT(**TINY), num_classes=2)
    segmenter.compile(keras.optimizers.Adam(3e-3), loss=segmentation_loss(IGNORE_CLASS),
                      metrics=[mean_iou(2, IGNORE_CLASS)])
    before = segmenter.evaluate(images, masks, verbose=0, return_dict=True)["loss"]
    segmenter.fit(images, masks, batch_size=8, epochs=4, verbose=0)
    after = segmenter.evaluate(images, masks, verbose=0, return_dict=True)["loss"]
    assert after < before - 0.01

    path = os.path.join(tmp_path, "segmenter.keras")
    segmenter.save(path)
    restored = keras.saving.load_model(path)
    assert isinstance(restored, Segmenter)
    np.testing.assert_allclose(_numpy(restored(images)), _numpy(segmenter(images)), atol=1e-6)
    np.testing.assert_array_equal(restored.predict_masks(images), _numpy(segmenter(images)).argmax(-1))


def test_digit_scenes_are_deterministic_labelled_and_checked():
    images, masks = segmentation_data.digit_scenes(6, image_size=24, split="test")
    again, _ = segmentation_data.digit_scenes(6, image_size=24, split="test")
    np.testing.assert_array_equal(images, again)
    assert images.shape == (6, 24, 24, 3) and images.dtype == np.uint8
    labels = set(np.unique(masks).tolist())
    assert 0 in labels and IGNORE_CLASS in labels and labels - {0, IGNORE_CLASS}
    assert labels <= set(range(11)) | {IGNORE_CLASS}
    other, _ = segmentation_data.digit_scenes(6, image_size=24, split="train")
    assert not np.array_equal(images, other)
    with pytest.raises(ValueError, match="image_size >= 16"):
        segmentation_data.digit_scenes(2, image_size=8)
    with pytest.raises(ValueError, match="Unknown segmentation dataset 'digit_scene'.*Did you mean 'digit_scenes'"):
        load_segmentation_data("digit_scene", 32)
    with pytest.raises(ValueError, match="needs num_classes"):
        load_segmentation_data("folder:/nowhere", 32)


def _write_pair(root, name, size=(12, 10), mask_size=None, labels=(0, 1, 2)):
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    os.makedirs(os.path.join(root, "masks"), exist_ok=True)
    rng = np.random.default_rng(len(name))
    image = rng.integers(0, 255, (size[1], size[0], 3)).astype(np.uint8)
    width, height = mask_size or size
    mask = rng.choice(labels, (height, width)).astype(np.uint8)
    Image.fromarray(image).save(os.path.join(root, "images", f"{name}.png"))
    Image.fromarray(mask, mode="L").save(os.path.join(root, "masks", f"{name}.png"))


def test_folder_dataset_reads_pairs_carves_splits_and_names_bad_files(tmp_path):
    root = str(tmp_path / "data")
    for i in range(20):
        _write_pair(root, f"img{i:02d}", labels=(0, 1, 2, IGNORE_CLASS))
    data = load_segmentation_data(f"folder:{root}", 16, num_classes=3)
    assert data.train[0].shape == (16, 16, 16, 3) and data.train[1].shape == (16, 16, 16)
    assert len(data.validation[0]) == 2 and len(data.test[0]) == 2
    assert set(np.unique(data.train[1]).tolist()) <= {0, 1, 2, IGNORE_CLASS}

    with pytest.raises(ValueError, match=r"labels \[2\] outside \[0, 2\)"):
        load_segmentation_data(f"folder:{root}", 16, num_classes=2)

    _write_pair(root, "odd", mask_size=(8, 8))
    with pytest.raises(ValueError, match="odd.png is 8x8 but its image .*odd.png is 12x10"):
        load_segmentation_data(f"folder:{root}", 16, num_classes=3)
    os.remove(os.path.join(root, "masks", "odd.png"))
    with pytest.raises(ValueError, match="odd.png has no mask"):
        load_segmentation_data(f"folder:{root}", 16, num_classes=3)
    with pytest.raises(ValueError, match="needs images/ and masks/"):
        load_segmentation_data(f"folder:{tmp_path}", 16, num_classes=3)


def test_tfds_segmentation_dataset_through_mock_data():
    tfds = pytest.importorskip("tensorflow_datasets")
    import tensorflow as tf

    def examples(self, split, **kwargs):
        rng = np.random.default_rng(0)
        count = 12 if split == "train" else 5
        images = rng.integers(0, 255, (count, 20, 24, 3)).astype(np.uint8)
        masks = rng.integers(0, 4, (count, 20, 24, 1)).astype(np.uint8)
        return tf.data.Dataset.from_tensor_slices({"image": images, "segmentation_mask": masks})

    with tfds.testing.mock_data(as_dataset_fn=examples):
        data = load_segmentation_data("tfds:oxford_iiit_pet", 16, num_classes=4)
        assert data.train[0].shape == (11, 16, 16, 3) and data.train[1].shape == (11, 16, 16)
        assert len(data.validation[0]) == 1 and len(data.test[0]) == 5
        with pytest.raises(ValueError, match=r"oxford_iiit_pet \(train\): masks hold labels \[3\]"):
            load_segmentation_data("tfds:oxford_iiit_pet", 16, num_classes=3)
    # tfds' own random mock data draws the image and mask sizes independently.
    with tfds.testing.mock_data(num_examples=4, policy=tfds.testing.MockPolicy.USE_CODE):
        with pytest.raises(ValueError, match="oxford_iiit_pet \\(train\\): an image of .* has a mask of"):
            load_segmentation_data("tfds:oxford_iiit_pet", 16, num_classes=4)
        with pytest.raises(ValueError, match="not a segmentation dataset"):
            load_segmentation_data("tfds:mnist", 16, num_classes=4)


def test_train_segmenter_writes_its_run_and_refuses_to_replace_it(tmp_path):
    config = SegmentationConfig(
        image_size=16, epochs=1, batch_size=16, warmup_steps=0, scenes=(32, 16, 16),
        model=dict(patch_size=4, width=32, depth=1, num_heads=4, mlp_dim=64, stem="dual_patchnorm"),
    )
    metrics = train_segmenter(config, output_dir=str(tmp_path), verbose=0)
    assert 0 <= metrics["test_mean_iou"] <= 1 and len(metrics["history"]["val_mean_iou"]) == 1
    with open(tmp_path / "metrics.json") as f:
        assert json.load(f)["test_mean_iou"] == metrics["test_mean_iou"]
    restored = keras.saving.load_model(tmp_path / "segmenter.keras")
    assert restored.get_config()["vit"]["stem"] == "dual_patchnorm"
    with pytest.raises(FileExistsError, match="already holds a finished segmentation run"):
        train_segmenter(config, output_dir=str(tmp_path), verbose=0)
    with pytest.raises(ValueError, match="epochs must be a positive integer"):
        SegmentationConfig(epochs=0)


# The command's seeds, skipping and report; the segmenter's training on each backend is
# test_train_segmenter_writes_its_run_and_refuses_to_replace_it's.
@pytest.mark.one_backend
def test_segment_command_runs_seeds_skips_finished_ones_and_reports_a_ci(tmp_path, capsys):
    from keras_vitnorm.cli import main

    argv = ["segment", "--output-dir", str(tmp_path), "--image-size", "16", "--patch-size", "4",
            "--width", "32", "--depth", "1", "--num-heads", "4", "--mlp-dim", "64", "--scenes", "32", "16", "16",
            "--epochs", "1", "--batch-size", "16", "--warmup-steps", "0", "--seeds", "0", "1", "--verbose", "0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "seed 1: test mean IoU" in out and "test_mean_iou over 2 seeds" in out and "(95% CI)" in out
    first = (tmp_path / "seed_0" / "metrics.json").read_text()
    assert main(argv + ["--verbose", "1"]) == 0
    assert "seed 0: finished earlier" in capsys.readouterr().out
    assert (tmp_path / "seed_0" / "metrics.json").read_text() == first

    assert main(["segment", "--output-dir", str(tmp_path), "--dataset", "folder:/nowhere"]) == 2
    assert "needs num_classes" in capsys.readouterr().err
    assert main(["segment", "--output-dir", str(tmp_path), "--epochs", "0"]) == 2
    assert "epochs must be a positive integer, got 0" in capsys.readouterr().err
