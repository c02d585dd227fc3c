"""The ViT's config: what each value may be, and the `dtype` that rebuilds a quantized model."""

import math

import keras

from keras_vitnorm.layers import EncoderBlock
from keras_vitnorm.layers import PatchStem
from keras_vitnorm.validation import check_bool
from keras_vitnorm.validation import check_choice
from keras_vitnorm.validation import check_positive_int

#: Every value accepted by `pooling`.
POOLINGS = ("cls", "gap")
#: The range the layers after the input take (big_vision's `value_range(-1, 1)`).
MODEL_RANGE = (-1.0, 1.0)


def pixel_range_of(value):
    """`(low, high)` floats of a `pixel_range` value: a pair of numbers, low < high."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            for v in value) and value[0] < value[1]:
        return float(value[0]), float(value[1])
    raise ValueError(
        f"pixel_range must be a pair [low, high] of numbers with low < high, the range of the "
        f"images the model is given (e.g. [0, 255] for decoded images, [0, 1] for "
        f"keras.layers.Rescaling(1 / 255) output, [-1, 1], the default), got {value!r}.")


def image_hw(image_size):
    """`(height, width)` of an `image_size` value: an int or a pair of ints."""
    pair = list(image_size) if isinstance(image_size, (list, tuple)) else [image_size] * 2
    if len(pair) == 2 and all(isinstance(s, int) and not isinstance(s, bool) for s in pair):
        return tuple(pair)
    raise ValueError(
        f"image_size must be an int or a pair [height, width] of ints, got {image_size!r}.")


def in_model_range(overrides):
    """`overrides` with `pixel_range` at [-1, 1], what the library's pipelines feed."""
    if pixel_range_of(overrides.get("pixel_range", MODEL_RANGE)) != MODEL_RANGE:
        raise ValueError(
            f"pixel_range={overrides['pixel_range']!r}: the library's input pipelines feed "
            f"images in [-1, 1], so the models they train and score take [-1, 1]. Give a "
            f"trained model another range when you load it yourself: ViT.from_preset(path, "
            f"pixel_range=[0, 255]).")
    return {**overrides, "pixel_range": MODEL_RANGE}


def validate_config(config):
    """Checks a ViT config dict; raises a `ValueError` naming the first bad value."""
    c = config
    image_size, patch_size, width = c["image_size"], c["patch_size"], c["width"]
    num_heads, num_classes = c["num_heads"], c["num_classes"]
    check_positive_int("num_channels", c["num_channels"])
    check_positive_int("depth", c["depth"])
    PatchStem.check_arguments(patch_size, width, **{key: c[key] for key in (
        "stem", "stem_norm", "stem_norm_learnable", "norm_epsilon", "norm_groups",
        "weight_standardization")})
    EncoderBlock.check_arguments(num_heads, c["mlp_dim"], c["depth"], **{key: c[key] for key in (
        "norm", "norm_epsilon", "norm_groups", "attn_norm", "mlp_norm", "block_style",
        "layer_scale", "qk_norm", "qkv_bias", "drop_path_rate", "dropout",
        "weight_standardization")})
    height, image_width = image_hw(image_size)
    for axis_name, size in (("height", height), ("width", image_width)):
        if size < 1 or size % patch_size:
            raise ValueError(
                f"image_size={image_size!r}: image {axis_name} {size} is not divisible by "
                f"patch_size={patch_size}. Valid sizes are multiples of {patch_size}, "
                f"e.g. {max(1, round(size / patch_size)) * patch_size}.")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
        raise ValueError(
            f"num_classes must be a positive integer (or 0 for a feature extractor), "
            f"got {num_classes!r}.")
    divisors = [d for d in range(1, min(width, 64) + 1) if width % d == 0]
    if width % num_heads:
        raise ValueError(
            f"width={width} is not divisible by num_heads={num_heads}. Valid num_heads "
            f"for this width include {divisors}.")
    if c["norm"] == "groupnorm" and width % c["norm_groups"]:
        raise ValueError(
            f"norm='groupnorm' needs width divisible by norm_groups; got width={width}, "
            f"norm_groups={c['norm_groups']}. Valid norm_groups for this width include "
            f"{divisors}.")
    check_choice("pooling", c["pooling"], POOLINGS)
    if c["final_norm"] is not None:
        check_bool("final_norm", c["final_norm"])
    pixel_range_of(c["pixel_range"])


def sublayers(model):
    """Every layer inside `model`, at any depth, each once (Keras' `_flatten_layers` if present)."""
    flatten = getattr(model, "_flatten_layers", None)
    if callable(flatten):
        return list(flatten(include_self=False))
    found, seen, stack = [], {id(model)}, [model]
    while stack:
        for value in vars(stack.pop()).values():
            values = value.values() if isinstance(value, dict) else (
                value if isinstance(value, (list, tuple)) else (value,))
            for layer in values:
                if isinstance(layer, keras.layers.Layer) and id(layer) not in seen:
                    seen.add(id(layer))
                    found.append(layer)
                    stack.append(layer)
    return found


def dtype_with_quantized_layers(model, dtype):
    """The `dtype` argument that rebuilds `model`'s layers as they are: with a quantized layer,
    a `DTypePolicyMap` with `dtype` as its default (as keras-hub records it)."""
    if isinstance(dtype, dict):
        dtype = keras.dtype_policies.deserialize(dtype)
    if isinstance(dtype, keras.dtype_policies.DTypePolicyMap):
        return dtype  # every layer's policy is already in it, quantized or not
    quantized = {layer.path: layer.dtype_policy for layer in sublayers(model)
                 if layer.quantization_mode is not None}
    if not quantized:
        return dtype
    return keras.dtype_policies.DTypePolicyMap(default_policy=dtype, policy_map=quantized)


def vit_config_with_quantized_layers(model, vit_config):
    """`vit_config` (`model`'s, or its image tower's) with a serialized `dtype` that keeps
    `model`'s quantized layers."""
    dtype = dtype_with_quantized_layers(model, vit_config["dtype"])
    if dtype is not None and not isinstance(dtype, str):
        dtype = keras.dtype_policies.serialize(dtype)
    return {**vit_config, "dtype": dtype}
