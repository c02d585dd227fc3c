"""Per-layer behaviour: shapes, config round trip, gradients, mixed precision, errors."""

from math import erf

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


def _expected_shape(name, input_shape):
    if name.startswith("stem"):
        tokens = (input_shape[1] // 4) * (input_shape[2] // 4)
        return (input_shape[0], tokens + (0 if "gap" in name else 1), 16)
    return input_shape


def _inputs(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


@pytest.mark.parametrize("name", sorted(CASES))
def test_output_shape(name):
    factory, shape = CASES[name]
    y = factory()(_inputs(shape))
    assert tuple(y.shape) == _expected_shape(name, shape)
    assert np.isfinite(keras.ops.convert_to_numpy(y)).all()


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


@pytest.mark.parametrize("name", sorted(set(CASES) - set(PARAMETER_FREE)))
def test_every_trainable_weight_gets_a_gradient_in_one_fit_step(name):
    factory, shape = CASES[name]
    keras.utils.set_random_seed(1)
    layer = factory()
    inputs = keras.Input(shape[1:])
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(layer(inputs)))
    model = keras.Model(inputs, outputs)
    before = {v.path: keras.ops.convert_to_numpy(v) for v in layer.trainable_weights}
    assert before, "layer under test has no trainable weights"
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = _inputs(shape, 2), _inputs((shape[0], 1), 3)
    model.fit(x, y, batch_size=shape[0], epochs=1, verbose=0)
    unchanged = [
        v.path
        for v in layer.trainable_weights
        if np.array_equal(before[v.path], keras.ops.convert_to_numpy(v))
    ]
    assert not unchanged, f"no gradient reached {unchanged}"


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


@pytest.mark.parametrize("num_tokens", [5, 6])
@pytest.mark.parametrize("training", [False, True])
def test_keras_attention_asks_for_xla_attention_only_where_jax_cudnn_rejects_it(monkeypatch, num_tokens,
                                                                                  training):
    # JAX's cuDNN flash attention rejects odd token counts at training time; there
    # keras_attention asks for XLA attention (False); everywhere else Keras chooses (None).
    from keras_vitnorm.layers.attention import keras_attention

    seen = []
    original = keras.ops.dot_product_attention

    def recording(*args, **kwargs):
        seen.append(kwargs.get("flash_attention", "not passed"))
        return original(*args, **kwargs)

    monkeypatch.setattr(keras.ops, "dot_product_attention", recording)
    q, k, v = _qkv(3, shape=(2, num_tokens, 2, 8))
    y = keras_attention(q, k, v, training=training)
    rejects = keras.backend.backend() == "jax" and training and num_tokens % 2 == 1
    assert seen == [False if rejects else None]
    np.testing.assert_allclose(keras.ops.convert_to_numpy(y),
                               keras.ops.convert_to_numpy(original(q, k, v)), rtol=1e-6, atol=1e-6)


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
    from keras_vitnorm.backend_ops import value_and_gradients

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


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="PyTorch's oneDNN linear; this run's backend is another")
@pytest.mark.parametrize("use_bias", [True, False])
def test_linear_takes_onednn_only_where_no_gradient_is_recorded(monkeypatch, use_bias):
    import platform

    import torch

    from keras_vitnorm import backend_ops

    if backend_ops.torch_onednn_linear() is None:
        pytest.skip(f"no oneDNN linear in this PyTorch build on {platform.machine()}")
    calls = []
    original = backend_ops.torch_onednn_linear()

    def counting(*args):
        calls.append(args[0].shape)
        return original(*args)

    monkeypatch.setattr(backend_ops, "torch_onednn_linear", lambda: counting)
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.normal(size=(2, 7, 24)).astype("float32"))
    kernel = torch.nn.Parameter(torch.from_numpy(rng.normal(size=(24, 40)).astype("float32")))
    bias = torch.nn.Parameter(torch.from_numpy(rng.normal(size=(40,)).astype("float32"))) if use_bias else None
    expected = torch.nn.functional.linear(x, kernel.T, bias).detach().numpy()
    with torch.no_grad():
        predicted = backend_ops.linear(x, kernel, bias)
    assert calls == [(2, 7, 24)]
    np.testing.assert_allclose(predicted.numpy(), expected, rtol=1e-5, atol=1e-5)
    # With a gradient recorded (the parameters require one) it is torch.nn.functional.linear,
    # which autograd differentiates; the oneDNN op has no gradient formula.
    trained = backend_ops.linear(x, kernel, bias)
    assert len(calls) == 1
    trained.sum().backward()
    np.testing.assert_allclose(kernel.grad.numpy(), np.broadcast_to(x.sum((0, 1)).numpy()[:, None], (24, 40)),
                               rtol=1e-5, atol=1e-5)
    # float64 and bfloat16 inputs keep torch.nn.functional.linear too.
    with torch.no_grad():
        backend_ops.linear(x.double(), kernel.double(), None)
        backend_ops.linear(x.bfloat16(), kernel.bfloat16(), None)
    assert len(calls) == 1


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="PyTorch's oneDNN linear; this run's backend is another")
def test_onednn_linear_is_left_out_where_it_cannot_be_checked(monkeypatch):
    import platform

    import torch

    from keras_vitnorm import backend_ops

    try:
        backend_ops.torch_onednn_linear.cache_clear()
        monkeypatch.setattr(platform, "machine", lambda: "aarch64")
        assert backend_ops.torch_onednn_linear() is None
        backend_ops.torch_onednn_linear.cache_clear()
        monkeypatch.setattr(platform, "machine", lambda: "x86_64")
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
        assert backend_ops.torch_onednn_linear() is None
    finally:  # the real answer again, for the tests that follow
        monkeypatch.undo()
        backend_ops.torch_onednn_linear.cache_clear()


