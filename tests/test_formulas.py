"""Layer outputs against the independent float64 NumPy formulas of `numpy_reference`.

Every variable of each built layer is first set to a random value (gains around
1 +- 0.3, random shifts, kernels and BatchNorm moving statistics), so that a weight
used in the wrong place, or not at all, changes the output. The init-scaling
constants of DeepNorm and Sub-LN are checked on freshly initialized weights.
"""

import math

import keras
import numpy as np
import numpy_reference as ref
import pytest

from keras_vitnorm.layers import MLP
from keras_vitnorm.layers import PLACEMENTS
from keras_vitnorm.layers import EncoderBlock
from keras_vitnorm.layers import MultiHeadSelfAttention
from keras_vitnorm.layers import PatchStem
from keras_vitnorm.layers import make_norm

ATOL = 1e-5
RTOL = 1e-5
EPSILON = 1e-6
GROUPS = 4
BATCH, TOKENS, WIDTH, HEADS, MLP_DIM, DEPTH = 2, 5, 16, 2, 32, 6

# Gains, scales and LayerScale/head gains: 1 +- 0.3.
_GAIN_NAMES = ("gamma", "scale", "head_scale")


def _random_value(name, shape, rng):
    if name in _GAIN_NAMES:
        return 1.0 + rng.uniform(-0.3, 0.3, shape)
    if name == "moving_variance":
        return rng.uniform(0.5, 1.5, shape)
    if name == "alpha":
        return rng.uniform(0.3, 0.9, shape)
    if name == "kernel":
        return rng.normal(0.0, 1.0 / math.sqrt(shape[0]), shape)
    return rng.normal(0.0, 0.3, shape)


def randomize(layer, seed=0):
    """Assigns a random value to every variable of a built layer.

    Args:
        layer: a built Keras layer.
        seed: int, default `0`.

    Returns:
        The assigned values as a nested dict following the variable paths below
        the layer (e.g. `{"attention": {"qkv": {"kernel": array}}}`), float64.
    """
    rng = np.random.default_rng(seed)
    tree = {}
    for variable in layer.weights:
        *scopes, name = variable.path.split("/")[1:]
        value = _random_value(name, tuple(variable.shape), rng)
        variable.assign(value.astype(variable.dtype))
        node = tree
        for scope in scopes:
            node = node.setdefault(scope, {})
        node[name] = value.astype(variable.dtype).astype(np.float64)
    return tree


def random_input(shape, seed=1):
    """A float32 standard normal array of `shape`."""
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def assert_matches(got, expected):
    np.testing.assert_allclose(keras.ops.convert_to_numpy(got), expected, atol=ATOL, rtol=RTOL)


def build_and_randomize(layer, input_shape, seed=0):
    layer.build(input_shape)
    return randomize(layer, seed)


# --- Norms ---------------------------------------------------------------------------

# The norm types other than identity; each also has a standardize-only form
# (`learnable=False`: no scale or shift, and for DyT a frozen alpha).
BLOCK_NORMS = ("layernorm", "rmsnorm", "batchnorm", "groupnorm", "dyt")
ALL_NORMS = (*BLOCK_NORMS, "identity", "affine")


@pytest.mark.parametrize(
    "kind, learnable",
    [(kind, True) for kind in ALL_NORMS] + [(kind, False) for kind in BLOCK_NORMS],
)
def test_norm_matches_formula(kind, learnable):
    x = random_input((BATCH, TOKENS, WIDTH))
    layer = make_norm(kind, epsilon=EPSILON, learnable=learnable, groups=GROUPS)
    weights = build_and_randomize(layer, x.shape)
    expected = ref.norm(kind, x, weights, epsilon=EPSILON, groups=GROUPS)
    assert_matches(layer(x, training=False), expected)


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_norm_gradients_match_finite_differences(kind):
    # RMSNorm's backward is written out under TensorFlow; LayerNorm is the control.
    from keras_vitnorm.backend import value_and_gradients

    x = random_input((2, 3, 8))
    upstream = np.random.default_rng(7).normal(size=x.shape)
    layer = make_norm(kind, epsilon=EPSILON)
    weights = build_and_randomize(layer, x.shape)
    model = keras.Sequential([layer])
    model.build(x.shape)
    _, input_grad, weight_grads = value_and_gradients(
        model, x, lambda y: keras.ops.sum(y * keras.ops.convert_to_tensor(upstream, "float32")))

    def objective(x64, weights64):
        return float(np.sum(ref.norm(kind, x64, weights64, epsilon=EPSILON) * upstream))

    def numeric(array, evaluate, step=1e-5):
        grad = np.zeros(array.shape)
        for index in np.ndindex(array.shape):
            plus, minus = array.astype("float64"), array.astype("float64")
            plus[index] += step
            minus[index] -= step
            grad[index] = (evaluate(plus) - evaluate(minus)) / (2 * step)
        return grad

    np.testing.assert_allclose(input_grad, numeric(x, lambda v: objective(v, weights)), rtol=1e-3, atol=1e-4)
    for variable in layer.trainable_variables:
        name = variable.path.split("/")[-1]

        def with_weight(value, name=name):
            return objective(x.astype("float64"), {**weights, name: value})

        np.testing.assert_allclose(weight_grads[variable.path], numeric(weights[name], with_weight),
                                   rtol=1e-3, atol=1e-4, err_msg=variable.path)


