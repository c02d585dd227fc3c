"""Independent float64 NumPy implementation of the formulas the layers implement.

Written from the formulas and papers cited in docs/normalization.md, not from the
layer code, so that `test_formulas.py` can check each Keras layer against the
formula it claims to compute.

Weights are passed as nested dicts that mirror the Keras variable paths below the
layer (`{"attention": {"qkv": {"kernel": ..., "bias": ...}}, ...}`), with the leaf
names Keras uses: `gamma`/`beta` (LayerNorm, BatchNorm, GroupNorm, DyT, affine,
LayerScale), `scale` (RMSNorm), `alpha` (DyT), `moving_mean`/`moving_variance`
(BatchNorm), `kernel`/`bias` (Dense). A norm without learnable weights is given an
empty dict (or no entry at all).
"""

import math

import numpy as np

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _affine_or_none(y, gamma=None, beta=None):
    if gamma is not None:
        y = y * _f64(gamma)
    if beta is not None:
        y = y + _f64(beta)
    return y


def layer_norm(x, gamma=None, beta=None, epsilon=1e-6):
    """LayerNorm over the last axis: `(x - mean) / sqrt(var + eps) * gamma + beta`.

    Args:
        x: array of any rank; statistics are per position over the last axis.
        gamma: array `(channels,)` or None (no scale).
        beta: array `(channels,)` or None (no shift).
        epsilon: float, default `1e-6`.
    """
    x = _f64(x)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return _affine_or_none((x - mean) / np.sqrt(var + epsilon), gamma, beta)


def rms_norm(x, scale=None, epsilon=1e-6):
    """RMSNorm over the last axis: `x / sqrt(mean(x**2) + eps) * scale`, no centering.

    Args:
        x: array of any rank.
        scale: array `(channels,)` or None (standardize only).
        epsilon: float, default `1e-6`, added inside the square root.
    """
    x = _f64(x)
    y = x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + epsilon)
    return _affine_or_none(y, scale)


def dyt(x, alpha, gamma=None, beta=None):
    """Dynamic Tanh: `gamma * tanh(alpha * x) + beta`, `alpha` a scalar.

    Args:
        x: array of any rank.
        alpha: scalar.
        gamma: array `(channels,)` or None.
        beta: array `(channels,)` or None.
    """
    return _affine_or_none(np.tanh(float(alpha) * _f64(x)), gamma, beta)


def affine(x, gamma, beta):
    """Per-channel scale and shift with no standardization: `gamma * x + beta`."""
    return _f64(x) * _f64(gamma) + _f64(beta)


def batch_norm_statistics(x):
    """Per-channel mean and biased variance over every axis but the last.

    For `(batch, tokens, channels)` inputs these are the statistics over
    batch x tokens that BatchNorm uses in training mode.

    Returns:
        Tuple `(mean, variance)`, each of shape `(channels,)`.
    """
    x = _f64(x)
    axes = tuple(range(x.ndim - 1))
    mean = x.mean(axis=axes)
    return mean, ((x - mean) ** 2).mean(axis=axes)


def batch_norm_inference(x, moving_mean, moving_variance, gamma=None, beta=None, epsilon=1e-6):
    """BatchNorm in inference mode: `(x - moving_mean) / sqrt(moving_var + eps) * gamma + beta`.

    Args:
        x: array `(..., channels)`.
        moving_mean: array `(channels,)`.
        moving_variance: array `(channels,)`.
        gamma: array `(channels,)` or None.
        beta: array `(channels,)` or None.
        epsilon: float, default `1e-6`.
    """
    y = (_f64(x) - _f64(moving_mean)) / np.sqrt(_f64(moving_variance) + epsilon)
    return _affine_or_none(y, gamma, beta)


def batch_norm_training(x, gamma=None, beta=None, epsilon=1e-6):
    """BatchNorm in training mode: standardizes with the statistics of `x` itself.

    The statistics are per channel over every other axis (batch x tokens for
    `(batch, tokens, channels)`), see `batch_norm_statistics`.

    Args:
        x: array `(..., channels)`.
        gamma: array `(channels,)` or None.
        beta: array `(channels,)` or None.
        epsilon: float, default `1e-6`.
    """
    mean, var = batch_norm_statistics(x)
    return batch_norm_inference(x, mean, var, gamma, beta, epsilon)


