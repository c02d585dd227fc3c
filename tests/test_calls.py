"""`layers._calls.call_sublayer`: Keras' `Layer.__call__` skipped only where it would only call `call`."""

import keras
import numpy as np
import pytest

from keras_vitnorm import ViT
from keras_vitnorm import layers
from keras_vitnorm.backend_ops import value_and_gradients
from keras_vitnorm.layers import _calls

TORCH = keras.backend.backend() == "torch"
needs_torch = pytest.mark.skipif(
    not TORCH, reason="the direct path exists on PyTorch only; this run's backend is another"
)


def _inputs(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _model(**overrides):
    config = dict(
        image_size=16, patch_size=4, width=16, depth=2, num_heads=2, mlp_dim=32, num_classes=5,
        stem="dual_patchnorm", dropout=0.1, drop_path_rate=0.1,
    )
    config.update(overrides)
    keras.utils.set_random_seed(3)
    return ViT(**config)


def _count_keras_calls(monkeypatch):
    calls = []
    original = keras.layers.Layer.__call__

    def counting(self, *args, **kwargs):
        calls.append(self.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(keras.layers.Layer, "__call__", counting)
    return calls


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"block_style": "normformer", "qk_norm": True, "layer_scale": 0.1, "norm": "rmsnorm"},
        {"attn_norm": "post", "mlp_norm": "post", "block_style": "deepnorm", "stem": "conv", "norm": "batchnorm"},
    ],
    ids=["dpn", "normformer_qk_layerscale_rmsnorm", "deepnorm_conv_stem_batchnorm"],
)
@pytest.mark.parametrize("training", [False, True])
def test_direct_path_gives_keras_values_and_gradients(monkeypatch, overrides, training):
    # Dropout and drop path at 0.1 make the training case compare random draws:
    # both runs start from the same seed, so equal outputs need equal draws too.
    model = _model(**overrides)
    x = _inputs((3, 16, 16, 3))

    def run(enabled):
        monkeypatch.setattr(_calls, "ENABLED", enabled)
        keras.utils.set_random_seed(7)
        return value_and_gradients(model, x, lambda y: keras.ops.sum(y * y), training=training)

    keras_loss, keras_dx, keras_grads = run(False)
    loss, dx, grads = run(True)
    np.testing.assert_allclose(loss, keras_loss, rtol=1e-6)
    np.testing.assert_allclose(dx, keras_dx, rtol=1e-5, atol=1e-7)
    assert grads.keys() == keras_grads.keys()
    for path in grads:
        np.testing.assert_allclose(grads[path], keras_grads[path], rtol=1e-5, atol=1e-7, err_msg=path)


def test_block_sublayers_skip_keras_call_on_pytorch_only(monkeypatch):
    block = layers.EncoderBlock(num_heads=2, mlp_dim=32, num_layers=2, qk_norm=True)
    x = _inputs((2, 5, 16))
    block(x)
    calls = _count_keras_calls(monkeypatch)
    monkeypatch.setattr(_calls, "ENABLED", False)
    block(x, training=False)
    through_keras = len(calls)
    calls.clear()
    monkeypatch.setattr(_calls, "ENABLED", True)
    block(x, training=False)
    # The block, its two norms, attention and its q norm, k norm and out, MLP and its fc1 and fc2
    # (and qkv, except on TensorFlow, which runs three matmuls on its kernel instead).
    assert through_keras >= 10
    assert len(calls) == (1 if TORCH else through_keras)


@needs_torch
def test_a_torch_hook_on_a_sublayer_still_runs(monkeypatch):
    block = layers.EncoderBlock(num_heads=2, mlp_dim=32, num_layers=2)
    x = _inputs((2, 5, 16))
    reference = keras.ops.convert_to_numpy(block(x))
    seen = []
    handle = block.mlp.register_forward_hook(lambda module, args, output: seen.append(tuple(output.shape)))
    try:
        calls = _count_keras_calls(monkeypatch)
        hooked = keras.ops.convert_to_numpy(block(x))
    finally:
        handle.remove()
    assert seen == [(2, 5, 16)]
    assert "mlp" in calls  # the hooked layer went through Keras' __call__ (and PyTorch's hooks)
    np.testing.assert_array_equal(hooked, reference)


