"""Per-layer behaviour: config round trip, mixed precision, formulas, errors.

Shapes, builds, serialization and a training step with a gradient for every weight:
tests/test_keras_harness.py (Keras' layer harness).
"""

import keras
import numpy as np
import pytest

from keras_vitnorm import layers

TOKENS = (3, 9, 16)  # batch, tokens, width
IMAGES = (3, 8, 8, 3)


def _token_layers():
    """name -> factory of every token-level layer configuration under test."""
    cases = {f"norm_{norm}": (lambda n=norm: layers.make_norm(n, groups=4)) for norm in layers.STEM_NORM_TYPES}
    cases.update(
        {
            "rmsnorm_standardize_only": lambda: layers.RMSNorm(scale=False),
            "dyt_no_affine": lambda: layers.DyT(affine=False),
            "layer_scale": lambda: layers.LayerScale(0.1),
            "attention": lambda: layers.MultiHeadSelfAttention(4),
            "attention_qk_norm_head_scale_inner": lambda: layers.MultiHeadSelfAttention(
                4, qk_norm="layernorm", head_scale=True, inner_norm="rmsnorm", qkv_bias=False
            ),
            "fused_dense": lambda: layers.FusedDense(TOKENS[-1], activation="gelu"),
            "mlp": lambda: layers.MLP(32),
            "mlp_mid_norm": lambda: layers.MLP(32, mid_norm="layernorm", dropout=0.1),
        }
    )
    for attn, mlp, style in (
        ("pre", "pre", "standard"),
        ("post", "pre_post", "standard"),
        ("none", "post", "standard"),
        ("pre_post", "pre", "normformer"),
        ("pre", "pre", "sub_ln"),
        ("post", "post", "deepnorm"),
    ):
        cases[f"block_{attn}_{mlp}_{style}"] = (
            lambda a=attn, m=mlp, s=style: layers.EncoderBlock(
                4, 32, num_layers=6, attn_norm=a, mlp_norm=m, block_style=s,
                layer_scale=0.5, qk_norm=True, drop_path_rate=0.1,
            )
        )
    return cases


def _stem_layers():
    cases = {}
    for stem in layers.STEM_TYPES:
        cases[f"stem_{stem}"] = lambda s=stem: layers.PatchStem(4, 16, stem=s)
    cases["stem_dpn_rmsnorm_fixed"] = lambda: layers.PatchStem(
        4, 16, stem="dual_patchnorm", stem_norm="rmsnorm", stem_norm_learnable=False
    )
    cases["stem_dpn_affine_gap"] = lambda: layers.PatchStem(
        4, 16, stem="dual_patchnorm", stem_norm="affine", class_token=False
    )
    return cases


PARAMETER_FREE = ("norm_identity", "rmsnorm_standardize_only", "dyt_no_affine")
CASES = {**{k: (v, TOKENS) for k, v in _token_layers().items()},
         **{k: (v, IMAGES) for k, v in _stem_layers().items()}}


