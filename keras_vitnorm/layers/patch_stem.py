"""The ViT stem: image to token sequence, with every Dual PatchNorm variant."""

import math

import keras
from keras import ops

from keras_vitnorm.choices import STEM_TYPES
from keras_vitnorm.validation import check_bool
from keras_vitnorm.validation import check_choice
from keras_vitnorm.validation import check_positive_int
from keras_vitnorm.layers.dense import FusedDense
from keras_vitnorm.layers.dense import StandardizedConv2D
from keras_vitnorm.layers.normalization import BATCHNORM_MOMENTUM
from keras_vitnorm.layers.normalization import BatchNorm
from keras_vitnorm.layers.normalization import check_norm
from keras_vitnorm.layers.normalization import check_norm_options
from keras_vitnorm.layers.normalization import make_norm

_USES_PRE_NORM = ("dual_patchnorm", "pre_patchnorm")
_USES_POST_NORM = ("dual_patchnorm", "post_patchnorm")
# pycls (Xiao et al.) BatchNorm epsilon for the convolutional stem.
_CONV_STEM_BN_EPSILON = 1e-5


def patchify(images, patch_size):
    """`(batch, H, W, C)` images to `(batch, H/P * W/P, P*P*C)` row-major patch vectors.

    Each patch flattens in `(row, column, channel)` order, so a `(P, P, C, D)` Conv2D kernel
    reshaped to `(P*P*C, D)` is the `Dense` kernel.
    """
    _, height, width, channels = images.shape
    grid_h, grid_w = height // patch_size, width // patch_size
    x = ops.reshape(images, (-1, grid_h, patch_size, grid_w, patch_size, channels))
    x = ops.transpose(x, (0, 1, 3, 2, 4, 5))
    return ops.reshape(x, (-1, grid_h * grid_w, patch_size * patch_size * channels))