@needs_torch
def test_direct_path_conditions():
    parent = layers.MLP(8)
    parent.build((2, 3, 4))
    fc1 = parent.fc1
    x = keras.ops.convert_to_tensor(_inputs((2, 3, 4)))
    with_training = {"training": False}
    assert _calls.skips_keras_call(parent, fc1, x, with_training)
    # `training` must be given to a layer whose call takes it.
    assert not _calls.skips_keras_call(parent, fc1, x, {})
    # Symbolic inputs (functional model construction) go through Keras.
    assert not _calls.skips_keras_call(parent, fc1, keras.KerasTensor((2, 3, 4)), with_training)
    # An input of another dtype would be cast by Keras.
    assert not _calls.skips_keras_call(parent, fc1, keras.ops.cast(x, "float16"), with_training)
    # Unbuilt layers are built by Keras' __call__.
    assert not _calls.skips_keras_call(parent, layers.FusedDense(4), x, with_training)
    # A layer of another dtype policy needs its own autocast scope.
    other = layers.FusedDense(4, dtype="mixed_bfloat16")
    other.build((2, 3, 4))
    assert not _calls.skips_keras_call(parent, other, x, with_training)
    # Activity regularizers record losses in __call__.
    regularized = layers.FusedDense(4, activity_regularizer="l2")
    regularized.build((2, 3, 4))
    assert not _calls.skips_keras_call(parent, regularized, x, with_training)
    # A remat scope at construction asks __call__ to rematerialize.
    with keras.RematScope(mode="full"):
        remat = layers.FusedDense(4)
    remat.build((2, 3, 4))
    assert not _calls.skips_keras_call(parent, remat, x, with_training)
    # A quantized layer takes Keras' quantized path.
    quantized = layers.FusedDense(4)
    quantized.build((2, 3, 4))
    quantized.quantize("int8", type_check=False)  # Keras refuses subclasses unless asked
    assert not _calls.skips_keras_call(parent, quantized, x, with_training)
    # A mixed-precision norm that does not autocast (Keras' LayerNormalization) needs its own scope.
    mixed_parent = layers.MLP(8, dtype="mixed_bfloat16")
    mixed_parent.build((2, 3, 4))
    norm = keras.layers.LayerNormalization(dtype="mixed_bfloat16")
    norm.build((2, 3, 4))
    bf16 = keras.ops.cast(x, "bfloat16")
    assert not norm.autocast
    assert not _calls.skips_keras_call(mixed_parent, norm, bf16, with_training)
    assert _calls.skips_keras_call(mixed_parent, mixed_parent.fc1, bf16, with_training)
    # In float32 the same norm's scope changes nothing.
    float_norm = keras.layers.LayerNormalization()
    float_norm.build((2, 3, 4))
    assert _calls.skips_keras_call(parent, float_norm, x, with_training)


@needs_torch
def test_direct_path_drops_training_only_where_call_does_not_take_it(monkeypatch):
    parent = layers.EncoderBlock(num_heads=2, mlp_dim=32, num_layers=2)
    parent.build((2, 5, 16))
    x = keras.ops.convert_to_tensor(_inputs((2, 5, 16)))
    received = []

    def call_without_training(self, inputs):
        received.append("no training")
        return inputs

    def call_with_training(self, inputs, training=None):
        received.append(training)
        return inputs

    scale = layers.LayerScale(1.0)
    scale.build((2, 5, 16))
    monkeypatch.setattr(layers.LayerScale, "call", call_without_training)
    _calls.call_sublayer(parent, scale, x, training=True)
    monkeypatch.setattr(layers.LayerScale, "call", call_with_training)
    _calls.call_sublayer(parent, scale, x, training=True)
    assert received == ["no training", True]


def test_mixed_precision_model_matches_keras_calls(monkeypatch):
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = _model(dropout=0.0, drop_path_rate=0.0)
    finally:
        keras.config.set_dtype_policy("float32")
    x = _inputs((2, 16, 16, 3))
    outputs = {}
    for enabled in (False, True):
        monkeypatch.setattr(_calls, "ENABLED", enabled)
        outputs[enabled] = keras.ops.convert_to_numpy(model(x, training=False))
    assert outputs[True].dtype == np.float32
    np.testing.assert_array_equal(outputs[True], outputs[False])
