"""keras-hub's model checks on `ViT`, `ViT.backbone()`, `Segmenter` and `LiT`, and the
precision semantics Keras defines.

keras-hub runs `run_serialization_test`, `run_model_saving_test`, `run_precision_test`
and `run_quantization_test` (keras_hub/src/tests/test_case.py) on its models; they run
here as they are where they apply. Two assume keras-hub's own conventions, so an
equivalent check stands beside them:

* `run_precision_test` wants every output and every sublayer in the policy's compute
  dtype, and returns at once on PyTorch without a GPU. These models return float32
  logits under any policy on purpose (the output layers named in `FLOAT32_LAYERS`, as
  Keras' mixed-precision guide advises), so `_check_precision` asks the same of
  everything else, on every backend, and float32 of those outputs.
* `run_quantization_test` quantizes only layers whose type is exactly `Dense`, through
  a `DTypePolicyMap`, and returns at once on PyTorch; `test_quantized_model_saves_and_
  reloads` quantizes with `model.quantize`, as a user does, which reaches the
  projections of every block (`FusedDense`), then saves and reloads the model (the
  ViT of every block style: tests/test_deploy.py).

`ViT.backbone()` is a plain functional `keras.Model` with no class of its own to
rebuild from `init_kwargs`, so its saving check is written out here.
"""

import os

import keras
import numpy as np
import pytest

from keras_vitnorm import LiT
from keras_vitnorm import Segmenter
from keras_vitnorm import ViT
from keras_vitnorm.models.contrastive import caption_vocabulary

TINY = {"image_size": 8, "patch_size": 4, "width": 8, "depth": 1, "num_heads": 2, "mlp_dim": 16,
        "num_classes": 3}
CAPTIONS = ["a red square", "a blue circle", "two green lines"]
TEXT = {"max_length": 4, "embed_dim": 8, "text_width": 8, "text_depth": 1, "text_heads": 2,
        "text_mlp_dim": 16}
#: Layers that return float32 under any policy: the models' logits.
FLOAT32_LAYERS = ("outputs", "float32_logits", "upsample")
MODELS = ("vit", "backbone", "segmenter", "lit")
POLICIES = ("mixed_float16", "mixed_bfloat16", "bfloat16")


@pytest.fixture(scope="module")
def hub():
    """keras-hub's `TestCase`, whose checks run on this project's models."""
    test_case = pytest.importorskip("keras_hub.src.tests.test_case",
                                    reason="keras-hub's checks come with keras-hub")
    return test_case.TestCase()


def _vit(dtype=None, **overrides):
    return ViT(**{**TINY, "stem": "dual_patchnorm", **overrides}, dtype=dtype)


def _build(name, dtype=None):
    """`(class or None, constructor arguments, model, inputs)` of one of `MODELS`."""
    images = keras.ops.convert_to_tensor(
        np.random.default_rng(0).uniform(-1, 1, (2, 8, 8, 3)).astype("float32"))
    if name == "vit":
        arguments = {**TINY, "stem": "dual_patchnorm", "dtype": dtype}
        return ViT, arguments, ViT(**arguments), images
    if name == "backbone":
        return None, None, _vit(dtype).backbone(), images
    if name == "segmenter":
        arguments = {"vit": _vit(dtype), "num_classes": 3}
        return Segmenter, arguments, Segmenter(**arguments), images
    arguments = {"vit": _vit(dtype), "vocabulary": caption_vocabulary(CAPTIONS), **TEXT}
    model = LiT(**arguments)
    tokens = keras.ops.convert_to_tensor(model.tokenize(CAPTIONS[:2]))
    return LiT, arguments, model, {"images": images, "tokens": tokens}


def _randomize(model, seed=0):
    """Every weight drawn at random (the heads start at zero), so outputs differ."""
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        if keras.backend.is_float_dtype(weight.dtype) and "moving_variance" not in weight.path:
            value = rng.normal(0, 0.5, weight.shape).astype("float32")
            weight.assign(keras.ops.cast(value, weight.dtype))


def _numpy(outputs):
    return keras.tree.map_structure(
        lambda t: keras.ops.convert_to_numpy(keras.ops.cast(t, "float32")), outputs)


def _assert_close(actual, expected, **tolerance):
    for a, e in zip(keras.tree.flatten(_numpy(actual)), keras.tree.flatten(_numpy(expected))):
        np.testing.assert_allclose(a, e, **tolerance)


def _sublayers(model):
    return [layer for layer in model._flatten_layers(include_self=False)
            if not isinstance(layer, keras.layers.InputLayer)]


def _policies(model):
    return sorted((layer.name, layer.compute_dtype, layer.variable_dtype)
                  for layer in _sublayers(model))


@pytest.mark.parametrize("name", MODELS)
def test_keras_hub_serialization(hub, name):
    hub.run_serialization_test(_build(name)[2])