@pytest.mark.parametrize("qkv_bias", [True, False])
@pytest.mark.parametrize("lora", [False, True])
def test_split_and_fused_qkv_projections_agree(monkeypatch, qkv_bias, lora):
    # TensorFlow projects q, k and v with three matmuls on column slices of the fused
    # kernel; the other backends slice one matmul's output. Both forms, forced on
    # this backend, must give the same output and gradients from the same weights.
    from keras_vitnorm.backend_ops import value_and_gradients
    from keras_vitnorm.layers import attention

    keras.utils.set_random_seed(5)
    layer = layers.MultiHeadSelfAttention(4, qkv_bias=qkv_bias, qk_norm="layernorm")
    inputs = keras.Input(TOKENS[1:])
    model = keras.Model(inputs, layer(inputs))
    if lora:
        layer.qkv.enable_lora(2, b_initializer="random_normal")
    if qkv_bias:  # a zero-initialized bias would hide a bias sliced in the wrong place
        layer.qkv.bias.assign(np.random.default_rng(1).normal(size=layer.qkv.bias.shape).astype("float32"))
    x = _inputs(TOKENS)
    results = {}
    for form, backends in (("fused", ()), ("split", (keras.backend.backend(),))):
        monkeypatch.setattr(attention, "_SPLIT_QKV_BACKENDS", backends)
        results[form] = value_and_gradients(model, x, lambda y: keras.ops.sum(keras.ops.sin(y)))
    (loss_f, dx_f, dw_f), (loss_s, dx_s, dw_s) = results["fused"], results["split"]
    np.testing.assert_allclose(loss_s, loss_f, rtol=1e-5)
    np.testing.assert_allclose(dx_s, dx_f, rtol=1e-4, atol=1e-5)
    assert set(dw_s) == set(dw_f)
    for path in dw_f:  # float32 sums in another order: atol against gradients of order 1 to 10
        np.testing.assert_allclose(dw_s[path], dw_f[path], rtol=1e-4, atol=1e-5, err_msg=path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_gelu_matches_keras_exact_gelu(dtype):
    from keras_vitnorm.layers.mlp import gelu_exact

    # Wide range: the tails are where an erf form and an erfc form could part ways.
    values = np.linspace(-12.0, 12.0, 4001).astype("float32")
    x = keras.ops.cast(values, dtype)
    ours = gelu_exact(x)
    assert keras.backend.standardize_dtype(ours.dtype) == dtype
    theirs = keras.activations.gelu(x, approximate=False)
    ours, theirs = (keras.ops.convert_to_numpy(keras.ops.cast(t, "float32")) for t in (ours, theirs))
    if dtype == "float32":
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=2e-6)
    else:  # one bfloat16 rounding step apart at most
        np.testing.assert_allclose(ours, theirs, rtol=1e-2, atol=1e-2)
    assert np.all(np.isfinite(ours))