@pytest.mark.parametrize("learnable", [True, False])
def test_batchnorm_training_uses_batch_token_statistics(learnable):
    x = 2.0 * random_input((BATCH, TOKENS, WIDTH)) + 0.5
    layer = make_norm("batchnorm", epsilon=EPSILON, learnable=learnable)
    weights = build_and_randomize(layer, x.shape)
    expected = ref.norm("batchnorm", x, weights, epsilon=EPSILON, training=True)
    assert_matches(layer(x, training=True), expected)


def test_batchnorm_moving_statistics_use_torch_equivalent_momentum():
    """Keras momentum 0.9 (PyTorch's 0.1); Keras updates with the biased batch variance."""
    x = 2.0 * random_input((BATCH, TOKENS, WIDTH)) + 0.5
    layer = make_norm("batchnorm", epsilon=EPSILON)
    weights = build_and_randomize(layer, x.shape)
    layer(x, training=True)
    mean, variance = ref.batch_norm_statistics(x)
    assert_matches(layer.moving_mean, 0.9 * weights["moving_mean"] + 0.1 * mean)
    assert_matches(layer.moving_variance, 0.9 * weights["moving_variance"] + 0.1 * variance)


# --- Attention and MLP ---------------------------------------------------------------

ATTENTION_CASES = {
    "plain": {},
    "qk_layernorm": {"qk_norm": "layernorm"},
    "qk_rmsnorm": {"qk_norm": "rmsnorm"},
    "head_scale": {"head_scale": True},
    "inner_layernorm": {"inner_norm": "layernorm"},
    "inner_rmsnorm": {"inner_norm": "rmsnorm"},
    "all": {"qk_norm": "layernorm", "head_scale": True, "inner_norm": "layernorm"},
}


@pytest.mark.parametrize("num_heads", [2, 4])
@pytest.mark.parametrize("qk_norm", ["layernorm", "rmsnorm", "dyt", "identity"])
def test_qk_norm_of_every_offered_type_matches_the_per_head_formula(qk_norm, num_heads):
    x = random_input((BATCH, TOKENS, WIDTH))
    layer = MultiHeadSelfAttention(num_heads, qk_norm=qk_norm, norm_epsilon=EPSILON)
    weights = build_and_randomize(layer, x.shape)
    expected = ref.multi_head_self_attention(
        x, weights, num_heads, qk_norm=qk_norm, epsilon=EPSILON
    )
    assert_matches(layer(x), expected)


@pytest.mark.parametrize("qk_norm", ["batchnorm", "groupnorm"])
def test_qk_norm_types_whose_statistics_span_heads_or_tokens_are_refused(qk_norm):
    with pytest.raises(ValueError, match=f"norm={qk_norm!r} does not"):
        MultiHeadSelfAttention(2, qk_norm=qk_norm)
    with pytest.raises(ValueError, match="QK-norm is offered with 'layernorm', 'rmsnorm'"):
        EncoderBlock(HEADS, MLP_DIM, DEPTH, norm=qk_norm, norm_groups=GROUPS, qk_norm=True)


