"""The deployment routes of docs/deploy.md: each exported artifact run by its own runtime
(TensorFlow, the TFLite interpreter, ONNX Runtime, JAX) and compared with Keras' outputs
on a tiny model (tools/deploy_routes.py), under the backends where the route applies;
the limits the page states, where they are the route's; and a quantized model of every
block style saved and loaded.

Each dynamic-batch artifact runs at two batch sizes. The float routes agree with Keras
within `FLOAT_TOLERANCE` (docs/deploy.md measures them, tools/deploy_parity.py).
"""

import os
import sys

import keras
import numpy as np
import pytest

from keras_vitnorm import ViT

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))
import deploy_routes as routes  # noqa: E402

BACKEND = keras.backend.backend()
FLOAT_TOLERANCE = 1e-5
SAVED_MODEL_BACKENDS = ("jax", "tensorflow")  # Keras' `tf_saved_model` export


def assert_matches(got, expected, atol=FLOAT_TOLERANCE):
    assert np.abs(expected).max() > 0.1  # outputs far from zero: a real comparison
    np.testing.assert_allclose(got, expected, rtol=0, atol=atol)


@pytest.fixture(scope="module")
def dpn():
    """A tiny DPN model, three images and its outputs on them."""
    model, images = routes.tiny_model("dpn", batch=3)
    return model, images, routes.keras_outputs(model, images)


@pytest.fixture(scope="module")
def saved_model(dpn, tmp_path_factory):
    """The DPN model exported as a SavedModel without an input signature (any batch)."""
    if BACKEND not in SAVED_MODEL_BACKENDS:
        pytest.skip("Keras exports a SavedModel from the jax and tensorflow backends only; "
                    "load the preset under either (docs/deploy.md)")
    pytest.importorskip("tensorflow", reason="a SavedModel is served by TensorFlow")
    directory = str(tmp_path_factory.mktemp("saved") / "dpn")
    dpn[0].export(directory, verbose=False)
    return directory


# ----------------------------------------------------------------------- SavedModel, TFLite


def test_saved_model_gives_the_keras_outputs_at_any_batch(dpn, saved_model):
    _, images, expected = dpn
    assert_matches(routes.serve_saved_model(saved_model, images), expected)
    assert_matches(routes.serve_saved_model(saved_model, images[:1]), expected[:1])


def test_tflite_float_from_the_saved_model_gives_the_keras_outputs_at_any_batch(dpn, saved_model):
    """From JAX too: the class token is read by a slice, which the converter takes
    (`x[:, 0]` of an open batch became a dynamic gather it refused)."""
    _, images, expected = dpn
    flatbuffer = routes.tflite_from_saved_model(saved_model)
    assert_matches(routes.run_tflite(flatbuffer, images), expected)
    assert_matches(routes.run_tflite(flatbuffer, images[:1]), expected[:1])


def test_tflite_dynamic_range_int8_stays_near_the_float_outputs(dpn, saved_model):
    _, images, expected = dpn
    flatbuffer = routes.tflite_from_saved_model(saved_model, dynamic_range_int8=True)
    error = np.abs(routes.run_tflite(flatbuffer, images) - expected).max()
    assert FLOAT_TOLERANCE < error < 0.1 * np.abs(expected).max()  # int8 weights: near, not equal
    assert len(flatbuffer) < len(routes.tflite_from_saved_model(saved_model))


@pytest.mark.filterwarnings("ignore:Layer .* does not have a `quantize` method")
def test_a_keras_int8_model_converts_to_tflite_from_jax(tmp_path):
    """A `model.quantize("int8")` model as TFLite gives the quantized model's outputs.
    Under TensorFlow the converter refuses its int8 matmuls (docs/deploy.md)."""
    if BACKEND not in SAVED_MODEL_BACKENDS:
        pytest.skip("Keras exports a SavedModel from the jax and tensorflow backends only")
    pytest.importorskip("tensorflow", reason="the TFLite converter comes with TensorFlow")
    model, images = routes.tiny_model("dyt_deepnorm", image_size=16)
    model.quantize("int8")
    expected = routes.keras_outputs(model, images)
    directory = str(tmp_path / "int8")
    model.export(directory, verbose=False)
    if BACKEND == "tensorflow":
        with pytest.raises(Exception, match="tfl.fully_connected"):
            routes.tflite_from_saved_model(directory)
        return
    assert_matches(routes.run_tflite(routes.tflite_from_saved_model(directory), images), expected)


