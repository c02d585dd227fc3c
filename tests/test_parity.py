"""Every backend reproduces the committed fixtures (tools/make_parity_fixtures.py)."""

import glob
import json
import os

import keras
import numpy as np
import pytest

import keras_vitnorm
from keras_vitnorm.backend import value_and_gradients

FIXTURE_DIR = os.path.join(os.path.dirname(__file__), "fixtures", "parity")
FIXTURES = sorted(glob.glob(os.path.join(FIXTURE_DIR, "*.npz")))
LOGIT_ATOL = 1e-5


def load_fixture(path):
    with np.load(path) as data:
        arrays = {key: data[key] for key in data.files}
    weights = {
        key[len("weight:"):]: value for key, value in arrays.items() if key.startswith("weight:")
    }
    return json.loads(str(arrays["config"])), weights, arrays


def test_fixtures_exist():
    assert len(FIXTURES) >= 9, f"expected the committed parity fixtures in {FIXTURE_DIR}"


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: os.path.basename(p)[:-4])
def test_logits_and_input_gradients_match_fixture(path):
    config, weights, data = load_fixture(path)
    model = keras_vitnorm.ViT(**config)
    model.load_weights_by_path(weights)
    logits = keras.ops.convert_to_numpy(model(data["images"], training=False))
    assert np.abs(data["logits"]).max() > 0.5  # logits of order 1
    np.testing.assert_allclose(logits, data["logits"], rtol=0, atol=LOGIT_ATOL)

    cotangent = data["cotangent"]
    _, input_gradient, _ = value_and_gradients(
        model, data["images"], lambda y: keras.ops.sum(keras.ops.multiply(y, cotangent))
    )
    scale = max(1.0, float(np.abs(data["input_gradient"]).max()))
    np.testing.assert_allclose(
        input_gradient, data["input_gradient"], rtol=0, atol=LOGIT_ATOL * scale
    )


def test_keras_weights_file_from_another_backend_loads():
    config, _, data = load_fixture(os.path.join(FIXTURE_DIR, "base.npz"))
    model = keras_vitnorm.ViT(**config)
    model.load_weights(os.path.join(FIXTURE_DIR, "base.weights.h5"))
    logits = keras.ops.convert_to_numpy(model(data["images"], training=False))
    np.testing.assert_allclose(logits, data["logits"], rtol=0, atol=LOGIT_ATOL)


def test_preset_directory_written_here_reloads_with_same_outputs(tmp_path):
    config, weights, data = load_fixture(os.path.join(FIXTURE_DIR, "conv_batchnorm.npz"))
    model = keras_vitnorm.ViT(**config)
    model.load_weights_by_path(weights)
    model.save_to_preset(tmp_path / "preset")
    reloaded = keras_vitnorm.ViT.from_preset(str(tmp_path / "preset"))
    logits = keras.ops.convert_to_numpy(reloaded(data["images"], training=False))
    np.testing.assert_allclose(logits, data["logits"], rtol=0, atol=LOGIT_ATOL)