@pytest.mark.parametrize("num_heads", [2, 4])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_matches_formula(case, num_heads):
    options = ATTENTION_CASES[case]
    x = random_input((BATCH, TOKENS, WIDTH))
    layer = MultiHeadSelfAttention(num_heads, norm_epsilon=EPSILON, **options)
    weights = build_and_randomize(layer, x.shape)
    expected = ref.multi_head_self_attention(x, weights, num_heads, epsilon=EPSILON, **options)
    assert_matches(layer(x), expected)


@pytest.mark.parametrize("mid_norm", [None, *BLOCK_NORMS])
def test_mlp_matches_formula(mid_norm):
    x = random_input((BATCH, TOKENS, WIDTH))
    layer = MLP(MLP_DIM, mid_norm=mid_norm, norm_epsilon=EPSILON, norm_groups=GROUPS)
    weights = build_and_randomize(layer, x.shape)
    expected = ref.mlp(x, weights, mid_norm, epsilon=EPSILON, groups=GROUPS)
    assert_matches(layer(x), expected)


def test_gelu_is_exact_erf_form():
    x = np.linspace(-4.0, 4.0, 41, dtype="float32")
    layer = MLP(1)
    layer.build((None, 1))
    layer.fc1.kernel.assign(np.ones((1, 1), "float32"))
    layer.fc1.bias.assign(np.zeros((1,), "float32"))
    layer.fc2.kernel.assign(np.ones((1, 1), "float32"))
    layer.fc2.bias.assign(np.zeros((1,), "float32"))
    assert_matches(layer(x[:, None])[:, 0], ref.gelu(x))


# --- Encoder block -------------------------------------------------------------------


def check_block(seed=0, training=False, **config):
    """Builds an `EncoderBlock`, randomizes it and compares to `ref.encoder_block`."""
    config = {"norm": "layernorm", "norm_groups": GROUPS, "norm_epsilon": EPSILON, **config}
    x = random_input((BATCH, TOKENS, WIDTH), seed=seed + 1)
    block = EncoderBlock(HEADS, MLP_DIM, DEPTH, **config)
    weights = build_and_randomize(block, x.shape, seed)
    expected = ref.encoder_block(
        x,
        weights,
        HEADS,
        DEPTH,
        norm_type=config["norm"],
        attn_norm=config.get("attn_norm", "pre"),
        mlp_norm=config.get("mlp_norm", "pre"),
        block_style=config.get("block_style", "standard"),
        qk_norm=config.get("qk_norm", False),
        layer_scale=config.get("layer_scale") is not None,
        epsilon=EPSILON,
        groups=GROUPS,
        training=training,
    )
    assert_matches(block(x, training=training), expected)


@pytest.mark.parametrize("mlp_norm", PLACEMENTS)
@pytest.mark.parametrize("attn_norm", PLACEMENTS)
def test_block_placements_match_formula(attn_norm, mlp_norm):
    check_block(attn_norm=attn_norm, mlp_norm=mlp_norm)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "dyt"])
@pytest.mark.parametrize(
    "block_style, attn_norm, mlp_norm",
    [
        ("normformer", "pre", "pre"),
        ("sub_ln", "pre", "pre"),
        ("deepnorm", "post", "post"),
    ],
)
def test_block_styles_match_formula(block_style, attn_norm, mlp_norm, norm):
    check_block(block_style=block_style, attn_norm=attn_norm, mlp_norm=mlp_norm, norm=norm)


@pytest.mark.parametrize("norm", [*BLOCK_NORMS, "identity"])
def test_block_norm_types_match_formula(norm):
    check_block(norm=norm, attn_norm="pre_post", mlp_norm="post")


@pytest.mark.parametrize("block_style", ["standard", "normformer", "sub_ln"])
def test_block_batchnorm_training_matches_formula(block_style):
    check_block(norm="batchnorm", block_style=block_style, training=True)


def test_block_with_qk_norm_and_layer_scale_matches_formula():
    check_block(attn_norm="pre_post", qk_norm=True, layer_scale=0.1)


