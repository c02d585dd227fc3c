"""LiT: the contrastive losses against NumPy, the text tower, the frozen image tower, zero-shot."""

import json

import keras
import numpy as np
import pytest

from keras_vitnorm import ViT
from keras_vitnorm import cli
from keras_vitnorm.models.contrastive import LiT
from keras_vitnorm.models.contrastive import TextEncoder
from keras_vitnorm.models.contrastive import caption_vocabulary
from keras_vitnorm.models.contrastive import sigmoid_contrastive_loss
from keras_vitnorm.models.contrastive import softmax_contrastive_loss
from keras_vitnorm.training import contrastive as contrastive_training
from test_training import write_image_folder

TOWER = dict(image_size=16, patch_size=4, width=32, depth=1, num_heads=4, mlp_dim=64, num_classes=3)
TEXT = dict(max_length=8, embed_dim=16, text_width=32, text_depth=1, text_heads=4, text_mlp_dim=64)
CAPTIONS = [f"a photo of the digit {w}" for w in ("one", "two", "three", "four")] * 2


def _numpy(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def _log_softmax(z, axis):
    z = z - z.max(axis, keepdims=True)
    return z - np.log(np.exp(z).sum(axis, keepdims=True))


def _model(loss="softmax", freeze=True):
    vit = ViT(**TOWER, stem="dual_patchnorm")
    return LiT(vit, caption_vocabulary(CAPTIONS), loss=loss, freeze_image_tower=freeze, **TEXT)


def _batch(model):
    images = np.random.default_rng(0).uniform(-1, 1, (8, 16, 16, 3)).astype("float32")
    return {"images": images, "tokens": model.tokenize(CAPTIONS)}


def test_contrastive_losses_match_numpy():
    logits = np.random.default_rng(0).normal(0, 3, (5, 5)).astype("float32")
    diagonal = np.arange(5)
    expected = -0.5 * (_log_softmax(logits.astype("float64"), 1)[diagonal, diagonal].mean()
                       + _log_softmax(logits.astype("float64"), 0)[diagonal, diagonal].mean())
    np.testing.assert_allclose(_numpy(softmax_contrastive_loss(logits)), expected, rtol=1e-5)
    signs = 2 * np.eye(5) - 1
    expected = np.mean(np.sum(np.log1p(np.exp(-signs * logits.astype("float64"))), axis=1))
    np.testing.assert_allclose(_numpy(sigmoid_contrastive_loss(logits)), expected, rtol=1e-5)


@pytest.mark.parametrize("loss", ["softmax", "sigmoid"])
def test_logits_are_scaled_cosine_similarities(loss):
    model = _model(loss)
    batch = _batch(model)
    logits = _numpy(model(batch))
    assert logits.shape == (8, 8) and logits.dtype == np.float32
    images, texts = _numpy(model.encode_images(batch["images"])), _numpy(model.encode_text(batch["tokens"]))
    np.testing.assert_allclose(np.linalg.norm(images, axis=1), 1, rtol=1e-5)
    expected = images @ texts.T * 10.0 + (-10.0 if loss == "sigmoid" else 0.0)  # initial t = 10, b = -10
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def test_text_encoder_pools_the_non_padding_tokens():
    encoder = TextEncoder(vocabulary_size=20, max_length=6, width=16, depth=1, num_heads=2, mlp_dim=32)
    tokens = np.array([[3, 4, 5, 0, 0, 0], [7, 8, 9, 10, 11, 12]], "int32")
    pooled = _numpy(encoder(tokens))
    x = encoder.token_embedding(tokens) + encoder.position_embedding
    for block in encoder.blocks:
        x = block(x)
    x = _numpy(encoder.final_norm(x))
    np.testing.assert_allclose(pooled[0], x[0, :3].mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pooled[1], x[1].mean(0), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="expects 6 tokens per caption"):
        encoder(np.zeros((2, 4), "int32"))


def test_fit_trains_the_text_tower_keeps_the_frozen_tower_and_reloads_frozen(tmp_path):
    keras.utils.set_random_seed(0)
    model = _model()
    batch = _batch(model)
    tower = {v.path: _numpy(v).copy() for v in model.image_encoder.weights}
    assert not any(v.path in tower for v in model.trainable_weights)
    model.compile(keras.optimizers.Adam(3e-3))
    before = float(model.evaluate(batch, batch_size=8, verbose=0))
    model.fit(batch, batch_size=8, epochs=5, verbose=0)
    assert float(model.evaluate(batch, batch_size=8, verbose=0)) < before - 0.05
    assert all(np.array_equal(_numpy(v), tower[v.path]) for v in model.image_encoder.weights)

    path = str(tmp_path / "lit.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    assert isinstance(restored, LiT) and restored.freeze_image_tower and not restored.image_encoder.trainable
    assert len(restored.trainable_weights) == len(model.trainable_weights)
    np.testing.assert_allclose(_numpy(restored(batch)), _numpy(model(batch)), atol=1e-5)
    np.testing.assert_array_equal(restored.tokenize(["a photo of the digit two"]),
                                  model.tokenize(["a photo of the digit two"]))
    restored.compile(keras.optimizers.Adam(3e-3))
    restored.fit(batch, batch_size=8, epochs=1, verbose=0)
    assert all(np.array_equal(_numpy(v), tower[v.path]) for v in restored.image_encoder.weights)

    trainable = _model(freeze=False)
    assert len(trainable.trainable_weights) > len(model.trainable_weights)


def test_zero_shot_classifier_averages_prompts_and_predicts_the_nearest_class():
    model = _model()
    classifier = _numpy(model.zero_shot_classifier(["one", "two", "three"], ["the digit {}", "a {}"]))
    assert classifier.shape == (3, 16)
    prompts = _numpy(model.encode_text(model.tokenize(["the digit two", "a two"])))
    mean = prompts.mean(0)
    np.testing.assert_allclose(classifier[1], mean / np.linalg.norm(mean), rtol=1e-5, atol=1e-6)
    images = _batch(model)["images"]
    expected = (_numpy(model.encode_images(images)) @ classifier.T).argmax(1)
    np.testing.assert_array_equal(model.zero_shot_predict(images, classifier, batch_size=3), expected)


def test_bad_input_is_named():
    model = _model()
    with pytest.raises(ValueError, match="encode_text got an empty batch"):
        model.encode_text(np.zeros((0, 8), "int32"))
    with pytest.raises(ValueError, match="tokenize got no captions"):
        model.tokenize([])
    with pytest.raises(ValueError, match="LiT takes a dict with 'images' and 'tokens', got \\['images'\\]"):
        model({"images": np.zeros((2, 16, 16, 3), "float32")})
    with pytest.raises(ValueError, match="template needs a '\\{\\}'"):
        model.zero_shot_classifier(["one"], ["no slot"])
    with pytest.raises(ValueError, match="Unknown loss='infonce'"):
        LiT(ViT(**TOWER), caption_vocabulary(CAPTIONS), loss="infonce")
    with pytest.raises(ValueError, match="vocabulary must be a TextVectorization vocabulary"):
        LiT(ViT(**TOWER), ["a", "b"])


# The command's seeds, report and skipping; LiT's training on each backend is
# test_validation_batches_mix_classes's, its file test_keras_models.py's.
@pytest.mark.one_backend
def test_lit_command_trains_seeds_and_reports_zero_shot_accuracy(tmp_path, capsys):
    argv = ["lit", "--output-dir", str(tmp_path), "--image-size", "16", "--set", "patch_size=4", "--set", "width=32",
            "--set", "depth=1", "--set", "num_heads=4", "--set", "mlp_dim=64", "--embed-dim", "16",
            "--text-width", "32", "--text-depth", "1", "--text-mlp-dim", "64", "--train-examples", "100",
            "--epochs", "1", "--batch-size", "32", "--warmup-steps", "0", "--seeds", "0", "1", "--verbose", "0"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "seed 1: zero-shot test accuracy" in out and "zero_shot_test_accuracy over 2 seeds" in out
    metrics = json.loads((tmp_path / "seed_0" / "metrics.json").read_text())
    assert 0 <= metrics["zero_shot_test_accuracy"] <= 1 and metrics["config"]["freeze_image_tower"] is True
    assert keras.saving.load_model(tmp_path / "seed_0" / "lit.keras").freeze_image_tower
    assert cli.main(argv[:-2] + ["--verbose", "1"]) == 0
    assert "seed 0: finished earlier" in capsys.readouterr().out
    assert cli.main(["lit", "--output-dir", str(tmp_path / "b"), "--batch-size", "1"]) == 2
    assert "batch_size must be at least 2" in capsys.readouterr().err


def test_validation_batches_mix_classes(tmp_path, monkeypatch):
    # A validation batch of one class has no negatives to tell apart: its loss says nothing.
    captioned = []
    original = contrastive_training.captions_for

    def recording(labels, *args):
        captioned.append(np.asarray(labels))
        return original(labels, *args)

    monkeypatch.setattr(contrastive_training, "captions_for", recording)
    write_image_folder(tmp_path / "data", per_class=80)
    config = contrastive_training.LiTConfig(
        dataset=f"folder:{tmp_path / 'data'}", image_size=16, model=dict(patch_size=4, width=32, depth=1, num_heads=4, mlp_dim=64), embed_dim=16,
        text_width=32, text_depth=1, text_mlp_dim=64, train_examples=40, epochs=1, batch_size=4,
        warmup_steps=0)
    contrastive_training.train_lit(config, verbose=0)
    validation_labels = captioned[1]
    batches = [validation_labels[i:i + 4] for i in range(0, len(validation_labels), 4)]
    assert all(len(np.unique(batch)) > 1 for batch in batches if len(batch) > 1)