def group_norm(x, groups, gamma=None, beta=None, epsilon=1e-6):
    """GroupNorm with channels last (Keras `GroupNormalization(axis=-1)` semantics).

    Per sample, the channels are split into `groups` contiguous groups; each group
    is standardized with the mean and variance over all its channels and all
    non-batch positions (for `(batch, tokens, channels)`: tokens x group channels).

    Args:
        x: array `(batch, ..., channels)`, channels divisible by `groups`.
        groups: int.
        gamma: array `(channels,)` or None.
        beta: array `(channels,)` or None.
        epsilon: float, default `1e-6`.
    """
    x = _f64(x)
    channels = x.shape[-1]
    size = channels // groups
    y = np.empty_like(x)
    for sample in range(x.shape[0]):
        for group in range(groups):
            block = x[sample, ..., group * size : (group + 1) * size]
            y[sample, ..., group * size : (group + 1) * size] = (block - block.mean()) / np.sqrt(
                block.var() + epsilon
            )
    return _affine_or_none(y, gamma, beta)


def norm(kind, x, weights=None, epsilon=1e-6, groups=32, training=False):
    """Applies the norm named `kind` (a `norm`/`stem_norm` string) with Keras leaf names.

    Args:
        kind: str, one of `"layernorm"`, `"rmsnorm"`, `"batchnorm"`, `"groupnorm"`,
            `"dyt"`, `"affine"`, `"identity"`.
        x: array.
        weights: dict of the layer's weights by leaf name, or None if it has none.
        epsilon: float, default `1e-6`.
        groups: int, default `32`, for `"groupnorm"`.
        training: bool, default `False`. BatchNorm uses batch statistics if True,
            moving statistics otherwise.
    """
    weights = weights or {}
    gamma, beta = weights.get("gamma"), weights.get("beta")
    if kind == "layernorm":
        return layer_norm(x, gamma, beta, epsilon)
    if kind == "rmsnorm":
        return rms_norm(x, weights.get("scale"), epsilon)
    if kind == "batchnorm":
        if training:
            return batch_norm_training(x, gamma, beta, epsilon)
        return batch_norm_inference(
            x, weights["moving_mean"], weights["moving_variance"], gamma, beta, epsilon
        )
    if kind == "groupnorm":
        return group_norm(x, groups, gamma, beta, epsilon)
    if kind == "dyt":
        return dyt(x, weights["alpha"], gamma, beta)
    if kind == "affine":
        return affine(x, gamma, beta)
    if kind == "identity":
        return _f64(x)
    raise ValueError(f"Unknown norm kind {kind!r}.")


def gelu(x):
    """Exact GELU: `0.5 * x * (1 + erf(x / sqrt(2)))`."""
    x = _f64(x)
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def dense(x, weights):
    """`x @ kernel + bias` (bias optional) with `weights = {"kernel": ..., "bias": ...}`."""
    y = _f64(x) @ _f64(weights["kernel"])
    if "bias" in weights:
        y = y + _f64(weights["bias"])
    return y