# ---------------------------------------------------------------------------------- ONNX


def test_onnx_export_needs_no_call_first_and_runs_at_any_batch(tmp_path):
    """`model.export(path, format="onnx")` on a model never called (Keras' own export
    asks for a call first; under JAX `predict` did not count): the library's models
    pass their input signature, batch size open."""
    if BACKEND == "tensorflow":
        pytest.skip("tf2onnx writes TF's exact GELU as an Erfc node that ONNX Runtime cannot "
                    "run; export ONNX under jax or torch (same preset; docs/deploy.md)")
    pytest.importorskip("onnxruntime", reason="the exported model is run with ONNX Runtime")
    model, images = routes.tiny_model("dpn", batch=3)
    path = str(tmp_path / "vit.onnx")
    model.export(path, format="onnx", verbose=False)
    expected = routes.keras_outputs(model, images)
    assert_matches(routes.run_onnx(path, images), expected)
    assert_matches(routes.run_onnx(path, images[:1]), expected[:1])


def test_a_model_of_another_pixel_range_exports_its_rescaling(dpn, tmp_path):
    """The same weights loaded with `pixel_range=[0, 255]`: the exported model takes
    0-255 images and gives what the [-1, 1] model gives on them rescaled."""
    model, images, expected = dpn
    model.save_to_preset(tmp_path / "preset")
    pixels = ViT.from_preset(str(tmp_path / "preset"), pixel_range=[0, 255])
    raw = (images + 1) * 127.5
    if BACKEND in SAVED_MODEL_BACKENDS:
        pytest.importorskip("tensorflow", reason="a SavedModel is served by TensorFlow")
        pixels.export(str(tmp_path / "saved"), verbose=False)
        assert_matches(routes.serve_saved_model(str(tmp_path / "saved"), raw), expected)
    if BACKEND != "tensorflow":  # ONNX from jax and torch (see the test above)
        pytest.importorskip("onnxruntime", reason="the exported model is run with ONNX Runtime")
        pixels.export(str(tmp_path / "vit.onnx"), format="onnx", verbose=False)
        assert_matches(routes.run_onnx(str(tmp_path / "vit.onnx"), raw), expected)


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's TorchScript exporter")
def test_onnx_export_from_pytorch_needs_the_librarys_layer_norm_for_an_open_batch(
        dpn, tmp_path, monkeypatch):
    """Keras' PyTorch export of an open batch traces the model with TorchScript; the
    library's LayerNorm keeps its width a constant there (`keras_vitnorm.ops.layer_norm`).
    Keras' own LayerNorm op cannot be traced so."""
    import keras

    from keras_vitnorm import ops as vitnorm_ops

    def keras_layer_norm(x, gamma, beta, epsilon, dtype):
        y = keras.ops.layer_normalization(x, gamma, beta, axis=-1, epsilon=epsilon)
        return y if dtype is None else keras.ops.cast(y, dtype)

    monkeypatch.setattr(vitnorm_ops._native(), "layer_norm", keras_layer_norm)
    with pytest.raises(Exception, match="not constant"):
        dpn[0].export(str(tmp_path / "plain.onnx"), format="onnx", verbose=False)


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's exporters")
def test_an_rmsnorm_model_exports_to_onnx_from_pytorch_with_the_dynamo_exporter(tmp_path):
    """Keras' export of an open batch uses the TorchScript exporter, which has no ONNX
    form of `aten::rms_norm`; `torch.onnx.export(..., dynamo=True)` with a dynamic batch
    (docs/deploy.md) writes a file that runs at any batch size."""
    pytest.importorskip("onnxruntime", reason="the exported model is run with ONNX Runtime")
    model, images = routes.tiny_model("rmsnorm_post", batch=3)
    expected = routes.keras_outputs(model, images)
    with pytest.raises(Exception, match="rms_norm"):
        model.export(str(tmp_path / "keras.onnx"), format="onnx", verbose=False)
    path = str(tmp_path / "dynamo.onnx")
    routes.torch_onnx_any_batch(model, images, path)
    assert_matches(routes.run_onnx(path, images), expected)
    assert_matches(routes.run_onnx(path, images[:1]), expected[:1])


