"""The transformer encoder block with configurable norm placement and block style."""

import math

import keras
from keras import ops

from keras_vitnorm.choices import BLOCK_STYLES
from keras_vitnorm.choices import PLACEMENTS
from keras_vitnorm.validation import check_bool
from keras_vitnorm.validation import check_choice
from keras_vitnorm.validation import check_positive_float
from keras_vitnorm.validation import check_positive_int
from keras_vitnorm.validation import check_rate
from keras_vitnorm.layers.attention import MultiHeadSelfAttention
from keras_vitnorm.layers.mlp import MLP
from keras_vitnorm.layers.normalization import check_norm
from keras_vitnorm.layers.normalization import make_norm
from keras_vitnorm.ops import residual_fence


def default_placements(block_style):
    """`(attn_norm, mlp_norm)` of `block_style`: post-LN for DeepNorm (torchscale), else pre-LN."""
    check_choice("block_style", block_style, BLOCK_STYLES)
    return ("post", "post") if block_style == "deepnorm" else ("pre", "pre")


def resolve_placements(block_style, attn_norm=None, mlp_norm=None):
    """`(attn_norm, mlp_norm)` with `None` replaced by the block style's default (checked)."""
    default_attn, default_mlp = default_placements(block_style)
    attn_norm = default_attn if attn_norm is None else attn_norm
    mlp_norm = default_mlp if mlp_norm is None else mlp_norm
    check_choice("attn_norm", attn_norm, PLACEMENTS)
    check_choice("mlp_norm", mlp_norm, PLACEMENTS)
    if block_style == "deepnorm" and (attn_norm, mlp_norm) != ("post", "post"):
        raise ValueError(
            "block_style='deepnorm' is post-LN with an up-weighted residual, so it "
            "needs attn_norm='post' and mlp_norm='post' (their default for this style); "
            f"got attn_norm={attn_norm!r}, mlp_norm={mlp_norm!r}.")
    return attn_norm, mlp_norm


def deepnorm_alpha(num_layers):
    """DeepNorm residual weight for an N-block encoder: `(2N) ** (1/4)`."""
    return (2.0 * num_layers) ** 0.25


def deepnorm_beta(num_layers):
    """DeepNorm init gain for an N-block encoder: `(8N) ** (-1/4)`."""
    return (8.0 * num_layers) ** -0.25


