"""A training step is traced (compiled) once and never again after warm-up.

The stem's Python `call` runs only while JAX or TensorFlow traces the train step, so
counting its calls counts traces. PyTorch runs eagerly: there the call runs every
step and nothing is compiled, which the test checks too.
"""

import functools

import keras
import numpy as np
import pytest

from keras_vitnorm import ViT
from keras_vitnorm.layers.patch_stem import PatchStem

TINY = {"image_size": 16, "patch_size": 4, "width": 32, "depth": 2, "num_heads": 2,
        "mlp_dim": 64, "num_classes": 5}


@pytest.mark.parametrize("stem, precision", [("dual_patchnorm", "float32"), ("patch", "mixed_bfloat16")])
def test_train_and_predict_steps_do_not_retrace(monkeypatch, stem, precision):
    calls = []
    original = PatchStem.call

    @functools.wraps(original)  # Keras reads the call signature
    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PatchStem, "call", counting)
    keras.config.set_dtype_policy(precision)
    try:
        model = ViT(**TINY, stem=stem)
        model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rng = np.random.default_rng(0)
        batches = [(rng.normal(size=(8, 16, 16, 3)).astype("float32"), rng.integers(0, 5, 8))
                   for _ in range(4)]
        model.train_on_batch(*batches[0])
        model.predict_on_batch(batches[0][0])
        warm = len(calls)
        for x, y in batches[1:]:
            loss = model.train_on_batch(x, y)
            model.predict_on_batch(x)
        assert np.isfinite(loss)
    finally:
        keras.config.set_dtype_policy("float32")
    if keras.backend.backend() == "torch":
        assert len(calls) - warm == 6  # eager: one call per step, nothing compiled
    else:
        assert len(calls) == warm, f"{len(calls) - warm} retraces after warm-up"


def _loss_and_gradients(model, x):
    from keras_vitnorm.backend import value_and_gradients

    return value_and_gradients(model, x, lambda y: keras.ops.sum(keras.ops.square(y)), training=True)


def test_gradient_fence_changes_neither_values_nor_gradients():
    from keras_vitnorm import ops

    model = ViT(**TINY)
    x = np.random.default_rng(1).normal(size=(3, 16, 16, 3)).astype("float32")
    fenced = _loss_and_gradients(model, x)
    with ops.fast_paths(False, ["residual_fence"]):
        plain = _loss_and_gradients(model, x)
    np.testing.assert_allclose(fenced[0], plain[0], rtol=1e-6)
    np.testing.assert_allclose(fenced[1], plain[1], rtol=1e-5, atol=1e-7)
    assert fenced[2].keys() == plain[2].keys()
    for path, grad in plain[2].items():
        np.testing.assert_allclose(fenced[2][path], grad, rtol=1e-5, atol=1e-7, err_msg=path)


@pytest.mark.skipif(keras.backend.backend() != "jax",
                    reason="the fence acts only in XLA-compiled JAX on CPU; elsewhere it is the identity")
def test_jax_backward_has_one_fusion_boundary_per_residual_add():
    import jax

    from keras_vitnorm import ops

    model = ViT(**TINY)
    x = np.zeros((2, 16, 16, 3), "float32")
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def conditionals():
        def loss(weights):
            y, _ = model.stateless_call(weights, non_trainable, x, training=True)
            return jax.numpy.sum(y)

        return jax.jit(jax.grad(loss)).lower(trainable).compile().as_text().count("conditional(")

    with ops.fast_paths(True, ["residual_fence"]):
        assert conditionals() == 2 * TINY["depth"]  # attention and MLP residual adds
    with ops.fast_paths(False, ["residual_fence"]):
        assert conditionals() == 0


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="jax.jvp is JAX's forward-mode autodiff")
def test_forward_mode_autodiff_passes_the_fence():
    import jax

    model = ViT(**TINY)
    x = np.random.default_rng(2).normal(size=(2, 16, 16, 3)).astype("float32")
    direction = np.random.default_rng(3).normal(size=x.shape).astype("float32")
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def logits(images):
        return model.stateless_call(trainable, non_trainable, images)[0]

    _, tangent = jax.jvp(logits, (x,), (direction,))
    step = 1e-2
    numeric = (logits(x + step * direction) - logits(x - step * direction)) / (2 * step)
    np.testing.assert_allclose(tangent, numeric, rtol=2e-2, atol=2e-3)