# ------------------------------------------------------------------------------ jax.export


@pytest.mark.skipif(BACKEND != "jax", reason="jax.export serializes a JAX function")
def test_jax_export_gives_the_keras_outputs_at_any_batch(dpn):
    model, images, expected = dpn
    serialized = routes.jax_export(model, images.shape[1:])
    assert_matches(routes.run_jax_export(serialized, images), expected)
    assert_matches(routes.run_jax_export(serialized, images[:1]), expected[:1])


# ------------------------------------------------------- .keras and presets, quantized too


# Each block style initializes its projections its own way (DeepNorm's beta, Sub-LN's
# gamma; the placements share the standard initialization): every style, and a post-LN
# RMSNorm model with the DPN stem for the norms around them.
QUANTIZED = {
    "standard": {},
    "normformer": {"block_style": "normformer"},
    "sub_ln": {"block_style": "sub_ln"},
    "deepnorm": {"block_style": "deepnorm"},
    "post_rmsnorm_dpn": {"attn_norm": "post", "mlp_norm": "post", "norm": "rmsnorm",
                         "stem": "dual_patchnorm"},
}


# Keras warns of every layer without weights to quantize (norms, dropout, reshapes).
@pytest.mark.filterwarnings("ignore:Layer .* does not have a `quantize` method")
@pytest.mark.parametrize("name", QUANTIZED)
def test_a_quantized_model_reloads_from_a_keras_file_and_a_preset(tmp_path, name):
    """`model.quantize("int8")`, saved as a `.keras` file and as a preset, loads with its
    int8 weights and gives the quantized model's outputs. The block styles that scale
    initial weights (DeepNorm, Sub-LN) rescaled the int8 kernels at build time, which
    TensorFlow refused."""
    model = ViT(image_size=16, patch_size=8, width=32, depth=2, num_heads=2, mlp_dim=64,
                num_classes=3, **QUANTIZED[name])
    rng = np.random.default_rng(0)
    for weight in model.weights:  # the head starts at zero: every weight drawn
        weight.assign(rng.normal(0, 0.5, weight.shape).astype("float32"))
    images = rng.uniform(-1, 1, (2, 16, 16, 3)).astype("float32")
    # predict: one compiled program instead of an op-by-op call (JAX compiles each op).
    expected = model.predict(images, verbose=0)
    model.quantize("int8")
    dense = [layer for layer in model._flatten_layers(include_self=False)
             if isinstance(layer, keras.layers.Dense)]
    assert len(dense) == 1 + 4 * 2 + 1 and all(layer.quantization_mode == "int8" for layer in dense)
    quantized = model.predict(images, verbose=0)
    assert 0 < np.abs(quantized - expected).max() < 0.1 * np.abs(expected).max()
    path = str(tmp_path / "quantized.keras")
    model.save(path)
    model.save_to_preset(str(tmp_path / "preset"))
    for restored in (keras.saving.load_model(path), ViT.from_preset(str(tmp_path / "preset"))):
        kernels = [layer.kernel for layer in restored._flatten_layers(include_self=False)
                   if isinstance(layer, keras.layers.Dense)]
        assert len(kernels) == len(dense) and all(k.dtype == "int8" for k in kernels)
        np.testing.assert_allclose(restored.predict(images, verbose=0), quantized,
                                   rtol=1e-5, atol=1e-5)