def sub_ln_gamma(num_layers):
    """Sub-LN (Magneto) init gain for an N-block encoder: `sqrt(log(2N))`."""
    return math.sqrt(math.log(2.0 * num_layers))


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class LayerScale(keras.layers.Layer):
    """Per-channel learnable scale `gamma * x`, `gamma` initialized to `init_value`.

    Example:
    >>> y = LayerScale(1e-4)(keras.random.normal((2, 5, 8)))

    Reference:
    - [Touvron et al., CaiT, 2021](https://arxiv.org/abs/2103.17239)
    """

    def __init__(self, init_value, **kwargs):
        super().__init__(**kwargs)
        check_positive_float("init_value", init_value)
        self.init_value = init_value

    def build(self, input_shape):
        self.gamma = self.add_weight(name="gamma", shape=(input_shape[-1],),
                                     initializer=keras.initializers.Constant(self.init_value))

    def call(self, x):
        return x * ops.cast(self.gamma, x.dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "init_value": self.init_value}


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class EncoderBlock(keras.layers.Layer):
    """One transformer block: attention sublayer, then MLP sublayer.

    Each sublayer joins the residual stream as its placement says; `block_style` adds NormFormer,
    Sub-LN or DeepNorm on top (placements, styles and init gains: docs/normalization.md).

    Args:
        num_heads: int.
        mlp_dim: int. MLP hidden width.
        num_layers: int. Encoder depth `N`, for the `deepnorm` and `sub_ln` constants.
        norm: str, default `"layernorm"`. One of `NORM_TYPES` or a `register_norm` name.
        norm_epsilon: float, default `1e-6`; norm_groups: int, default `32` (`groupnorm`).
        attn_norm, mlp_norm: str or None, default `None`: the block style's placement
            (`"post"` for `deepnorm`, `"pre"` otherwise).
        block_style: str, default `"standard"`. One of `BLOCK_STYLES`.
        layer_scale: float or None, default `None`. LayerScale init value.
        qk_norm: bool, default `False`. Norm on q and k per head and token; refused with
            `batchnorm` and `groupnorm`, whose statistics would span heads or tokens.
        qkv_bias: bool, default `True`.
        drop_path_rate: float, default `0.0`. Stochastic depth rate of this block.
        dropout: float, default `0.0`.
        weight_standardization: bool, default `False`. Not with `deepnorm` or `sub_ln`.
        **kwargs: base layer keyword arguments.

    Example:
    >>> block = EncoderBlock(num_heads=4, mlp_dim=128, num_layers=12, attn_norm="post")
    >>> y = block(keras.random.normal((2, 17, 32)))

    Reference:
    - [Xiong et al., On Layer Normalization in the Transformer, 2020](
      https://arxiv.org/abs/2002.04745)
    - [Wang et al., DeepNet, 2022](https://arxiv.org/abs/2203.00555)
    """

    #: The constructor arguments, in `get_config`'s order.
    CONFIG_KEYS = ("num_heads", "mlp_dim", "num_layers", "norm", "norm_epsilon", "norm_groups",
                   "attn_norm", "mlp_norm", "block_style", "layer_scale", "qk_norm", "qkv_bias",
                   "drop_path_rate", "dropout", "weight_standardization")

    def __init__(self, num_heads, mlp_dim, num_layers, norm="layernorm", norm_epsilon=1e-6,
                 norm_groups=32, attn_norm=None, mlp_norm=None, block_style="standard",
                 layer_scale=None, qk_norm=False, qkv_bias=True, drop_path_rate=0.0, dropout=0.0,
                 weight_standardization=False, **kwargs):
        super().__init__(**kwargs)
        arguments = {key: value for key, value in locals().items() if key in self.CONFIG_KEYS}
        self.resolved_attn_norm, self.resolved_mlp_norm = self.check_arguments(**arguments)
        for key, value in arguments.items():
            setattr(self, key, value)

    @staticmethod
    def check_arguments(num_heads, mlp_dim, num_layers, norm, norm_epsilon, norm_groups, attn_norm,
                        mlp_norm, block_style, layer_scale, qk_norm, qkv_bias, drop_path_rate,
                        dropout, weight_standardization):
        """`(attn_norm, mlp_norm)` resolved; a `ValueError` naming the first bad argument."""
        check_positive_int("mlp_dim", mlp_dim)
        check_positive_int("num_layers", num_layers)
        check_norm("norm", norm)
        placements = resolve_placements(block_style, attn_norm, mlp_norm)
        if layer_scale is not None:
            check_positive_float("layer_scale", layer_scale)
        check_bool("qk_norm", qk_norm)
        check_rate("drop_path_rate", drop_path_rate)
        shared = dict(norm_epsilon=norm_epsilon, norm_groups=norm_groups, dropout=dropout,
                      weight_standardization=weight_standardization)
        MultiHeadSelfAttention.check_arguments(
            num_heads, qkv_bias, norm if qk_norm else None, **shared)
        MLP.check_arguments(mlp_dim, **shared)
        if weight_standardization and block_style in ("deepnorm", "sub_ln"):
            raise ValueError(
                f"weight_standardization=True cannot be combined with block_style={block_style!r}: "
                "its initial weight scaling would be standardized away. Use another block "
                "style or weight_standardization=False.")
        return placements

    def _norm(self, name, shape):
        layer = make_norm(self.norm, epsilon=self.norm_epsilon, groups=self.norm_groups,
                          name=name, dtype=self.dtype_policy)
        layer.build(shape)
        return layer

    def _placement_norms(self, prefix, placement, shape):
        """`(N, N2)` of a placement: `N` unless `none`, `N2` for `pre_post` only."""
        first = None if placement == "none" else self._norm(f"{prefix}_norm", shape)
        second = self._norm(f"{prefix}_post_norm", shape) if placement == "pre_post" else None
        return first, second

    def build(self, input_shape):
        width = input_shape[-1]
        if self.norm == "groupnorm" and width % self.norm_groups:
            raise ValueError(
                f"norm='groupnorm' needs width divisible by norm_groups; got "
                f"width={width}, norm_groups={self.norm_groups}.")
        style = self.block_style
        normformer = style == "normformer"
        init_scale = {"deepnorm": deepnorm_beta, "sub_ln": sub_ln_gamma}.get(
            style, lambda num_layers: 1.0)(self.num_layers)
        shared = dict(norm_epsilon=self.norm_epsilon, norm_groups=self.norm_groups,
                      init_scale=init_scale, weight_standardization=self.weight_standardization,
                      dtype=self.dtype_policy)
        self.attention = MultiHeadSelfAttention(
            self.num_heads, qkv_bias=self.qkv_bias, qk_norm=self.norm if self.qk_norm else None,
            head_scale=normformer, inner_norm=self.norm if style == "sub_ln" else None,
            # NormFormer's dropout comes after its attention-output norm (fairseq's order).
            dropout=0.0 if normformer else self.dropout, name="attention", **shared)
        self.attention.build(input_shape)
        mid_norm = self.norm if style in ("normformer", "sub_ln") else None
        self.mlp = MLP(self.mlp_dim, mid_norm=mid_norm, dropout=self.dropout, name="mlp", **shared)
        self.mlp.build(input_shape)
        self.attn_out_norm = self._norm("attn_out_norm", input_shape) if normformer else None
        self.attn_out_dropout = keras.layers.Dropout(
            self.dropout, name="attn_out_dropout", dtype=self.dtype_policy) if normformer else None
        self.attn_norms = self._placement_norms("attn", self.resolved_attn_norm, input_shape)
        self.mlp_norms = self._placement_norms("mlp", self.resolved_mlp_norm, input_shape)
        self.attn_scale = self.mlp_scale = None
        if self.layer_scale is not None:
            self.attn_scale = LayerScale(self.layer_scale, name="attn_scale",
                                         dtype=self.dtype_policy)
            self.mlp_scale = LayerScale(self.layer_scale, name="mlp_scale", dtype=self.dtype_policy)
            self.attn_scale.build(input_shape)
            self.mlp_scale.build(input_shape)
        # Stochastic depth: drop the whole residual branch per sample.
        self.drop_path = keras.layers.Dropout(self.drop_path_rate, noise_shape=(None, 1, 1),
                                              name="drop_path", dtype=self.dtype_policy)

    def call(self, x, training=None):
        x = residual_fence(self._residual(
            x, self._attention_sublayer, self.resolved_attn_norm, self.attn_norms,
            self.attn_scale, training))
        return residual_fence(self._residual(
            x, self.mlp, self.resolved_mlp_norm, self.mlp_norms, self.mlp_scale, training))

    def _attention_sublayer(self, h, training=None):
        """The attention, and for NormFormer its output norm and then the dropout."""
        h = self.attention(h, training=training)
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h, training=training)
            if self.dropout:
                h = self.attn_out_dropout(h, training=training)
        return h

    def _residual(self, x, sublayer, placement, norms, scale, training):
        """One sublayer `F` on the residual stream as its placement writes it."""
        norm, post_norm = norms

        def branch(h):  # D(S(h)); no LayerScale or a drop-path rate of 0 calls no layer
            if scale is not None:
                h = scale(h, training=training)
            return self.drop_path(h, training=training) if self.drop_path_rate else h

        if placement == "pre":
            return x + branch(sublayer(norm(x, training=training), training=training))
        if placement == "pre_post":
            h = sublayer(norm(x, training=training), training=training)
            return x + branch(post_norm(h, training=training))
        if placement == "post":
            alpha = deepnorm_alpha(self.num_layers) if self.block_style == "deepnorm" else 1.0
            residual = x if alpha == 1.0 else x * ops.cast(alpha, x.dtype)
            return norm(residual + branch(sublayer(x, training=training)), training=training)
        return x + branch(sublayer(x, training=training))  # "none"

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), **{key: getattr(self, key) for key in self.CONFIG_KEYS}}