def test_normformer_applies_dropout_after_the_attention_output_norm():
    """fairseq: `x = residual + dropout(attn_ln(h))`. With the MLP branch zeroed, the
    block's update is the attention branch: in training each entry is either dropped
    (exactly 0) or twice the inference value of the normalized output."""
    x = random_input((8, TOKENS, WIDTH))
    block = EncoderBlock(
        HEADS, MLP_DIM, DEPTH, block_style="normformer", mlp_norm="none", dropout=0.5,
        norm_epsilon=EPSILON,
    )
    build_and_randomize(block, x.shape)
    for variable in (block.mlp.fc2.kernel, block.mlp.fc2.bias):
        variable.assign(np.zeros(variable.shape, "float32"))
    branch = keras.ops.convert_to_numpy(block(x, training=False)) - x
    keras.utils.set_random_seed(3)
    dropped = keras.ops.convert_to_numpy(block(x, training=True)) - x
    kept = np.abs(dropped) > 1e-6
    assert 0.3 < kept.mean() < 0.7
    np.testing.assert_allclose(dropped[kept], 2.0 * branch[kept], rtol=1e-4, atol=1e-5)


# --- Initialization: big_vision's base, DeepNorm and Sub-LN scaling -----------------


def _xavier_uniform_std(fan_in, fan_out):
    """Standard deviation of Xavier-uniform: limit sqrt(6 / (fan_in + fan_out)), over sqrt(3)."""
    return math.sqrt(2.0 / (fan_in + fan_out))


@pytest.mark.parametrize("width, num_heads", [(384, 6), (192, 3)])
def test_every_projection_starts_at_big_visions_xavier_uniform_scale(width, num_heads):
    """q, k and v are each Xavier-uniform on their own (width, width) shape, as
    big_vision's three DenseGeneral projections, not one call on (width, 3 * width)."""
    keras.utils.set_random_seed(7)
    block = EncoderBlock(num_heads, 4 * width, INIT_DEPTH)
    block.build((None, TOKENS, width))
    qkv = keras.ops.convert_to_numpy(block.attention.qkv.kernel)
    kernels = dict(zip("qkv", np.split(qkv, 3, axis=-1)))
    kernels["out"] = keras.ops.convert_to_numpy(block.attention.out.kernel)
    for name, kernel in kernels.items():
        want = _xavier_uniform_std(width, width)
        assert np.std(kernel) == pytest.approx(want, rel=0.02), name
        limit = math.sqrt(6.0 / (2 * width))
        assert limit * 0.99 < np.abs(kernel).max() <= limit, name
    assert not np.allclose(kernels["q"], kernels["k"]) and not np.allclose(kernels["k"], kernels["v"])
    for name, fans in (("fc1", (width, 4 * width)), ("fc2", (4 * width, width))):
        kernel = keras.ops.convert_to_numpy(getattr(block.mlp, name).kernel)
        assert np.std(kernel) == pytest.approx(_xavier_uniform_std(*fans), rel=0.02), name
        bias = keras.ops.convert_to_numpy(getattr(block.mlp, name).bias)
        assert 0 < np.std(bias) < 3e-6, name  # N(0, 1e-6)


def test_conv_stem_starts_as_pycls_builds_it():
    """3x3 convs at PyTorch's Conv2d default, U(+-1/sqrt(fan_in)); the final 1x1 conv
    N(0, sqrt(2/width)) (pycls's ViTStemConv)."""
    from keras_vitnorm.layers import PatchStem

    keras.utils.set_random_seed(3)
    width = 256
    stem = PatchStem(patch_size=8, width=width, stem="conv")
    stem.build((None, 64, 64, 3))
    convs = [layer for layer in stem.conv_layers if layer.name.startswith("conv") and
             layer.name[4:].isdigit()]
    assert len(convs) == 3
    for layer in convs:
        kernel = keras.ops.convert_to_numpy(layer.kernel)
        limit = 1.0 / math.sqrt(np.prod(kernel.shape[:3]))
        assert limit * 0.95 < np.abs(kernel).max() <= limit, layer.name
        assert np.std(kernel) == pytest.approx(limit / math.sqrt(3), rel=0.1), layer.name
    projection = keras.ops.convert_to_numpy(stem.projection.kernel)
    assert np.std(projection) == pytest.approx(math.sqrt(2.0 / width), rel=0.05)


# --- Init scaling of DeepNorm and Sub-LN ---------------------------------------------

INIT_WIDTH, INIT_DEPTH = 128, 12


