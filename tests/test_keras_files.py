"""`.keras` files saved under each backend load, predict and train on the others.

tests/fixtures/keras_files/<backend>/ holds a ViT (conv stem, BatchNorm: moving
statistics in the file) and a LiT (a ViT tower, a text tower, its vocabulary), each
saved by `model.save` after one AdamW step under that backend
(tools/make_keras_fixtures.py).
Under the running backend, every other backend's files load with Keras' default
`safe_mode=True` (nothing in them is a Python lambda or an unregistered callable),
give the outputs the saving backend computed, and continue `fit` from the saved
optimizer state. Files saved under the running backend itself are the round trip of
tests/test_keras_models.py.
"""

import glob
import json
import os
import zipfile

import keras
import numpy as np
import pytest

from keras_vitnorm import ViT

TINY = {"image_size": 8, "patch_size": 4, "width": 8, "depth": 1, "num_heads": 2, "mlp_dim": 16,
        "num_classes": 3}
FIXTURE_DIR = os.path.join(os.path.dirname(__file__), "fixtures", "keras_files")
BACKEND = keras.backend.backend()
FILES = sorted(path for path in glob.glob(os.path.join(FIXTURE_DIR, "*", "*.keras"))
               if os.path.basename(os.path.dirname(path)) != BACKEND)


def _load_arrays(path):
    with np.load(path[: -len(".keras")] + ".npz") as data:
        arrays = {key: data[key] for key in data.files}

    def structure(prefix):
        items = {key[len(prefix):]: value for key, value in arrays.items()
                 if key.startswith(prefix)}
        return items[""] if list(items) == [""] else items

    targets, iterations = arrays.get("targets"), arrays["iterations"]
    return structure("input:"), structure("output:"), targets, iterations


def test_every_backend_has_saved_its_files():
    paths = glob.glob(os.path.join(FIXTURE_DIR, "*", "*.keras"))
    names = {os.path.relpath(path, FIXTURE_DIR) for path in paths}
    expected = {f"{backend}/{model}.keras" for backend in ("jax", "tensorflow", "torch")
                for model in ("vit", "lit")}
    assert names == expected


def _name(path):
    return os.path.relpath(path, FIXTURE_DIR)[: -len(".keras")]


@pytest.mark.parametrize("path", FILES, ids=_name)
def test_file_from_another_backend_loads_predicts_and_trains(path):
    inputs, expected, targets, iterations = _load_arrays(path)
    model = keras.saving.load_model(path)  # safe_mode=True
    # predict: one compiled program instead of an op-by-op call (JAX compiles each op).
    outputs = model.predict(inputs, batch_size=4, verbose=0)
    for key, value in (expected.items() if isinstance(expected, dict) else [("", expected)]):
        actual = outputs[key] if key else outputs
        np.testing.assert_allclose(keras.ops.convert_to_numpy(actual), value, rtol=1e-5, atol=1e-5,
                                   err_msg=key)
    assert model.compiled and int(model.optimizer.iterations) == int(iterations)
    before = [keras.ops.convert_to_numpy(v) for v in model.trainable_weights]
    loss = model.fit(inputs, targets, batch_size=4, epochs=1, verbose=0).history["loss"][-1]
    assert np.isfinite(loss)
    assert int(model.optimizer.iterations) == int(iterations) + 1
    moved = [not np.array_equal(b, keras.ops.convert_to_numpy(v))
             for b, v in zip(before, model.trainable_weights)]
    assert all(moved), [v.path for v, m in zip(model.trainable_weights, moved) if not m]


# The optimizer has not stepped, so its variables are not built when the file is read.
@pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer")
@pytest.mark.parametrize("jit_compile", ["auto", "not auto"])
def test_saved_compile_config_names_no_backend(tmp_path, jit_compile):
    """The optimizer by its public name (PyTorch's own subclass would be built under JAX
    too), and `jit_compile="auto"` as `"auto"` (saved resolved, it would be XLA under
    PyTorch); a value other than what "auto" gives here is kept."""
    model = ViT(**TINY)
    if jit_compile == "not auto":
        model.compile(keras.optimizers.AdamW(1e-3), "mse")
        jit_compile = not model.jit_compile
    model.compile(keras.optimizers.AdamW(1e-3), "mse", jit_compile=jit_compile)
    model.save(tmp_path / "vit.keras")
    with zipfile.ZipFile(tmp_path / "vit.keras") as archive:
        config = json.loads(archive.read("config.json"))["compile_config"]
    assert config["optimizer"]["module"] == "keras.optimizers"
    assert config["optimizer"]["class_name"] == "AdamW"
    assert config["jit_compile"] == jit_compile
    restored = keras.saving.load_model(tmp_path / "vit.keras")
    assert type(restored.optimizer) is type(model.optimizer)
    assert restored.jit_compile == model.jit_compile


def test_saved_jit_compile_is_left_resolved_where_keras_does_not_say_what_auto_gives(monkeypatch):
    model = ViT(**TINY)
    model.compile("sgd", "mse")
    assert model.get_compile_config()["jit_compile"] == "auto"
    # The private method of Keras' trainer that says what "auto" gives, gone.
    owner = next(c for c in type(model).__mro__ if "_resolve_auto_jit_compile" in vars(c))
    monkeypatch.delattr(owner, "_resolve_auto_jit_compile")
    assert model.get_compile_config()["jit_compile"] is model.jit_compile