def _inputs(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_round_trip(name):
    factory, shape = CASES[name]
    layer = factory()
    x = _inputs(shape)
    y = keras.ops.convert_to_numpy(layer(x))
    config = layer.get_config()
    clone = type(layer).from_config(config)
    assert clone.get_config() == config
    clone(x)
    clone.set_weights(layer.get_weights())
    np.testing.assert_allclose(keras.ops.convert_to_numpy(clone(x)), y, atol=1e-6)
    serialized = keras.saving.serialize_keras_object(layer)
    assert type(keras.saving.deserialize_keras_object(serialized)) is type(layer)


@pytest.mark.parametrize("name", PARAMETER_FREE)
def test_standardize_only_layers_have_no_trainable_weights(name):
    layer = CASES[name][0]()
    layer(_inputs(TOKENS))
    assert layer.trainable_weights == []


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_mixed_precision(name, policy):
    if policy == "mixed_float16" and keras.backend.backend() == "torch" and "stem_conv" in name:
        pytest.skip("PyTorch has no float16 convolution on CPU")
    factory, shape = CASES[name]
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        layer = factory()
        y = layer(_inputs(shape))
    finally:
        keras.config.set_dtype_policy(previous)
    assert all(w.dtype == "float32" for w in layer.weights), [
        (w.path, w.dtype) for w in layer.weights if w.dtype != "float32"
    ]
    assert keras.backend.standardize_dtype(y.dtype) == policy.split("_")[1]
    assert np.isfinite(keras.ops.convert_to_numpy(keras.ops.cast(y, "float32"))).all()


@pytest.mark.parametrize("norm", layers.NORM_TYPES + ("affine",))
def test_norms_stay_finite_on_inputs_beyond_float16_range(norm):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        layer = layers.make_norm(norm, groups=4)
        x = _inputs(TOKENS) * 1e5  # well above float16's 65504
        x[0, 0, 0] = 2e5
        # training=True: BatchNorm normalizes with batch statistics (its inference
        # mode is an affine map with the moving statistics).
        y = keras.ops.convert_to_numpy(keras.ops.cast(layer(x, training=True), "float32"))
    finally:
        keras.config.set_dtype_policy(previous)
    if norm in ("identity", "affine"):
        # These do not normalize: beyond float16's range the float16 output is inf by
        # design, but never NaN.
        assert not np.isnan(y).any()
    else:
        assert np.isfinite(y).all()


@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")
def test_rmsnorm_is_not_keras_rms_scaling_layernorm():
    x = _inputs(TOKENS) + 3.0  # non-zero mean separates the two definitions
    ours = keras.ops.convert_to_numpy(layers.RMSNorm()(x))
    expected = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(ours, expected, atol=1e-5)
    rms_scaling = keras.layers.LayerNormalization(epsilon=1e-6, rms_scaling=True)(x)
    assert np.abs(keras.ops.convert_to_numpy(rms_scaling) - expected).max() > 0.1


def test_patchify_is_conv_patch_embedding_with_reshaped_kernel():
    images = _inputs((2, 8, 8, 3))
    conv = keras.layers.Conv2D(5, 4, strides=4, use_bias=False)
    expected = keras.ops.convert_to_numpy(conv(images)).reshape(2, 4, 5)
    kernel = keras.ops.convert_to_numpy(conv.kernel).reshape(4 * 4 * 3, 5)
    patches = keras.ops.convert_to_numpy(layers.patchify(images, 4))
    np.testing.assert_allclose(patches @ kernel, expected, atol=1e-5)


@pytest.mark.parametrize(
    "factory, message",
    [
        (lambda: layers.make_norm("layer_norm"), "Did you mean 'layernorm'"),
        (lambda: layers.make_norm("affine", learnable=False), "identity"),
        (lambda: layers.EncoderBlock(4, 32, 6, attn_norm="sandwich"), "attn_norm='sandwich'"),
        (lambda: layers.EncoderBlock(4, 32, 6, block_style="deep_norm"), "'deepnorm'"),
        (lambda: layers.EncoderBlock(4, 32, 6, block_style="deepnorm", mlp_norm="pre"),
         "attn_norm='post'"),
        (lambda: layers.EncoderBlock(4, 32, 6, drop_path_rate=1.5), "drop_path_rate"),
        (lambda: layers.PatchStem(4, 16, stem="dpn"), "stem='dpn'"),
        (lambda: layers.PatchStem(4, 16, stem="patch", stem_norm="layernorm"), "stem_norm=None"),
        (lambda: layers.PatchStem(6, 16, stem="conv"), "power of two"),
    ],
)
def test_bad_arguments_raise_clear_errors(factory, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        factory()


def test_attention_width_not_divisible_by_heads():
    with pytest.raises(ValueError, match="width=16 is not divisible by num_heads=3"):
        layers.MultiHeadSelfAttention(3)(_inputs(TOKENS))


def test_stem_rejects_images_not_divisible_by_patch():
    with pytest.raises(ValueError, match="not divisible by patch_size=4"):
        layers.PatchStem(4, 16)(_inputs((2, 10, 8, 3)))


def test_stem_rejects_wrong_image_shape_at_call_time():
    stem = layers.PatchStem(4, 16)
    stem(_inputs(IMAGES))
    with pytest.raises(ValueError, match=r"Expected images of shape \(batch, 8, 8, 3\)"):
        stem(_inputs((3, 8, 8, 1)))


def test_groupnorm_width_must_divide_groups():
    with pytest.raises(ValueError, match="norm_groups"):
        layers.EncoderBlock(4, 32, 6, norm="groupnorm", norm_groups=5)(_inputs(TOKENS))


def _dense_pair(use_bias, activation, lora):
    """A keras Dense and a FusedDense with the same weights (and LoRA weights)."""
    pair = []
    for cls in (keras.layers.Dense, layers.FusedDense):
        keras.utils.set_random_seed(4)
        layer = cls(6, use_bias=use_bias, activation=activation, bias_initializer="random_normal")
        layer.build((None, 16))
        if lora:
            layer.enable_lora(2, b_initializer="random_normal")
        pair.append(layer)
    return pair


@pytest.mark.parametrize("shape", [(4, 16), (2, 5, 16)])
@pytest.mark.parametrize("use_bias,activation,lora", [(True, None, False), (False, "gelu", False), (True, None, True)])
def test_fused_dense_computes_what_keras_dense_computes(shape, use_bias, activation, lora):
    from keras_vitnorm.backend import value_and_gradients

    x = _inputs(shape)
    results = []
    for layer in _dense_pair(use_bias, activation, lora):
        inputs = keras.Input(shape[1:])
        model = keras.Model(inputs, layer(inputs))
        results.append(value_and_gradients(model, x, lambda y: keras.ops.sum(keras.ops.sin(y))))
        results[-1] += (keras.ops.convert_to_numpy(model(x)),)
    (loss_a, dx_a, dw_a, y_a), (loss_b, dx_b, dw_b, y_b) = results
    np.testing.assert_allclose(y_b, y_a, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx_b, dx_a, rtol=1e-5, atol=1e-6)
    by_name = lambda grads: {path.split("/")[-1]: grad for path, grad in grads.items()}  # noqa: E731
    dw_a, dw_b = by_name(dw_a), by_name(dw_b)
    # LoRA freezes the kernel and trains its two low-rank factors instead.
    expected = ({"lora_kernel_a", "lora_kernel_b"} if lora else {"kernel"}) | ({"bias"} if use_bias else set())
    assert set(dw_a) == set(dw_b) == expected
    for name in expected:
        np.testing.assert_allclose(dw_b[name], dw_a[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_batchnorm_in_inference_stays_finite_beyond_float16_range():
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        layer = layers.make_norm("batchnorm")
        x = _inputs(TOKENS) * 1e5
        layer.build(x.shape)
        layer.moving_mean.assign(x.reshape(-1, TOKENS[-1]).mean(axis=0))
        layer.moving_variance.assign(x.reshape(-1, TOKENS[-1]).var(axis=0))
        y = keras.ops.convert_to_numpy(keras.ops.cast(layer(x, training=False), "float32"))
    finally:
        keras.config.set_dtype_policy(previous)
    assert np.isfinite(y).all() and np.abs(y).max() < 10


def test_fused_kernel_initializer_draws_each_block_as_its_own_kernel():
    init = layers.FusedKernelInitializer("glorot_uniform", parts=3)
    kernel = keras.ops.convert_to_numpy(init((300, 900)))
    blocks = np.split(kernel, 3, axis=-1)
    limit = np.sqrt(6.0 / 600)
    for block in blocks:
        assert 0.99 * limit < np.abs(block).max() <= limit
    assert not np.allclose(blocks[0], blocks[1])
    seeded = layers.FusedKernelInitializer(keras.initializers.GlorotUniform(seed=5), parts=3)
    first, again = (keras.ops.convert_to_numpy(seeded((10, 30))) for _ in range(2))
    np.testing.assert_array_equal(first, again)  # a fixed seed is reproducible...
    assert not np.allclose(*np.split(first, 3, axis=-1)[:2])  # ...and the blocks still differ
    clone = keras.initializers.deserialize(keras.initializers.serialize(seeded))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(clone((10, 30))), first)
    with pytest.raises(ValueError, match="900 is not divisible by 7"):
        layers.FusedKernelInitializer(parts=7)((300, 900))


def test_scaled_initializer_multiplies_the_draw_as_a_whole_or_block_by_block():
    inner = keras.initializers.GlorotUniform(seed=3)
    drawn = keras.ops.convert_to_numpy(inner((8, 12)))
    scaled = layers.ScaledInitializer(inner, 0.25)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(scaled((8, 12))), drawn * 0.25)
    blockwise = layers.ScaledInitializer(inner, [1.0, 1.0, 0.5])
    value = keras.ops.convert_to_numpy(blockwise((8, 12)))
    np.testing.assert_array_equal(value[:, :8], drawn[:, :8])
    np.testing.assert_array_equal(value[:, 8:], drawn[:, 8:] * 0.5)
    clone = keras.initializers.deserialize(keras.initializers.serialize(blockwise))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(clone((8, 12))), value)
    with pytest.raises(ValueError, match="12 is not divisible by 5"):
        layers.ScaledInitializer(inner, [1.0] * 5)((8, 12))
    with pytest.raises(ValueError, match="scale must be a number"):
        layers.ScaledInitializer(inner, "0.5")


@pytest.mark.parametrize(
    "factory, message",
    [
        (lambda: layers.make_norm("layernorm", epsilon=-1.0), "epsilon must be a finite number > 0"),
        (lambda: layers.RMSNorm(epsilon="x"), "epsilon must be a finite number > 0, got 'x'"),
        (lambda: layers.DyT(alpha_init=0.0), "alpha_init must be a finite number > 0"),
        (lambda: layers.LayerScale(float("inf")), "init_value must be a finite number > 0"),
        (lambda: layers.MLP(8, dropout=1.5), r"dropout must be a float in \[0, 1\)"),
        (lambda: layers.MLP(8, mid_norm="ln"), "Unknown mid_norm='ln'"),
        (lambda: layers.MultiHeadSelfAttention(2, init_scale=0), "init_scale must be a finite"),
        (lambda: layers.MultiHeadSelfAttention(2, head_scale=1), "head_scale must be True or False"),
        (lambda: layers.PatchStem(4, 8, norm_epsilon=-1e-6), "norm_epsilon must be a finite"),
        (lambda: layers.EncoderBlock(2, 8, 2, norm_epsilon=0), "norm_epsilon must be a finite"),
    ],
)
def test_numeric_options_are_range_checked_at_construction(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_dropout_layers_are_called_only_with_a_nonzero_rate(monkeypatch, rate):
    # A rate of 0 is the identity, so the block skips the layer call (Keras' per-call
    # cost); a nonzero rate still drops in training only.
    calls = []
    original = keras.layers.Dropout.call

    def counting(self, inputs, training=False):
        calls.append(self.name)
        return original(self, inputs, training=training)

    monkeypatch.setattr(keras.layers.Dropout, "call", counting)
    block = layers.EncoderBlock(num_heads=2, mlp_dim=32, num_layers=2, dropout=rate, drop_path_rate=rate)
    x = _inputs((4, 5, 16))
    inference = keras.ops.convert_to_numpy(block(x, training=False))
    keras.utils.set_random_seed(0)
    training = keras.ops.convert_to_numpy(block(x, training=True))
    # Per call: attention's dropout, MLP's two, and drop path on both branches.
    assert len(calls) == (0 if rate == 0 else 2 * 5)
    if rate == 0:
        np.testing.assert_allclose(training, inference, rtol=1e-6, atol=1e-6)
    else:
        assert np.abs(training - inference).max() > 1e-3