@pytest.mark.parametrize("name", MODELS)
def test_keras_hub_model_saving(hub, tmp_path, name):
    cls, arguments, model, inputs = _build(name)
    if cls is not None:
        hub.run_model_saving_test(cls, arguments, inputs)
        return
    # The backbone: the same check, written out. Its file loads in safe mode (no Python
    # lambda in it) into a functional model with the same outputs.
    _randomize(model)
    path = os.path.join(tmp_path, "backbone.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    assert isinstance(restored, keras.Model) and set(restored.output) == {"tokens", "pooled"}
    _assert_close(restored(inputs), model(inputs), atol=1e-6, rtol=1e-6)


def _check_precision(name, model, inputs, policy):
    outputs = model(inputs)
    spec = model.compute_output_spec(inputs)
    float32_outputs = name != "backbone"
    for tensor, expected in zip(keras.tree.flatten(outputs), keras.tree.flatten(spec)):
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        assert dtype == ("float32" if float32_outputs else policy.compute_dtype), name
        assert dtype == expected.dtype, name
        assert np.isfinite(keras.ops.convert_to_numpy(keras.ops.cast(tensor, "float32"))).all()
    assert model.dtype_policy.name == policy.name, name
    for weight in model.weights:
        if keras.backend.is_float_dtype(weight.dtype):
            assert weight.dtype == policy.variable_dtype, weight.path
    for layer in _sublayers(model):
        expected = "float32" if layer.name in FLOAT32_LAYERS else policy.compute_dtype
        assert (layer.compute_dtype, layer.variable_dtype) == (
            expected, "float32" if layer.name in FLOAT32_LAYERS else policy.variable_dtype
        ), layer.path


@pytest.mark.parametrize("policy", POLICIES)
def test_precision_of_every_output_weight_and_sublayer(policy):
    policy = keras.dtype_policies.get(policy)
    for name in MODELS:
        _, _, model, inputs = _build(name, policy.name)
        _check_precision(name, model, inputs, policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_dtype_argument_builds_what_the_global_policy_builds(policy):
    """`ViT(dtype=p)` is `ViT()` under `keras.config.set_dtype_policy(p)`: its own policy,
    every sublayer's, the loss scaling `compile` adds, and what the heads built on it
    (`Segmenter`, `LiT`) take."""
    vocabulary = caption_vocabulary(CAPTIONS)

    def describe(vit):
        models = {"vit": vit, "segmenter": Segmenter(vit, 3), "lit": LiT(vit, vocabulary, **TEXT)}
        description = {}
        for key, model in models.items():
            model.compile(keras.optimizers.SGD(0.1), loss="mse")
            description[key] = (model.dtype_policy.name, type(model.optimizer).__name__,
                                _policies(model))
        return description

    keras.utils.clear_session()
    by_argument = describe(_vit(policy))
    keras.utils.clear_session()
    keras.config.set_dtype_policy(policy)
    try:
        by_global_policy = describe(_vit())
    finally:
        keras.config.set_dtype_policy("float32")
    assert by_argument == by_global_policy
    assert by_argument["vit"][0] == policy
    scaled = "LossScaleOptimizer" if policy == "mixed_float16" else "SGD"
    assert {optimizer for _, optimizer, _ in by_argument.values()} == {scaled}


@pytest.mark.parametrize("name", ("vit", "segmenter", "lit"))
def test_keras_hub_quantization(hub, name):
    cls, arguments, model, inputs = _build(name)
    hub.run_quantization_test(model, cls, arguments, inputs)


# Keras warns of every layer without weights to quantize (norms, dropout, reshapes).
@pytest.mark.filterwarnings("ignore:Layer .* does not have a `quantize` method")
# The ViT of every block style: tests/test_deploy.py. The Segmenter records them as LiT does.
@pytest.mark.parametrize("name", ("lit",))
def test_quantized_model_saves_and_reloads(tmp_path, name):
    _, _, model, inputs = _build(name)
    _randomize(model)
    # predict: one compiled program instead of an op-by-op call (JAX compiles each op).
    expected = _numpy(model.predict(inputs, verbose=0))
    model.quantize("int8")
    dense = [layer for layer in _sublayers(model) if isinstance(layer, keras.layers.Dense)]
    assert len(dense) >= 4 and all(layer.quantization_mode == "int8" for layer in dense), [
        layer.path for layer in dense if layer.quantization_mode != "int8"]
    quantized = _numpy(model.predict(inputs, verbose=0))
    for q, e in zip(keras.tree.flatten(quantized), keras.tree.flatten(expected)):
        assert np.abs(q - e).max() < 0.1 * np.abs(e).max()  # int8 weights: close, not equal
    path = os.path.join(tmp_path, "quantized.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    assert all(layer.quantization_mode == "int8" for layer in _sublayers(restored)
               if isinstance(layer, keras.layers.Dense))
    _assert_close(restored.predict(inputs, verbose=0), quantized, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ("vit", "segmenter", "lit"))
def test_sublayers_without_keras_private_list_finds_the_same_layers(name, monkeypatch):
    """`vit_config.sublayers` takes Keras' private `_flatten_layers`; without it (a later
    Keras), the layers reachable through attributes: Keras' layers, each once, and
    besides them only layers without trainable weights (LiT's text vectorization, which
    Keras does not track), so a quantized model records the same policy map."""
    from keras_vitnorm.models import vit_config

    _, _, model, _ = _build(name)
    model.quantize("int8")
    keras_list = vit_config.sublayers(model)
    keras_map = vit_config.dtype_with_quantized_layers(model, None).get_config()
    monkeypatch.setattr(model, "_flatten_layers", None, raising=False)
    fallback = vit_config.sublayers(model)
    assert len(fallback) == len({id(layer) for layer in fallback})
    assert {id(layer) for layer in keras_list} <= {id(layer) for layer in fallback}
    extra = [layer for layer in fallback if id(layer) not in {id(k) for k in keras_list}]
    assert all(not layer.trainable_weights for layer in extra), [layer.name for layer in extra]
    assert vit_config.dtype_with_quantized_layers(model, None).get_config() == keras_map