def image_shape_hint(found, expected):
    """`""`, or a hint (leading space) for `(batch, *found)` images that aren't `expected`."""
    found, expected = tuple(found), tuple(expected)
    height, width, channels = expected
    if found == (channels, height, width) and found != expected:
        return (" These look channels-first (batch, channels, height, width): transpose them "
                "to channels-last, e.g. np.transpose(images, (0, 2, 3, 1)).")
    if len(found) == 3 and found[:2] == (height, width) and found[2] != channels:
        return (f" The model was built for {channels}-channel images (num_channels="
                f"{channels}); these have {found[2]}.")
    return ""


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class PatchStem(keras.layers.Layer):
    """Images `(batch, H, W, C)` to tokens `(batch, tokens, width)`: patch embedding, optional
    class token and learned position embedding (the stems: docs/normalization.md, "Stems").

    Args:
        patch_size: int. Side of a square patch; for `conv` a power of two.
        width: int. Token width.
        stem: str, default `"patch"`. One of `STEM_TYPES`.
        stem_norm: str or None, default `None`: one of `STEM_NORM_TYPES`. `None` means
            `"layernorm"` for the patch-norm stems and `"batchnorm"` for `conv`; it must be
            `None` for `patch`.
        stem_norm_learnable: bool, default `True`. `False` standardizes only.
        norm_epsilon: float, default `1e-6`; norm_groups: int, default `32` (`groupnorm`).
        class_token: bool, default `True`.
        position_embedding: bool, default `True`.
        weight_standardization: bool, default `False`.
        **kwargs: base layer keyword arguments.

    Example:
    >>> stem = PatchStem(patch_size=4, width=32, stem="dual_patchnorm")
    >>> tokens = stem(keras.random.uniform((2, 16, 16, 3)))  # (2, 17, 32)

    Reference:
    - [Kumar et al., Dual PatchNorm, 2023](https://arxiv.org/abs/2302.01327)
    - [Xiao et al., Early Convolutions Help Transformers See Better, 2021](
      https://arxiv.org/abs/2106.14881)
    """

    #: The constructor arguments, in `get_config`'s order.
    CONFIG_KEYS = ("patch_size", "width", "stem", "stem_norm", "stem_norm_learnable",
                   "norm_epsilon", "norm_groups", "class_token", "position_embedding",
                   "weight_standardization")

    def __init__(self, patch_size, width, stem="patch", stem_norm=None, stem_norm_learnable=True,
                 norm_epsilon=1e-6, norm_groups=32, class_token=True, position_embedding=True,
                 weight_standardization=False, **kwargs):
        super().__init__(**kwargs)
        arguments = {key: value for key, value in locals().items() if key in self.CONFIG_KEYS}
        self.check_arguments(**arguments)
        for key, value in arguments.items():
            setattr(self, key, value)

    @staticmethod
    def check_arguments(patch_size, width, stem="patch", stem_norm=None, stem_norm_learnable=True,
                        norm_epsilon=1e-6, norm_groups=32, class_token=True,
                        position_embedding=True, weight_standardization=False):
        """A `ValueError` naming the first bad argument of the constructor."""
        check_positive_int("patch_size", patch_size)
        check_positive_int("width", width)
        check_choice("stem", stem, STEM_TYPES)
        check_bool("stem_norm_learnable", stem_norm_learnable)
        check_norm_options(norm_epsilon, norm_groups, prefix="norm_")
        check_bool("class_token", class_token)
        check_bool("position_embedding", position_embedding)
        check_bool("weight_standardization", weight_standardization)
        if stem_norm is not None:
            check_norm("stem_norm", stem_norm, stem=True)
            if stem == "patch":
                raise ValueError(
                    f"stem='patch' has no normalization, but stem_norm={stem_norm!r} was "
                    "given. Use stem_norm=None, or a stem with norms such as "
                    "'dual_patchnorm'.")
        if stem == "conv" and (patch_size < 2 or patch_size & (patch_size - 1)):
            raise ValueError(
                f"stem='conv' stacks stride-2 convolutions, so patch_size must be a "
                f"power of two >= 2; got patch_size={patch_size}.")

    @property
    def resolved_stem_norm(self):
        """The norm type actually used inside the stem (`None` for `patch`)."""
        if self.stem == "patch":
            return None
        if self.stem_norm is not None:
            return self.stem_norm
        return "batchnorm" if self.stem == "conv" else "layernorm"

    def _norm(self, name):
        norm = self.resolved_stem_norm
        if norm == "batchnorm" and self.stem == "conv":
            return BatchNorm(momentum=BATCHNORM_MOMENTUM, epsilon=_CONV_STEM_BN_EPSILON,
                             center=self.stem_norm_learnable, scale=self.stem_norm_learnable,
                             name=name, dtype=self.dtype_policy)
        return make_norm(norm, epsilon=self.norm_epsilon, learnable=self.stem_norm_learnable,
                         groups=self.norm_groups, name=name, dtype=self.dtype_policy)

    def build(self, input_shape):
        _, height, width, channels = input_shape
        for axis_name, size in (("height", height), ("width", width)):
            if size is None or size % self.patch_size:
                raise ValueError(
                    f"Image {axis_name} {size} is not divisible by patch_size="
                    f"{self.patch_size}. Use an image size that is a multiple of "
                    f"{self.patch_size}.")
        self.grid_size = (height // self.patch_size, width // self.patch_size)
        self.num_channels = channels
        num_patches = self.grid_size[0] * self.grid_size[1]
        patch_dim = self.patch_size * self.patch_size * channels

        self.patch_norm = self.embedding_norm = None
        if self.stem == "conv":
            self.conv_layers = []
            num_convs = int(math.log2(self.patch_size))
            shape = tuple(input_shape)
            for i in range(num_convs):
                filters = max(1, self.width // 2 ** (num_convs - 1 - i))
                # PyTorch's Conv2d default (kaiming_uniform, a=sqrt(5)), which pycls's stem
                # keeps: U(+-1/sqrt(fan_in)).
                initializer = keras.initializers.VarianceScaling(1.0 / 3.0, "fan_in", "uniform")
                block = [
                    keras.layers.ZeroPadding2D(1, name=f"conv{i}_pad", dtype=self.dtype_policy),
                    StandardizedConv2D(filters, 3, strides=2, use_bias=False,
                                       kernel_initializer=initializer, name=f"conv{i}",
                                       dtype=self.dtype_policy,
                                       weight_standardization=self.weight_standardization),
                    self._norm(f"conv{i}_norm"),
                    keras.layers.ReLU(name=f"conv{i}_relu", dtype=self.dtype_policy),
                ]
                for layer in block:
                    layer.build(shape)
                    shape = layer.compute_output_shape(shape)
                self.conv_layers.extend(block)
            initializer = keras.initializers.RandomNormal(stddev=math.sqrt(2.0 / self.width))
            self.projection = StandardizedConv2D(
                self.width, 1, weight_standardization=self.weight_standardization,
                kernel_initializer=initializer, name="projection", dtype=self.dtype_policy)
            self.projection.build(shape)
        else:
            if self.stem in _USES_PRE_NORM:
                self.patch_norm = self._norm("patch_norm")
                self.patch_norm.build((None, num_patches, patch_dim))
            self.projection = FusedDense(self.width, kernel_initializer="lecun_normal",
                                         name="projection", dtype=self.dtype_policy,
                                         weight_standardization=self.weight_standardization)
            self.projection.build((None, num_patches, patch_dim))
        num_tokens = num_patches + int(self.class_token)
        if self.stem in _USES_POST_NORM or self.stem == "post_posemb":
            self.embedding_norm = self._norm("embedding_norm")
            self.embedding_norm.build((None, num_tokens, self.width))

        self.cls_token = None
        if self.class_token:
            self.cls_token = self.add_weight(name="class_token", shape=(1, 1, self.width),
                                             initializer="zeros")
        self.pos_embedding = None
        if self.position_embedding:
            self.pos_embedding = self.add_weight(
                name="position_embedding", shape=(1, num_tokens, self.width),
                initializer=keras.initializers.RandomNormal(stddev=1.0 / math.sqrt(self.width)))

    def call(self, images, training=None):
        (rows, columns), found = self.grid_size, tuple(images.shape[1:])
        expected = (rows * self.patch_size, columns * self.patch_size, self.num_channels)
        if found != expected:
            raise ValueError(
                f"Expected images of shape (batch, {expected[0]}, {expected[1]}, {expected[2]}) "
                f"(height, width, channels; {rows}x{columns} patches of {self.patch_size}), "
                f"got {tuple(images.shape)}.{image_shape_hint(found, expected)}")
        if self.stem == "conv":
            x = images
            for layer in self.conv_layers:
                x = layer(x, training=training)
            x = self.projection(x, training=training)
            x = ops.reshape(x, (-1, rows * columns, self.width))
        else:
            x = patchify(images, self.patch_size)
            if self.patch_norm is not None:
                x = self.patch_norm(x, training=training)
            x = self.projection(x, training=training)
            if self.stem in _USES_POST_NORM:
                x = self.embedding_norm(x, training=training)
        if self.cls_token is not None:
            batch = ops.shape(x)[0]
            cls = ops.broadcast_to(ops.cast(self.cls_token, x.dtype), (batch, 1, self.width))
            x = ops.concatenate([cls, x], axis=1)
        if self.pos_embedding is not None:
            x = x + ops.cast(self.pos_embedding, x.dtype)
        if self.stem == "post_posemb":
            x = self.embedding_norm(x, training=training)
        return x

    def compute_output_shape(self, input_shape):
        batch, height, width, _ = input_shape
        num_tokens = (height // self.patch_size) * (width // self.patch_size)
        return (batch, num_tokens + int(self.class_token), self.width)

    def get_config(self):
        return {**super().get_config(), **{key: getattr(self, key) for key in self.CONFIG_KEYS}}
