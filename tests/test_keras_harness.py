"""Keras' own layer harness on every public layer of `keras_vitnorm.layers`.

`keras.src.testing.TestCase.run_layer_test` is the check Keras core and keras-hub run
on each of their layers: the `get_config`/`from_config` and serialization round trips
(the revived layer has the same config and attributes), `build` from a shape and a
symbolic call make the weights an eager call makes, the output shape and dtype, one
`fit` step in Keras' default compile mode (XLA on JAX, a graph on TensorFlow, eager on
PyTorch), and a build and call under `mixed_float16` (the harness skips that one where
PyTorch runs on a CPU). Each case below runs it on one configuration, tiny; together
they cover every norm type, every stem and stem-norm ablation, weight standardization,
attention with and without QK-norm and the NormFormer and Sub-LN hooks, the MLP, and the
encoder block in every placement and block style. The float32 cases take their `fit`
step under a dense head instead of the harness' sum, which also shows that every
trainable weight gets a gradient. `DTYPE_CASES` run the whole harness again with
`bfloat16` or `float16` variables (`dtype="bfloat16"`, not a mixed policy).
"""

import keras
import numpy as np
import pytest
from keras.src.testing import TestCase

from keras_vitnorm import layers
from user_norm import ScaleNorm  # registers "scalenorm", a user's own norm

# The shapes of tests/test_layers.py, so that JAX compiles each eager op once for both.
TOKENS = (3, 9, 16)  # batch, tokens, width: 4 heads of 4
IMAGES = (3, 8, 8, 3)  # 2x2 patches of 4 (5 tokens with the class token)
WIDTH = TOKENS[-1]


def _norm(norm, **kwargs):
    return (layers.make_norm, {"norm": norm, "groups": 4, **kwargs}, TOKENS, TOKENS)


def _block(attn_norm, mlp_norm, block_style, norm, **kwargs):
    arguments = {"num_heads": 4, "mlp_dim": 32, "num_layers": 6, "norm": norm, "norm_groups": 4,
                 "attn_norm": attn_norm, "mlp_norm": mlp_norm, "block_style": block_style, **kwargs}
    return (layers.EncoderBlock, arguments, TOKENS, TOKENS)


def _stem(stem, class_token=True, **kwargs):
    arguments = {"patch_size": 4, "width": WIDTH, "stem": stem, "norm_groups": 4,
                 "class_token": class_token, **kwargs}
    return (layers.PatchStem, arguments, IMAGES, (3, 4 + int(class_token), WIDTH))


#: name -> (layer class or factory, constructor arguments, input shape, output shape).
CASES = {
    **{f"norm_{norm}": _norm(norm) for norm in layers.STEM_NORM_TYPES},
    # A user's own norm (tests/user_norm.py) as the harness runs Keras' layers, and by name
    # in a block (with QK-norm) and in a patch-norm stem.
    "norm_user_scalenorm": (ScaleNorm, {"epsilon": 1e-5}, TOKENS, TOKENS),
    "block_user_norm": _block("pre", "post", "standard", "scalenorm", qk_norm=True),
    # The patch norm alone: after it, Dual PatchNorm's second ScaleNorm would make the
    # loss blind to the first one's scalar gain (tests/test_user_norm.py trains both).
    "stem_user_norm": _stem("pre_patchnorm", stem_norm="scalenorm"),
    # Standardize-only forms of the norms written here (Keras' own take center/scale).
    **{f"norm_{norm}_standardize_only": _norm(norm, learnable=False)
       for norm in ("rmsnorm", "dyt", "batchnorm")},
    "layer_scale": (layers.LayerScale, {"init_value": 0.1}, TOKENS, TOKENS),
    "class_token_pooling": (layers.ClassTokenPooling, {}, TOKENS, (TOKENS[0], WIDTH)),
    "fused_dense_standardized": (layers.FusedDense, {"units": 16, "activation": "gelu",
                                                     "weight_standardization": True},
                                 TOKENS, TOKENS),
    "standardized_conv": (layers.StandardizedConv2D, {"filters": 4, "kernel_size": 3, "strides": 2,
                                                      "padding": "same"}, IMAGES, (3, 4, 4, 4)),
    "attention_normformer_sub_ln": (
        layers.MultiHeadSelfAttention,
        {"num_heads": 4, "qk_norm": "layernorm", "head_scale": True, "inner_norm": "layernorm",
         "qkv_bias": False, "init_scale": 0.5, "dropout": 0.1, "weight_standardization": True},
        TOKENS, TOKENS),
    "mlp_mid_norm": (layers.MLP, {"hidden_dim": 32, "mid_norm": "dyt", "init_scale": 0.5,
                                  "dropout": 0.1, "weight_standardization": True}, TOKENS, TOKENS),
    # Every placement for each sublayer, every block style, QK-norm, LayerScale, drop path;
    # the plain attention, MLP and dense layers are inside.
    "block_attn_pre_mlp_pre_post_layernorm": _block(
        "pre", "pre_post", "standard", "layernorm", qk_norm=True, layer_scale=0.1,
        weight_standardization=True),
    "block_attn_pre_post_mlp_none_normformer_rmsnorm": _block(
        "pre_post", "none", "normformer", "rmsnorm", qk_norm=True, drop_path_rate=0.1, dropout=0.1),
    "block_attn_none_mlp_pre_sub_ln_groupnorm": _block("none", "pre", "sub_ln", "groupnorm"),
    "block_deepnorm_dyt": _block("post", "post", "deepnorm", "dyt", qk_norm=True),
    # Every stem and the stem-norm ablations.
    **{f"stem_{stem}": _stem(stem) for stem in layers.STEM_TYPES},
    "stem_dual_patchnorm_affine": _stem("dual_patchnorm", stem_norm="affine"),
    "stem_dual_patchnorm_rmsnorm_fixed": _stem("dual_patchnorm", stem_norm="rmsnorm",
                                               stem_norm_learnable=False),
    "stem_post_posemb_dyt_gap": _stem("post_posemb", class_token=False, stem_norm="dyt"),
}

