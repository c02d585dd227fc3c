"""The residual wrappers of a transformer block: one per norm placement.

Each wraps one sublayer `F` (attention or MLP) on the residual stream as its
placement says, with `N` a norm, `S` the optional LayerScale and `D` stochastic depth;
`EncoderBlock` builds one per sublayer. They are plain Python, not Keras layers: the
layers they call belong to the block, under the block's names and weight paths.
"""

from keras import ops

from keras_vitnorm.ops import residual_fence


class Sublayer:
    """`F`: the layers of one sublayer, applied in order (`None`s left out).

    The attention sublayer is the attention alone, or for NormFormer the attention, its
    output norm and the dropout after that norm; the MLP sublayer is the MLP.
    """

    def __init__(self, *layers):
        self.layers = [layer for layer in layers if layer is not None]

    def __call__(self, h, training=None):
        for layer in self.layers:
            h = layer(h, training=training)
        return h


class Residual:
    """`x + D(S(F(x)))`: the `none` placement, and the base of the others.

    `F` is the sublayer, `S` the LayerScale and `D` stochastic depth, each left out when
    `None` (a drop-path rate of 0 calls no layer).
    """

    def __init__(self, sublayer, scale=None, drop_path=None):
        self.sublayer = sublayer
        self.scale = scale
        self.drop_path = drop_path

    def branch(self, h, training):
        """`D(S(h))`."""
        if self.scale is not None:
            h = self.scale(h, training=training)
        if self.drop_path is not None:
            h = self.drop_path(h, training=training)
        return h

    def __call__(self, x, training=None):
        return residual_fence(x + self.branch(self.sublayer(x, training), training))


class PreNormResidual(Residual):
    """`x + D(S(F(N(x))))`: the `pre` placement (pre-LN)."""

    def __init__(self, sublayer, norm, scale=None, drop_path=None):
        super().__init__(sublayer, scale, drop_path)
        self.norm = norm

    def __call__(self, x, training=None):
        h = self.sublayer(self.norm(x, training=training), training)
        return residual_fence(x + self.branch(h, training))


class PrePostNormResidual(Residual):
    """`x + D(S(N2(F(N1(x)))))`: the `pre_post` placement."""

    def __init__(self, sublayer, norm, post_norm, scale=None, drop_path=None):
        super().__init__(sublayer, scale, drop_path)
        self.norm = norm
        self.post_norm = post_norm

    def __call__(self, x, training=None):
        h = self.sublayer(self.norm(x, training=training), training)
        h = self.post_norm(h, training=training)
        return residual_fence(x + self.branch(h, training))


class PostNormResidual(Residual):
    """`N(alpha * x + D(S(F(x))))`: the `post` placement (post-LN with `alpha = 1`,
    DeepNorm with `alpha = (2N)^(1/4)`)."""

    def __init__(self, sublayer, norm, alpha=1.0, scale=None, drop_path=None):
        super().__init__(sublayer, scale, drop_path)
        self.norm = norm
        self.alpha = alpha

    def __call__(self, x, training=None):
        h = self.branch(self.sublayer(x, training), training)
        residual = x if self.alpha == 1.0 else x * ops.cast(self.alpha, x.dtype)
        return residual_fence(self.norm(residual + h, training=training))