def softmax(x, axis=-1):
    """Numerically stable softmax along `axis`."""
    x = _f64(x)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def multi_head_self_attention(
    x,
    weights,
    num_heads,
    qk_norm=None,
    head_scale=False,
    inner_norm=None,
    epsilon=1e-6,
    groups=32,
    training=False,
):
    """Multi-head self-attention with a fused `[q | k | v]` projection.

    The `qkv` kernel has shape `(width, 3 * width)`; in each third, head `h` owns
    columns `h * head_dim : (h + 1) * head_dim`. Per head:
    `o_h = softmax(N(q_h) N(k_h)^T / sqrt(head_dim)) v_h`, with the optional qk norm
    `N` over `head_dim` (one set of weights shared by all heads, applied before the
    scaling), times the optional per-head gain `head_scale[h, 0]` (NormFormer, paper
    form). The heads are concatenated in order, optionally normalized over the width
    (Sub-LN inner norm), and projected by `out`.

    Args:
        x: array `(batch, tokens, width)`.
        weights: dict with `qkv`, `out`, and as configured `q_norm`, `k_norm`,
            `head_scale` (array `(num_heads, 1)`), `inner_norm`.
        num_heads: int.
        qk_norm: str or None. A per-token norm type (`"layernorm"`, `"rmsnorm"`,
            `"dyt"`, ...) for q and k.
        head_scale: bool, default `False`.
        inner_norm: str or None. Norm type on the concatenated heads.
        epsilon: float, default `1e-6`.
        groups: int, default `32`, for `"groupnorm"`.
        training: bool, default `False`, for `"batchnorm"`.
    """
    x = _f64(x)
    width = x.shape[-1]
    head_dim = width // num_heads
    qkv = dense(x, weights["qkv"])
    q_all, k_all, v_all = (qkv[..., i * width : (i + 1) * width] for i in range(3))
    heads = []
    for h in range(num_heads):
        columns = slice(h * head_dim, (h + 1) * head_dim)
        q, k, v = q_all[..., columns], k_all[..., columns], v_all[..., columns]
        if qk_norm is not None:
            q = norm(qk_norm, q, weights.get("q_norm"), epsilon, groups, training)
            k = norm(qk_norm, k, weights.get("k_norm"), epsilon, groups, training)
        logits = q @ np.swapaxes(k, -1, -2) / math.sqrt(head_dim)
        o = softmax(logits) @ v
        if head_scale:
            o = o * float(_f64(weights["head_scale"])[h, 0])
        heads.append(o)
    y = np.concatenate(heads, axis=-1)
    if inner_norm is not None:
        y = norm(inner_norm, y, weights.get("inner_norm"), epsilon, groups, training)
    return dense(y, weights["out"])


def mlp(x, weights, mid_norm=None, epsilon=1e-6, groups=32, training=False):
    """Transformer MLP: `fc2(N(gelu(fc1(x))))`, `N` the optional mid norm.

    Args:
        x: array `(batch, tokens, width)`.
        weights: dict with `fc1`, `fc2` and, if `mid_norm`, `mid_norm`.
        mid_norm: str or None. Norm type after the activation, before `fc2`.
        epsilon: float, default `1e-6`.
        groups: int, default `32`, for `"groupnorm"`.
        training: bool, default `False`, for `"batchnorm"`.
    """
    h = gelu(dense(x, weights["fc1"]))
    if mid_norm is not None:
        h = norm(mid_norm, h, weights.get("mid_norm"), epsilon, groups, training)
    return dense(h, weights["fc2"])


def encoder_block(
    x,
    weights,
    num_heads,
    num_layers,
    norm_type="layernorm",
    attn_norm="pre",
    mlp_norm="pre",
    block_style="standard",
    qk_norm=False,
    layer_scale=False,
    epsilon=1e-6,
    groups=32,
    training=False,
):
    """One transformer block: attention sublayer, then MLP sublayer.

    Each sublayer `F` with placement:

    * `pre`: `x + S(F(N(x)))`
    * `post`: `N(alpha * x + S(F(x)))`
    * `pre_post`: `x + S(N2(F(N1(x))))`
    * `none`: `x + S(F(x))`

    where `S` is the optional LayerScale (`gamma * h`). `alpha = (2L)^(1/4)` for
    `block_style="deepnorm"` (L = `num_layers`) and 1 otherwise. `normformer` adds
    per-head gains, a norm on the attention output after the out projection, and
    the MLP mid norm; `sub_ln` adds the inner attention norm (before the out
    projection) and the MLP mid norm. All extra norms are of type `norm_type`.

    Args:
        x: array `(batch, tokens, width)`.
        weights: dict with `attention`, `mlp`, and as configured `attn_norm`,
            `attn_post_norm`, `attn_out_norm`, `mlp_norm`, `mlp_post_norm`,
            `attn_scale`, `mlp_scale`.
        num_heads: int.
        num_layers: int. Encoder depth, for the DeepNorm `alpha`.
        norm_type: str, default `"layernorm"`.
        attn_norm: str, default `"pre"`. Attention placement.
        mlp_norm: str, default `"pre"`. MLP placement.
        block_style: str, default `"standard"`.
        qk_norm: bool, default `False`. Norm of type `norm_type` on q and k.
        layer_scale: bool, default `False`. Whether LayerScale weights are applied.
        epsilon: float, default `1e-6`.
        groups: int, default `32`, for `"groupnorm"`.
        training: bool, default `False`, for `"batchnorm"`.
    """
    alpha = (2.0 * num_layers) ** 0.25 if block_style == "deepnorm" else 1.0
    extra_norm = norm_type if block_style in ("normformer", "sub_ln") else None

    def apply_norm(name, h):
        return norm(norm_type, h, weights.get(name), epsilon, groups, training)

    def attention(h):
        h = multi_head_self_attention(
            h,
            weights["attention"],
            num_heads,
            qk_norm=norm_type if qk_norm else None,
            head_scale=block_style == "normformer",
            inner_norm=extra_norm if block_style == "sub_ln" else None,
            epsilon=epsilon,
            groups=groups,
            training=training,
        )
        if block_style == "normformer":
            h = apply_norm("attn_out_norm", h)
        return h

    def feed_forward(h):
        return mlp(h, weights["mlp"], extra_norm, epsilon, groups, training)

    def sublayer(x, branch, prefix, placement):
        if placement in ("pre", "pre_post"):
            h = branch(apply_norm(f"{prefix}_norm", x))
        else:
            h = branch(x)
        if placement == "pre_post":
            h = apply_norm(f"{prefix}_post_norm", h)
        if layer_scale:
            h = h * _f64(weights[f"{prefix}_scale"]["gamma"])
        if placement == "post":
            return apply_norm(f"{prefix}_norm", alpha * x + h)
        return x + h

    x = sublayer(_f64(x), attention, "attn", attn_norm)
    return sublayer(x, feed_forward, "mlp", mlp_norm)