def _init_kernels(block_style, placement):
    """Initial kernels of a freshly built block (fixed seed), the qkv kernel split in thirds."""
    keras.utils.set_random_seed(1234)
    block = EncoderBlock(
        4,
        2 * INIT_WIDTH,
        INIT_DEPTH,
        attn_norm=placement,
        mlp_norm=placement,
        block_style=block_style,
    )
    block.build((None, TOKENS, INIT_WIDTH))
    kernels = {
        variable.path.split("/", 1)[1]: keras.ops.convert_to_numpy(variable)
        for variable in block.weights
        if variable.name == "kernel"
    }
    q, k, v = np.split(kernels.pop("attention/qkv/kernel"), 3, axis=-1)
    return {"q": q, "k": k, "v": v, **kernels}


@pytest.mark.parametrize(
    "block_style, placement, factor",
    [
        ("deepnorm", "post", (8.0 * INIT_DEPTH) ** -0.25),
        ("sub_ln", "pre", math.sqrt(math.log(2.0 * INIT_DEPTH))),
    ],
    ids=["deepnorm", "sub_ln"],
)
def test_init_scaling_of_value_out_and_mlp_kernels(block_style, placement, factor):
    standard = _init_kernels("standard", "pre")
    scaled = _init_kernels(block_style, placement)
    expected = {
        "q": 1.0,
        "k": 1.0,
        "v": factor,
        "attention/out/kernel": factor,
        "mlp/fc1/kernel": factor,
        "mlp/fc2/kernel": factor,
    }
    assert sorted(scaled) == sorted(expected)
    for key, want in expected.items():
        ratio = np.std(scaled[key]) / np.std(standard[key])
        message = f"{key}: std ratio {ratio:.4f}, want {want:.4f}"
        assert ratio == pytest.approx(want, rel=0.1), message
    # Against the reference formula, not only the standard block: the value kernel is
    # the gain times Xavier-uniform on (width, width).
    want = factor * _xavier_uniform_std(INIT_WIDTH, INIT_WIDTH)
    assert np.std(scaled["v"]) == pytest.approx(want, rel=0.05)


# --- Patch stem ----------------------------------------------------------------------

IMAGE_SHAPE, PATCH = (BATCH, 12, 8, 3), 4


@pytest.mark.parametrize(
    "stem, stem_norm, learnable, class_token",
    [
        ("patch", None, True, True),
        ("dual_patchnorm", None, True, True),
        ("pre_patchnorm", None, True, True),
        ("post_patchnorm", None, True, True),
        ("post_posemb", None, True, True),
        ("post_posemb", None, True, False),
        ("dual_patchnorm", None, False, True),
        ("dual_patchnorm", "rmsnorm", True, True),
        ("dual_patchnorm", "rmsnorm", False, True),
        ("dual_patchnorm", "batchnorm", True, True),
        ("dual_patchnorm", "groupnorm", True, True),
        ("dual_patchnorm", "dyt", True, True),
        ("dual_patchnorm", "affine", True, True),
        ("dual_patchnorm", "identity", True, True),
    ],
)
def test_patch_stem_matches_formula(stem, stem_norm, learnable, class_token):
    images = random_input(IMAGE_SHAPE)
    layer = PatchStem(
        PATCH,
        WIDTH,
        stem=stem,
        stem_norm=stem_norm,
        stem_norm_learnable=learnable,
        norm_epsilon=EPSILON,
        norm_groups=GROUPS,
        class_token=class_token,
    )
    weights = build_and_randomize(layer, IMAGE_SHAPE)
    expected = ref.patch_stem(
        images,
        weights,
        PATCH,
        stem=stem,
        stem_norm=stem_norm or "layernorm",
        epsilon=EPSILON,
        groups=GROUPS,
    )
    assert_matches(layer(images, training=False), expected)


def test_patchify_order_is_row_column_channel():
    images = np.arange(np.prod(IMAGE_SHAPE), dtype="float32").reshape(IMAGE_SHAPE)
    patch_dim = PATCH * PATCH * IMAGE_SHAPE[-1]
    layer = PatchStem(PATCH, patch_dim, class_token=False, position_embedding=False)
    layer.build(IMAGE_SHAPE)
    layer.projection.kernel.assign(np.eye(patch_dim, dtype="float32"))
    layer.projection.bias.assign(np.zeros((patch_dim,), "float32"))
    assert_matches(layer(images), ref.patchify(images, PATCH))
