"""The configurable Vision Transformer, and `load_checkpoint`, which builds one from a
standard checkpoint."""

import inspect

import keras
import numpy as np

from keras_vitnorm.convert import Checkpoint
from keras_vitnorm.convert import POSITION_EMBEDDING
from keras_vitnorm.layers import ClassTokenPooling
from keras_vitnorm.layers import EncoderBlock
from keras_vitnorm.layers import PatchStem
from keras_vitnorm.layers import make_norm
from keras_vitnorm.layers.encoder_block import resolve_placements
from keras_vitnorm.models import preset_io
from keras_vitnorm.models.compile_config import PortableCompileConfig
from keras_vitnorm.models import weights
from keras_vitnorm.models.presets import list_presets
from keras_vitnorm.models.guarded_calls import GuardedCalls
from keras_vitnorm.models.vit_config import MODEL_RANGE
from keras_vitnorm.models.vit_config import image_hw
from keras_vitnorm.models.vit_config import pixel_range_of
from keras_vitnorm.models.vit_config import validate_config
from keras_vitnorm.models.vit_config import vit_config_with_quantized_layers
from keras_vitnorm.validation import check_known_keys


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class ViT(GuardedCalls, PortableCompileConfig, keras.Model):
    """Vision Transformer whose normalization is part of its JSON-safe config.

    Takes `(batch, height, width, channels)` images; returns float32 logits
    `(batch, num_classes)`, or pooled features `(batch, width)` when `num_classes=0`.

    Args (values, formulas and defaults in docs/normalization.md):
        image_size, patch_size, num_channels: int (`image_size` also [height, width]).
        width, depth, num_heads, mlp_dim: token width, blocks, heads (divide `width`), MLP.
        num_classes: `0` returns the pooled features.
        norm, norm_epsilon, norm_groups: norm of the blocks, the final norm and `qk_norm`.
        attn_norm, mlp_norm: placement; `None` follows `block_style`.
        block_style: `"standard"`, `"normformer"`, `"sub_ln"` or `"deepnorm"`.
        stem, stem_norm, stem_norm_learnable: patch embedding variant and its norm.
        final_norm: `None` adds one unless the MLP placement is `"post"`.
        layer_scale, qk_norm, qkv_bias, drop_path_rate, dropout, pooling,
            weight_standardization: the switches of docs/normalization.md.
        pixel_range: [low, high] of the input images, mapped onto [-1, 1] by a weightless
            `Rescaling` (docs/deploy.md).
        dtype: dtype policy of the model, its layers and models built on it.
        **kwargs: `name`, `trainable`.

    Example:
    >>> config = ViT.from_preset("s16").get_config()
    >>> rms = ViT.from_config({**config, "norm": "rmsnorm"})

    Reference:
    - [Dosovitskiy et al., An Image is Worth 16x16 Words, 2021](
      https://arxiv.org/abs/2010.11929)
    - [Kumar et al., Dual PatchNorm, 2023](https://arxiv.org/abs/2302.01327)
    """

    #: Names of the constructor arguments that `get_config` returns.
    CONFIG_KEYS = (
        "image_size", "patch_size", "num_channels", "width", "depth", "num_heads", "mlp_dim",
        "num_classes", "norm", "norm_epsilon", "norm_groups", "attn_norm", "mlp_norm",
        "block_style", "stem", "stem_norm", "stem_norm_learnable", "final_norm", "layer_scale",
        "qk_norm", "qkv_bias", "drop_path_rate", "dropout", "pooling", "weight_standardization",
        "pixel_range",
    )

    def __init__(self, image_size=224, patch_size=16, num_channels=3, width=768, depth=12,
                 num_heads=12, mlp_dim=3072, num_classes=1000, norm="layernorm", norm_epsilon=1e-6,
                 norm_groups=32, attn_norm=None, mlp_norm=None, block_style="standard",
                 stem="patch", stem_norm=None, stem_norm_learnable=True, final_norm=None,
                 layer_scale=None, qk_norm=False, qkv_bias=True, drop_path_rate=0.0, dropout=0.0,
                 pooling="cls", weight_standardization=False, pixel_range=MODEL_RANGE, dtype=None,
                 **kwargs):
        config = {key: value for key, value in locals().items() if key in self.CONFIG_KEYS}
        check_known_keys(kwargs, (*self.CONFIG_KEYS, "dtype", "name", "trainable"), "ViT argument")
        validate_config(config)
        attn_norm, mlp_norm = resolve_placements(block_style, attn_norm, mlp_norm)
        if final_norm is None:  # none after a "post" MLP norm, which ends each block
            final_norm = mlp_norm != "post"
        height, image_width = image_hw(image_size)
        policy = keras.dtype_policies.get(dtype) if dtype is not None else None
        images = keras.Input((height, image_width, num_channels), name="images")
        config["pixel_range"] = low, high = pixel_range_of(pixel_range)
        x = images
        if config["pixel_range"] != MODEL_RANGE:  # [low, high] -> [-1, 1]
            x = keras.layers.Rescaling(2 / (high - low), offset=-(high + low) / (high - low),
                                       name="pixel_range", dtype=policy)(x)
        x = PatchStem(patch_size, width, stem=stem, stem_norm=stem_norm,
                      stem_norm_learnable=stem_norm_learnable, norm_epsilon=norm_epsilon,
                      norm_groups=norm_groups, class_token=pooling == "cls",
                      weight_standardization=weight_standardization, name="stem", dtype=policy)(x)
        for i in range(depth):
            rate = drop_path_rate * i / (depth - 1) if depth > 1 else drop_path_rate
            x = EncoderBlock(num_heads, mlp_dim, num_layers=depth, norm=norm,
                             norm_epsilon=norm_epsilon, norm_groups=norm_groups,
                             attn_norm=attn_norm, mlp_norm=mlp_norm, block_style=block_style,
                             layer_scale=layer_scale, qk_norm=qk_norm, qkv_bias=qkv_bias,
                             drop_path_rate=rate, dropout=dropout,
                             weight_standardization=weight_standardization, name=f"block_{i}",
                             dtype=policy)(x)
        if final_norm:
            x = make_norm(norm, epsilon=norm_epsilon, groups=norm_groups, name="final_norm",
                          dtype=policy)(x)
        if pooling == "cls":
            x = ClassTokenPooling(name="cls_pool", dtype=policy)(x)
        else:
            x = keras.layers.GlobalAveragePooling1D(name="gap_pool", dtype=policy)(x)
        if num_classes:
            # big_vision zero-initializes the head for training from scratch.
            x = keras.layers.Dense(num_classes, kernel_initializer="zeros", name="head",
                                   dtype=policy)(x)
        outputs = keras.layers.Activation("linear", dtype="float32", name="outputs")(x)
        kwargs.setdefault("name", "vit")
        super().__init__(inputs=images, outputs=outputs, **kwargs)
        if policy is not None:
            # A functional model takes the global policy whatever its layers use; its
            # own policy is what `compile` reads (loss scaling under mixed_float16).
            self.dtype_policy = policy

        for key, value in config.items():
            setattr(self, key, value)
        self._dtype_argument = dtype

    def get_config(self):
        config = {key: getattr(self, key) for key in self.CONFIG_KEYS}
        for key in ("image_size", "pixel_range"):
            if isinstance(config[key], tuple):
                config[key] = list(config[key])
        config.update(name=self.name, trainable=self.trainable, dtype=self._dtype_argument)
        return vit_config_with_quantized_layers(self, config)

    def pixel_ranges(self):
        return {"images": self.pixel_range}

    def _range_advice(self):
        return ("build the model with the range they have, e.g. pixel_range=[0, 255] (also "
                "as a from_preset override)")

    def backbone(self):
        """The encoder sharing this ViT's weights: images to `{"tokens": (batch, tokens, width),
        "pooled": (batch, width)}`, the final norm's tokens (class token first) and the head's
        input."""
        pool = self.get_layer("cls_pool" if self.pooling == "cls" else "gap_pool")
        # Not kept as an attribute: Keras would track it as a sublayer of this model.
        outputs = {"tokens": pool.input, "pooled": pool.output}
        backbone = keras.Model(inputs=self.input, outputs=outputs, name=f"{self.name}_backbone")
        backbone.dtype_policy = self.dtype_policy
        return backbone

    def export(self, filepath, format="tf_saved_model", verbose=None, input_signature=None,
               **kwargs):
        """`keras.Model.export`; for ONNX the input signature is filled in, batch size open, as
        Keras needs it for a model never called (docs/deploy.md)."""
        if input_signature is None and format == "onnx":
            images = self.inputs[0]
            input_signature = [keras.InputSpec(shape=(None, *images.shape[1:]),
                                               dtype=images.dtype, name=images.name)]
        return super().export(filepath, format=format, verbose=verbose,
                              input_signature=input_signature, **kwargs)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        dtype = config.get("dtype")
        if isinstance(dtype, dict):
            config["dtype"] = keras.dtype_policies.deserialize(dtype)
        return cls(**config)

    @classmethod
    def presets(cls):
        """Returns `{name: description}` of the built-in presets."""
        return list_presets()

    @classmethod
    def default_config(cls):
        """`{key: default}` of every constructor argument in `CONFIG_KEYS`."""
        parameters = inspect.signature(cls.__init__).parameters
        return {key: parameters[key].default for key in cls.CONFIG_KEYS}

    @classmethod
    def from_preset(cls, preset, resample="bilinear", **overrides):
        """Builds a ViT from a built-in preset name (`ViT.presets()`, fresh weights), a preset
        directory, hub handle or checkpoint (Hugging Face, keras-hub, timm, big_vision/AugReg).

        `overrides` replace config values: a new `image_size` resamples the position embedding
        (`resample`: `"bilinear"` or `"bicubic"`), a new `num_classes` gives a fresh head
        (docs/presets.md, docs/checkpoints.md).
        """
        return preset_io.load_preset(cls, preset, overrides, resample)

    def save_to_preset(self, directory, overwrite=False):
        """Writes a preset directory for `ViT.from_preset`, replacing one only if `overwrite`."""
        preset_io.save_preset(self, directory, overwrite=overwrite)

    def weights_by_path(self):
        """Returns `{path: variable}` for every weight, in a backend-neutral naming."""
        return {variable.path: variable for variable in self.weights}

    def load_weights_by_path(self, arrays, resample_position_embedding=True, resample="bilinear"):
        """Loads `{path: array}` weights (`weights_by_path`'s names); a missing or misfit one is a
        `ValueError`. Another grid's position embedding is resampled unless told not to."""
        embedding = arrays.get(POSITION_EMBEDDING)
        found = None if embedding is None else tuple(np.shape(embedding))
        stem_embedding = self.get_layer("stem").pos_embedding
        expected = None if stem_embedding is None else tuple(stem_embedding.shape)
        if not resample_position_embedding and found not in (None, expected):
            raise ValueError(
                f"Weight {POSITION_EMBEDDING!r} has shape {found}; the model expects "
                f"{expected} (resample_position_embedding=False).")
        checkpoint = Checkpoint("weights by path", "the given arrays", self.get_config(),
                                dict(arrays), {path: path for path in arrays})
        weights.transfer(self, checkpoint, resample, strict=True)


def load_checkpoint(path, verbose=False, num_heads=None, resample="bilinear", model_class=ViT,
                    **overrides):
    """Builds a `ViT` from a standard checkpoint; returns `(model, ConversionReport)`.

    Args:
        path: see `read_checkpoint`.
        verbose: bool, default `False`. Print the report.
        num_heads: int, only for state dicts that do not record their head count.
        resample: str, default `"bilinear"` (big_vision) or `"bicubic"` (timm): how a
            new `image_size` resamples the position embedding.
        model_class: the class to build, default `ViT` (a subclass keeps its own).
        **overrides: `ViT` config values that replace the checkpoint's: `image_size`,
            `num_classes`, and any normalization setting (`stem`, `norm`, `attn_norm`,
            `mlp_norm`, `block_style`, `layer_scale`, `qk_norm`, ...).

    Example:
    >>> model, report = load_checkpoint("vit_small_patch16_224.safetensors",
    ...                                 stem="dual_patchnorm", num_classes=10)
    """
    return weights.read_and_build(path, model_class, verbose=verbose, num_heads=num_heads,
                                  resample=resample, **overrides)