def test_exact_gelu_gradient_matches_keras_exact_gelu():
    from keras_vitnorm.backend_ops import value_and_gradients
    from keras_vitnorm.layers.mlp import gelu_exact

    x = np.random.default_rng(5).normal(0, 3, (4, 8, 16)).astype("float32")
    grads = []
    for activation in (gelu_exact, lambda t: keras.activations.gelu(t, approximate=False)):
        model = keras.Sequential([keras.Input((8, 16)), keras.layers.Lambda(activation)])
        grads.append(value_and_gradients(model, x, lambda y: keras.ops.sum(y * y))[1])
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_closed_form_gelu_gradient_matches_autodiff_of_the_erf_form(dtype):
    # The closed-form backward is what TensorFlow trains with; it runs on every backend.
    from keras_vitnorm.backend_ops import value_and_gradients
    from keras_vitnorm.layers.mlp import _gelu_erf_closed_form_gradient
    from keras_vitnorm.layers.mlp import gelu_erf

    values = np.concatenate([np.linspace(-12.0, 12.0, 97), np.random.default_rng(6).normal(0, 2, 415)])
    x = values.astype("float32").reshape(4, 8, 16)
    outputs, grads = [], []
    for activation in (_gelu_erf_closed_form_gradient, gelu_erf):
        y = activation(keras.ops.cast(x, dtype))
        assert keras.backend.standardize_dtype(y.dtype) == dtype
        outputs.append(keras.ops.convert_to_numpy(keras.ops.cast(y, "float32")))
        model = keras.Sequential([keras.Input((8, 16)), keras.layers.Lambda(activation)])
        grads.append(value_and_gradients(model, x, lambda y: keras.ops.sum(y * y))[1])
    np.testing.assert_array_equal(outputs[0], outputs[1])
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6)
    # Against the derivative itself, d/dx of x * Phi(x) = Phi(x) + x * phi(x), times 2y.
    phi = np.exp(-0.5 * x.astype("float64") ** 2) / np.sqrt(2 * np.pi)
    cdf = 0.5 * (1 + np.vectorize(erf)(x.astype("float64") / np.sqrt(2)))
    np.testing.assert_allclose(grads[0], 2 * x * cdf * (cdf + x * phi), rtol=1e-5, atol=1e-5)


def _qkv(seed, dtype="float32", shape=(2, 7, 3, 6)):  # head_dim 6: a scale that is not a power of two
    rng = np.random.default_rng(seed)
    return [keras.ops.cast(rng.normal(0, 2, shape).astype("float32"), dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_heads_first_attention_matches_dot_product_attention(dtype):
    from keras_vitnorm.layers.attention import heads_first_attention

    q, k, v = _qkv(11, dtype)
    ours = heads_first_attention(q, k, v)
    theirs = keras.ops.dot_product_attention(q, k, v)
    assert tuple(ours.shape) == (2, 7, 3, 6)
    assert keras.backend.standardize_dtype(ours.dtype) == dtype
    ours, theirs = (keras.ops.convert_to_numpy(keras.ops.cast(t, "float32")) for t in (ours, theirs))
    if dtype == "float32":
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    else:  # bfloat16 inputs and outputs, float32 softmax in both
        np.testing.assert_allclose(ours, theirs, rtol=3e-2, atol=3e-2)


def test_attention_logits_beyond_float16_range_stay_finite():
    """q and k of a few hundred over 8 dims give logits past 65504: every form the layer
    takes (`attend`) and `heads_first_attention` accumulate them in float32."""
    from keras_vitnorm.layers.attention import attend
    from keras_vitnorm.layers.attention import heads_first_attention

    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(2, 9, 4, 8)).astype("float32") * 300 for _ in range(3))
    expected = keras.ops.convert_to_numpy(heads_first_attention(q, k, v))
    half = [keras.ops.cast(t, "float16") for t in (q, k, v)]
    for function in (heads_first_attention, attend):
        got = keras.ops.convert_to_numpy(keras.ops.cast(function(*half), "float32"))
        assert np.isfinite(got).all(), function.__name__
        np.testing.assert_allclose(got, expected, rtol=0.01, atol=0.5)


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


