"""Compiled everywhere: `jit_compile=True` training and prediction, fast paths on and off.

`jit_compile=True` is XLA on JAX (also Keras' default there) and on TensorFlow, and
`torch.compile` on PyTorch. The ops of `keras_vitnorm.ops` are where the backends
differ, so on PyTorch each op, with its fast path on and off, with and without a
gradient recorded, is compiled whole (`fullgraph=True`: no graph break, no fallback to
Python) and must give what it gives uncompiled.

The models are compared compiled and uncompiled: one `fit` step from the same weights
gives the same predictions and loss. The `large` test does so on every backend for
every stem and norm, with the fast paths on and again with them off. The default
suite runs it on TensorFlow, where `jit_compile=True` (XLA) is not Keras' default,
with each stem and norm once (half of them with the fast paths off); on JAX every
test's model is compiled by XLA already, and on PyTorch `torch.compile` spends tens of
seconds tracing Keras itself.
"""

import functools

import keras
import numpy as np
import pytest

from keras_vitnorm import ViT
from keras_vitnorm import ops as vitnorm_ops

BACKEND = keras.backend.backend()
TINY = {"image_size": 8, "patch_size": 4, "width": 8, "depth": 1, "num_heads": 2, "mlp_dim": 16,
        "num_classes": 3}
#: Every stem and every norm (block norms and stem norms), each ViT tiny.
VARIANTS = (
    {"stem": "patch", "norm": "layernorm", "qk_norm": True},
    {"stem": "dual_patchnorm", "stem_norm": "affine", "norm": "rmsnorm", "block_style": "sub_ln"},
    {"stem": "conv", "norm": "batchnorm", "attn_norm": "post", "mlp_norm": "pre_post"},
    {"stem": "post_posemb", "stem_norm": "dyt", "norm": "dyt", "qk_norm": True,
     "block_style": "normformer"},
    {"stem": "pre_patchnorm", "stem_norm": "rmsnorm", "norm": "groupnorm", "norm_groups": 2,
     "block_style": "deepnorm"},
    {"stem": "post_patchnorm", "stem_norm": "batchnorm", "norm": "identity",
     "weight_standardization": True, "layer_scale": 0.1},
)


def _models(variants):
    """One functional model summing the logits of a tiny ViT per variant: one compiled step
    holds every one of them."""
    images = keras.Input((8, 8, 3))
    logits = [ViT(**TINY, **variant, name=f"vit_{i}")(images) for i, variant in enumerate(variants)]
    return keras.Model(images, keras.layers.Add()(logits))


def _train_and_predict(variants, jit_compile, fast_paths):
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (4, 8, 8, 3)).astype("float32")
    labels = np.array([0, 1, 2, 0])
    with vitnorm_ops.fast_paths(fast_paths):
        keras.utils.set_random_seed(0)
        model = _models(variants)
        for weight in model.trainable_weights:  # the heads start at zero
            weight.assign(rng.normal(0, 0.3, weight.shape).astype("float32"))
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=jit_compile)
        before = model.predict(images, batch_size=4, verbose=0)
        loss = model.fit(images, labels, batch_size=4, epochs=1, verbose=0).history["loss"][0]
        after = model.predict(images, batch_size=4, verbose=0)
    assert model.jit_compile is jit_compile
    return before, loss, after


def _compiled_matches_uncompiled(variants, fast_paths):
    compiled = _train_and_predict(variants, True, fast_paths)
    uncompiled = _train_and_predict(variants, False, fast_paths)
    for a, b in zip(compiled, uncompiled):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(BACKEND != "tensorflow", reason=(
    "XLA compiles every model of the suite on JAX (Keras' default there); torch.compile of "
    "a model is the large test below"))
@pytest.mark.parametrize("fast_paths, variants", [(True, VARIANTS[:3]), (False, VARIANTS[3:])])
def test_compiled_training_and_prediction_match_uncompiled(fast_paths, variants):
    _compiled_matches_uncompiled(variants, fast_paths)


@pytest.mark.large
@pytest.mark.parametrize("fast_paths", [True, False])
def test_compiled_training_and_prediction_of_every_stem_and_norm(fast_paths):
    _compiled_matches_uncompiled(VARIANTS, fast_paths)


# --- PyTorch: every op compiles whole ---------------------------------------------------


def _torch_op_cases():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    kernel = rng.normal(size=(8, 24)).astype("float32")
    bias = rng.normal(size=(24,)).astype("float32")
    q = rng.normal(size=(2, 5, 2, 4)).astype("float32")
    conv_kernel = rng.normal(size=(3, 3, 3, 4)).astype("float32")
    return {
        "linear": (vitnorm_ops.linear, (x, kernel, bias)),
        "linear_no_bias": (lambda x, k: vitnorm_ops.linear(x, k), (x, kernel)),
        "qkv_projection": (functools.partial(vitnorm_ops.qkv_projection, num_heads=2),
                           (x, kernel, bias)),
        "attention": (vitnorm_ops.attention, (q, q * 0.5, q + 1.0)),
        "residual_fence": (vitnorm_ops.residual_fence, (x,)),
        "standardize_kernel": (vitnorm_ops.standardize_kernel, (conv_kernel,)),
    }


@pytest.mark.skipif(BACKEND != "torch",
                    reason="torch.compile; XLA compiles every test's model on JAX")
@pytest.mark.parametrize("fast_paths", [True, False])
@pytest.mark.parametrize("name, gradient", [
    *((name, True) for name in sorted(_torch_op_cases())),
    ("linear", False),  # where no gradient is recorded, the oneDNN fast path's place
])
def test_torch_compiles_every_op_whole(name, gradient, fast_paths):
    import torch

    function, arrays = _torch_op_cases()[name]

    def run(compiled):
        inputs = [torch.tensor(a, requires_grad=gradient) for a in arrays]
        with torch.set_grad_enabled(gradient), vitnorm_ops.fast_paths(fast_paths):
            call = function
            if compiled:
                call = torch.compile(function, fullgraph=True, backend="aot_eager")
            outputs = call(*inputs)
            outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
            if not gradient:
                return [o.detach().numpy() for o in outputs]
            torch.autograd.backward([o.sum() for o in outputs])
            return [o.detach().numpy() for o in outputs] + [i.grad.numpy() for i in inputs]

    torch._dynamo.reset()
    for compiled, eager in zip(run(True), run(False)):
        np.testing.assert_allclose(compiled, eager, rtol=1e-5, atol=1e-5)