def patchify(images, patch_size):
    """Cuts `(batch, H, W, C)` images into `(batch, H/P * W/P, P*P*C)` patch vectors.

    Patches are taken row by row over the grid; each `(P, P, C)` patch is
    flattened in `(row, column, channel)` order.
    """
    images = _f64(images)
    batch, height, width, _ = images.shape
    patches = []
    for top in range(0, height, patch_size):
        for left in range(0, width, patch_size):
            patch = images[:, top : top + patch_size, left : left + patch_size, :]
            patches.append(patch.reshape(batch, -1))
    return np.stack(patches, axis=1)


def patch_stem(
    images,
    weights,
    patch_size,
    stem="patch",
    stem_norm="layernorm",
    epsilon=1e-6,
    groups=32,
    training=False,
):
    """Patch-embedding stem with the Dual PatchNorm variants.

    * `patch`: `Dense(patches)`
    * `dual_patchnorm`: `N1(Dense(N0(patches)))`
    * `pre_patchnorm`: `Dense(N0(patches))`
    * `post_patchnorm`: `N1(Dense(patches))`
    * `post_posemb`: `N1(Dense(patches) (+cls) + posemb)`

    `N0` normalizes each `P*P*C` patch vector and `N1` the width. Then (except for
    `post_posemb`, where `N1` comes last) the class token is prepended and the
    position embedding added, each only if present in `weights`.

    Args:
        images: array `(batch, H, W, C)`.
        weights: dict with `projection`, and as configured `patch_norm`,
            `embedding_norm`, `class_token` `(1, 1, width)`,
            `position_embedding` `(1, tokens, width)`.
        patch_size: int.
        stem: str, default `"patch"`.
        stem_norm: str, default `"layernorm"`. Norm type of `N0` and `N1`.
        epsilon: float, default `1e-6`.
        groups: int, default `32`, for `"groupnorm"`.
        training: bool, default `False`, for `"batchnorm"`.
    """

    def apply_norm(name, h):
        return norm(stem_norm, h, weights.get(name), epsilon, groups, training)

    x = patchify(images, patch_size)
    if stem in ("dual_patchnorm", "pre_patchnorm"):
        x = apply_norm("patch_norm", x)
    x = dense(x, weights["projection"])
    if stem in ("dual_patchnorm", "post_patchnorm"):
        x = apply_norm("embedding_norm", x)
    if "class_token" in weights:
        cls = np.broadcast_to(_f64(weights["class_token"]), (x.shape[0], 1, x.shape[2]))
        x = np.concatenate([cls, x], axis=1)
    if "position_embedding" in weights:
        x = x + _f64(weights["position_embedding"])
    if stem == "post_posemb":
        x = apply_norm("embedding_norm", x)
    return x