def test_heads_first_attention_gradient_matches_dot_product_attention():
    from keras_vitnorm.backend_ops import value_and_gradients
    from keras_vitnorm.layers.attention import heads_first_attention

    x = np.concatenate([keras.ops.convert_to_numpy(t) for t in _qkv(12)], axis=-1)  # (2, 7, 3, 18)
    grads = []
    for function in (heads_first_attention, keras.ops.dot_product_attention):
        def attention(t, function=function):
            return function(t[..., :6], t[..., 6:12], t[..., 12:])

        model = keras.Sequential([keras.Input((7, 3, 18)), keras.layers.Lambda(attention)])
        grads.append(value_and_gradients(model, x, lambda y: keras.ops.sum(keras.ops.sin(y)))[1])
    assert np.abs(grads[0]).max() > 1e-3  # the gradient reaches q, k and v
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-4, atol=1e-5)


def _jax_or_tensorflow_on_this_cpu():
    from keras_vitnorm.backend_ops import jax_or_tensorflow_on_cpu

    return keras.backend.backend() in ("jax", "tensorflow") and jax_or_tensorflow_on_cpu()


@pytest.mark.parametrize("form, applies", [
    ("heads_first_attention", _jax_or_tensorflow_on_this_cpu),
    ("torch_attention", lambda: keras.backend.backend() == "torch"),
    ("keras_attention", lambda: False),  # on this CPU every backend has its own form
])
def test_attend_takes_each_form_only_where_it_applies(monkeypatch, form, applies):
    from keras_vitnorm.layers import attention

    calls = []

    def spy(q, k, v, *args):
        calls.append(tuple(q.shape))
        return keras.ops.dot_product_attention(q, k, v)

    monkeypatch.setattr(attention, form, spy)
    layers.MultiHeadSelfAttention(num_heads=2)(_inputs((2, 5, 8)))
    assert calls == ([(2, 5, 2, 4)] if applies() else [])


@pytest.mark.parametrize("num_tokens, training, padded", [(5, True, True), (5, False, False), (6, True, False)])
def test_attend_pads_for_jax_cudnn_only_in_training_with_an_odd_token_count(monkeypatch, num_tokens, training,
                                                                            padded):
    from keras_vitnorm.layers import attention

    if keras.backend.backend() != "jax":
        pytest.skip("jax_padded_attention is JAX's; this run's backend is another")
    # As on a GPU where cuDNN's attention fits: not the CPU forms, cuDNN available.
    monkeypatch.setattr(attention, "jax_or_tensorflow_on_cpu", lambda: False)
    monkeypatch.setattr(attention, "jax_cudnn_attention_fits", lambda q, k, v: True)
    calls = []

    def spy(q, k, v):
        calls.append(tuple(q.shape))
        return keras.ops.dot_product_attention(q, k, v)

    monkeypatch.setattr(attention, "jax_padded_attention", spy)
    layers.MultiHeadSelfAttention(num_heads=2)(_inputs((2, num_tokens, 8)), training=training)
    assert calls == ([(2, num_tokens, 2, 4)] if padded else [])


def test_jax_cudnn_attention_fits_no_cpu_tensors():
    from keras_vitnorm.backend_ops import jax_cudnn_attention_fits

    q, k, v = _qkv(5, "bfloat16", shape=(2, 7, 2, 8))
    if keras.backend.backend() == "jax":
        import jax

        if jax.default_backend() != "cpu":
            pytest.skip("asserts the CPU answer; this host has an accelerator")
    assert jax_cudnn_attention_fits(q, k, v) is False