#: `(case, dtype)` rerun with bfloat16 or float16 variables: the norms written here in
#: both, the block (attention, MLP, dense layers, LayerScale inside), the stem and the
#: convolution in one each.
DTYPE_CASES = (
    *((norm, dtype) for norm in ("norm_rmsnorm", "norm_dyt", "norm_affine", "norm_batchnorm")
      for dtype in ("bfloat16", "float16")),
    ("norm_layernorm", "float16"),  # Keras' layer, its call written here
    ("block_attn_pre_mlp_pre_post_layernorm", "float16"),
    ("stem_dual_patchnorm", "bfloat16"),
    ("standardized_conv", "bfloat16"),
)


@pytest.fixture
def harness():
    """Keras' `TestCase`, set up as Keras sets it up before each of its own tests."""
    case = TestCase()
    case.setUp()
    yield case
    case.doCleanups()


def _inputs(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def _fit_one_step(layer, input_shape):
    """The harness' training step (one `fit` step in Keras' default compile mode) on the
    layer under a dense head; returns the paths of trainable weights it left unchanged."""
    inputs = keras.Input(input_shape[1:])
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(layer(inputs))))
    before = [keras.ops.convert_to_numpy(v) for v in layer.trainable_weights]
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = _inputs(input_shape, 1), _inputs((input_shape[0], 1), 2)
    model.fit(x, y, batch_size=input_shape[0], epochs=1, verbose=0)
    return [v.path for v, old in zip(layer.trainable_weights, before)
            if np.array_equal(old, keras.ops.convert_to_numpy(v))]


@pytest.mark.parametrize("name", sorted(CASES))
def test_keras_layer_harness(harness, name):
    # The harness' own training step runs below instead, under a dense head so that
    # every trainable weight must move (the harness only checks that `fit` runs).
    layer_cls, arguments, input_shape, output_shape = CASES[name]
    harness.run_layer_test(layer_cls, init_kwargs=arguments, input_shape=input_shape,
                           expected_output_shape=output_shape, expected_output_dtype="float32",
                           run_training_check=False)
    layer = layer_cls(**arguments)
    assert not _fit_one_step(layer, input_shape), "no gradient reached these weights"
    y = keras.ops.convert_to_numpy(layer(_inputs(input_shape)))
    assert np.isfinite(y).all()


# The harness feeds its fit step from a generator, with fit's default shuffle=True.
@pytest.mark.filterwarnings("ignore:`shuffle=True` was passed")
@pytest.mark.parametrize("name, dtype", DTYPE_CASES)
def test_keras_layer_harness_with_low_precision_variables(harness, name, dtype):
    layer_cls, arguments, input_shape, output_shape = CASES[name]
    arguments = {**arguments, "dtype": dtype}
    harness.run_layer_test(layer_cls, init_kwargs=arguments, input_shape=input_shape,
                           expected_output_shape=output_shape, expected_output_dtype=dtype)
    layer = layer_cls(**arguments)
    y = layer(_inputs(input_shape))
    floats = [w for w in layer.weights if keras.backend.is_float_dtype(w.dtype)]
    assert floats and all(w.dtype == dtype for w in floats), [(w.path, w.dtype) for w in floats]
    assert np.isfinite(keras.ops.convert_to_numpy(keras.ops.cast(y, "float32"))).all()