@pytest.mark.parametrize("num_tokens, dtype", [(13, "float32"), (16, "float32"), (13, "bfloat16")])
def test_jax_padded_attention_matches_unpadded_attention(num_tokens, dtype):
    from keras_vitnorm.backend_ops import jax_padded_attention

    if keras.backend.backend() != "jax":
        pytest.skip("jax_padded_attention is JAX's; this run's backend is another")
    import jax
    import jax.numpy as jnp

    q, k, v = _qkv(7, dtype, shape=(2, num_tokens, 3, 8))
    # cuDNN needs a GPU; XLA's attention takes the same padding and length arguments.
    ours = jax_padded_attention(q, k, v, implementation="xla")
    theirs = keras.ops.dot_product_attention(q, k, v)
    assert ours.shape == (2, num_tokens, 3, 8) and ours.dtype == theirs.dtype
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(ours, "float32"), np.asarray(theirs, "float32"),
                               rtol=tolerance, atol=tolerance)
    weights = jnp.asarray(np.random.default_rng(8).normal(size=ours.shape), "float32")

    def loss(function):
        return lambda *qkv: jnp.sum(function(*qkv).astype("float32") * weights)

    padded = jax.grad(loss(lambda *t: jax_padded_attention(*t, implementation="xla")), argnums=(0, 1, 2))
    plain = jax.grad(loss(keras.ops.dot_product_attention), argnums=(0, 1, 2))
    for ours, theirs in zip(padded(q, k, v), plain(q, k, v)):
        assert float(jnp.max(jnp.abs(theirs.astype("float32")))) > 1e-2
        np.testing.assert_allclose(np.asarray(ours, "float32"), np.asarray(theirs, "float32"),
                                   rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_attention_matches_dot_product_attention(dtype):
    from keras_vitnorm.backend_ops import torch_attention

    if keras.backend.backend() != "torch":
        pytest.skip("backend_ops.torch_attention is PyTorch's attention; this run's backend is another")
    q, k, v = _qkv(13, dtype)
    ours = torch_attention(q, k, v)
    theirs = keras.ops.dot_product_attention(q, k, v)
    assert tuple(ours.shape) == (2, 7, 3, 6) and ours.dtype == theirs.dtype
    tolerance = 1e-6 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(*(keras.ops.convert_to_numpy(keras.ops.cast(t, "float32")) for t in (ours, theirs)),
                               rtol=tolerance, atol=tolerance)
    # Gradients reach q, k and v alike.
    grads = []
    for function in (torch_attention, keras.ops.dot_product_attention):
        leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
        keras.ops.sum(keras.ops.sin(function(*leaves))).backward()
        grads.append([keras.ops.convert_to_numpy(t.grad) for t in leaves])
    for ours, theirs in zip(*grads):
        assert np.abs(ours).max() > 1e-3
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_jax_or_tensorflow_on_cpu_is_true_for_those_backends_on_this_cpu_host():
    import jax

    from keras_vitnorm.backend_ops import jax_or_tensorflow_on_cpu

    if jax.default_backend() != "cpu":
        pytest.skip("asserts the CPU answer; this host has an accelerator")
    assert jax_or_tensorflow_on_cpu() == (keras.backend.backend() in ("jax", "tensorflow"))


@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_dropout_layers_are_called_only_with_a_nonzero_rate(monkeypatch, rate):
    # A rate of 0 is the identity, so the block skips the layer call (its cost is
    # Keras' per-call overhead); a nonzero rate still drops in training only.
    # Counted at `call`, which both Keras' `__call__` and `call_sublayer`'s direct path reach.
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


def test_jax_padded_attention_falls_back_to_xla_where_jax_rejects_cudnn(monkeypatch):
    from keras_vitnorm.backend_ops import jax_padded_attention

    if keras.backend.backend() != "jax":
        pytest.skip("jax_padded_attention is JAX's; this run's backend is another")
    import jax

    original, asked = jax.nn.dot_product_attention, []

    def cudnn_rejects(*args, implementation=None, **kwargs):
        asked.append(implementation)
        if implementation == "cudnn":  # as JAX does where cuDNN does not take the inputs
            raise NotImplementedError("Unsupported sequence length")
        return original(*args, implementation=implementation, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", cudnn_rejects)
    q, k, v = _qkv(9, shape=(2, 13, 3, 8))
    ours = jax_padded_attention(q, k, v)
    assert asked == ["cudnn", "xla"]
    np.testing.assert_allclose(np.asarray(ours), np.asarray(original(q, k, v, implementation="xla")),
                               rtol=1e-6, atol=1e-6)
