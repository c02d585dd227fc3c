"""Standard ViT checkpoints into keras_vitnorm: Hugging Face, big_vision/AugReg, timm,
keras-hub.

```python
model, report = keras_vitnorm.convert.load_checkpoint("vit-base-patch16-224/", num_classes=10)
print(report)                      # format, what was loaded, resampled, new, dropped
model = keras_vitnorm.ViT.from_preset("ViT-B_16.npz")      # the same, report printed
model.save_to_preset("b16_augreg")                        # this project's format
```

One module per source reads its format into a `Checkpoint` (the plain ViT config it
describes and its weights under this project's variable paths); `load_checkpoint`
builds a `ViT` from that config plus any overrides and transfers the weights:

- an `image_size` override resamples the position embedding (corner-aligned
  bilinear as big_vision by default, `resample="bicubic"` as timm);
- a `num_classes` override gives a new, freshly initialized head;
- normalization overrides (`stem="dual_patchnorm"`, `norm="rmsnorm"`, placements,
  block styles, ...) fine-tune a plain checkpoint into a variant: every weight that
  still fits is loaded, weights the variant adds keep the initialization the variant's
  reference gives them (e.g. DPN's LayerNorms: scale 1, shift 0), and the report lists
  exactly which weights are new and which checkpoint weights were dropped. Going from
  LayerNorm to RMSNorm, each norm's learned scale is kept and its shift dropped (an
  RMSNorm has no shift); for the other norm types the block norms start fresh, as
  the DyT paper's `convert_ln_to_dyt` does.
- an override of the architecture itself (width, depth, heads, MLP size, patch size,
  channels) is refused: the checkpoint cannot fill such a model.
"""

import dataclasses
import os

import numpy as np

from keras_vitnorm.convert import big_vision
from keras_vitnorm.convert import huggingface
from keras_vitnorm.convert import keras_hub
from keras_vitnorm.convert import timm
from keras_vitnorm.convert._common import Checkpoint
from keras_vitnorm.convert._common import read_json
from keras_vitnorm.convert._common import read_tensor_file

FORMATS = ("huggingface", "big_vision", "timm", "keras_hub")
ARCHITECTURE_KEYS = (
    "width", "depth", "num_heads", "mlp_dim", "patch_size", "num_channels", "qkv_bias", "pooling",
)
POSITION_EMBEDDING = "stem/position_embedding"


def is_checkpoint(path):
    """Whether `path` looks like a checkpoint this module reads (not a keras_vitnorm preset)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return True
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    return read_json(config).get("class_name") != "ViT"


def read_checkpoint(path, num_heads=None):
    """Reads a checkpoint file or directory into a `Checkpoint`, detecting its format.

    Args:
        path: a Hugging Face model directory (`config.json` + `model.safetensors` or
            `pytorch_model.bin`), a keras-hub preset directory, or a `.safetensors` /
            `.pth` / `.bin` state dict (timm or Hugging Face) or `.npz` (big_vision or
            AugReg) file.
        num_heads: int; the head count for state dicts that do not record it and have
            a non-standard width.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        if keras_hub.is_keras_hub_directory(path):
            backbone, classifier = keras_hub.read_directory(path)
            return keras_hub.convert(backbone, classifier, source=path)
        if os.path.isfile(os.path.join(path, "config.json")):
            state, hf_config = huggingface.read_directory(path)
            return huggingface.convert(state, hf_config, source=path)
        raise ValueError(
            f"{path!r} is a directory without config.json: not a Hugging Face model, keras-hub "
            "preset or keras_vitnorm preset directory."
        )
    if not os.path.exists(path):
        raise ValueError(f"Checkpoint {path!r} does not exist.")
    tensors = read_tensor_file(path)
    if big_vision.is_big_vision_state(tensors):
        return big_vision.convert(tensors, source=path)
    if timm.is_timm_state(tensors):
        return timm.convert(tensors, source=path, num_heads=num_heads)
    if huggingface.is_huggingface_state(tensors):
        config_path = os.path.join(os.path.dirname(path), "config.json")
        hf_config = None
        if os.path.isfile(config_path):
            hf_config = read_json(config_path)
        return huggingface.convert(tensors, hf_config, source=path, num_heads=num_heads)
    keys = sorted(tensors)
    first = keys[0] if keys else None
    raise ValueError(
        f"{path!r} is not a ViT checkpoint this project reads. Expected the key "
        f"'{timm.PATCH_KEY}' (timm), '...{huggingface.PATCH_KEY}' (Hugging Face) or "
        "'embedding/kernel' (big_vision/AugReg); the first key found is "
        + (f"{first!r} with shape {tuple(np.shape(tensors[first]))}." if first else "none (empty file).")
    )


@dataclasses.dataclass
class ConversionReport:
    """What `load_checkpoint` did with each weight.

    Attributes:
        format: the detected source format.
        source: the checkpoint path.
        loaded: variable paths filled from the checkpoint unchanged.
        resampled: variable paths resampled to a new shape (the position embedding).
        converted: `(variable path, how)` for weights derived from another kind of
            weight (a LayerNorm scale kept as an RMSNorm scale).
        new: variable paths the checkpoint has no value for, with their fresh
            initialization (a new head, a variant's extra norms).
        dropped: `(source key, why)` for checkpoint weights the model does not use.
    """

    format: str
    source: str
    loaded: list = dataclasses.field(default_factory=list)
    resampled: list = dataclasses.field(default_factory=list)
    converted: list = dataclasses.field(default_factory=list)
    new: list = dataclasses.field(default_factory=list)
    dropped: list = dataclasses.field(default_factory=list)

    def __str__(self):
        lines = [f"Converted {self.source} ({self.format} format): {len(self.loaded)} weights loaded"]
        if self.resampled:
            lines.append(f"  resampled: {', '.join(self.resampled)}")
        for path, how in self.converted:
            lines.append(f"  converted: {path} ({how})")
        if self.new:
            lines.append(f"  new, freshly initialized ({len(self.new)}): {', '.join(self.new)}")
        for key, why in self.dropped:
            lines.append(f"  dropped: {key} ({why})")
        return "\n".join(lines)


def load_checkpoint(path, verbose=False, num_heads=None, resample="bilinear", **overrides):
    """Builds a `ViT` from a standard checkpoint; returns `(model, ConversionReport)`.

    Args:
        path: see `read_checkpoint`.
        verbose: bool, default `False`. Print the report.
        num_heads: int, only for state dicts that do not record their head count.
        resample: str, default `"bilinear"`: how a new `image_size` resamples the
            position embedding, `"bilinear"` as big_vision or `"bicubic"` as timm
            (`keras_vitnorm.models.preset_io.resample_position_embedding`).
        **overrides: `ViT` config values that replace the checkpoint's: `image_size`,
            `num_classes`, and any normalization setting (`stem`, `norm`, `attn_norm`,
            `mlp_norm`, `block_style`, `layer_scale`, `qk_norm`, ...).

    Example:
    >>> model, report = load_checkpoint("vit_small_patch16_224.safetensors",
    ...                                 stem="dual_patchnorm", num_classes=10)
    """
    checkpoint = read_checkpoint(path, num_heads=num_heads)
    if num_heads is not None and num_heads != checkpoint.config["num_heads"]:
        raise ValueError(
            f"num_heads={num_heads} does not fit: the {checkpoint.format} checkpoint {path!r} "
            f"records {checkpoint.config['num_heads']} heads."
        )
    model, report = build_from_checkpoint(checkpoint, resample=resample, **overrides)
    if verbose:
        print(report)
    return model, report


def build_from_checkpoint(checkpoint, model_class=None, resample="bilinear", **overrides):
    """`(ViT, ConversionReport)` from a `Checkpoint` and config overrides."""
    from keras_vitnorm.validation import check_known_keys
    from keras_vitnorm.models import ViT

    model_class = model_class or ViT
    defaults = {"qkv_bias": True, "pooling": "cls", "num_channels": 3}
    for key in ARCHITECTURE_KEYS:
        saved = checkpoint.config.get(key, defaults.get(key))
        if key in overrides and overrides[key] != saved:
            path = _first_path_with(checkpoint, key)
            raise ValueError(
                f"Override {key}={overrides[key]!r} does not fit the checkpoint, which has "
                f"{key}={saved!r} (e.g. key {checkpoint.source_keys.get(path, path)!r} "
                f"of shape {tuple(checkpoint.arrays[path].shape)}). Overrides may change the "
                "image size, the classes and the normalization, not the architecture."
            )
    check_known_keys(overrides, (*ViT.CONFIG_KEYS, "name", "dtype", "trainable"), "override")
    model = model_class.from_config({**checkpoint.config, **overrides})
    report = transfer(model, checkpoint, resample)
    return model, report


def _first_path_with(checkpoint, key):
    """A weight whose shape shows `key` (for the error message)."""
    path = {
        "width": "stem/projection/bias",
        "depth": next(p for p in checkpoint.arrays if p.startswith("block_")),
        "num_heads": "block_0/attention/qkv/kernel",
        "mlp_dim": "block_0/mlp/fc1/kernel",
        "patch_size": "stem/projection/kernel",
        "num_channels": "stem/projection/kernel",
        "qkv_bias": "block_0/attention/qkv/kernel",
        "pooling": POSITION_EMBEDDING,
    }[key]
    return path if path in checkpoint.arrays else next(iter(checkpoint.arrays))


def transfer(model, checkpoint, resample="bilinear"):
    """Fills `model` from `checkpoint`; returns the `ConversionReport`.

    A position embedding of another grid is resampled by `resample`
    (`"bilinear"` as big_vision, `"bicubic"` as timm).

    The checkpoint must be complete for its own (plain) config, which every converter
    checks; so a model weight without a checkpoint value is one the overrides added.
    """
    from keras import ops

    from keras_vitnorm.models.preset_io import resample_for_model

    report = ConversionReport(checkpoint.format, checkpoint.source)
    config = model.get_config()
    arrays = dict(checkpoint.arrays)
    norm = config["norm"]
    source_norm = checkpoint.config.get("norm", "layernorm")
    block_norms_fit = norm == source_norm
    values = []
    for variable in model.weights:
        path = variable.path
        expected = tuple(variable.shape)
        source = checkpoint.source_keys.get(path, path)
        is_block_norm = _is_block_norm(path)
        if path.startswith("head/") and config["num_classes"] != checkpoint.config.get("num_classes"):
            report.new.append(f"{path} ({_initializer(variable)})")
            if path in arrays:
                arrays.pop(path)
                report.dropped.append((
                    checkpoint.source_keys[path],
                    f"num_classes {checkpoint.config['num_classes']} -> {config['num_classes']}: a new head",
                ))
            continue
        if is_block_norm and not block_norms_fit:
            source_path = path.rsplit("/", 1)[0] + "/gamma"
            if (source_norm, norm) == ("layernorm", "rmsnorm") and path.endswith("/scale") \
                    and source_path in arrays:
                values.append((variable, arrays.pop(source_path)))
                report.converted.append((path, f"the LayerNorm scale {checkpoint.source_keys[source_path]}"))
            else:
                report.new.append(f"{path} ({_initializer(variable)})")
            continue
        if path not in arrays:
            report.new.append(f"{path} ({_initializer(variable)})")
            continue
        array = arrays.pop(path)
        if tuple(array.shape) == expected:
            values.append((variable, array))
            report.loaded.append(path)
        elif path == POSITION_EMBEDDING:
            side = int(round((array.shape[1] - int(config["pooling"] == "cls")) ** 0.5))
            grid = model.get_layer("stem").grid_size
            values.append((variable, resample_for_model(model, array, resample)))
            report.resampled.append(
                f"{path} ({side}x{side} -> {grid[0]}x{grid[1]} grid, {resample})"
            )
        else:
            raise ValueError(
                f"Checkpoint key {source!r} has shape {tuple(array.shape)} (as {path!r}); the "
                f"model expects {expected}."
            )
    for path in arrays:
        if _is_block_norm(path) and not block_norms_fit:
            why = f"norm={norm!r} replaces the {source_norm} layers"
        else:
            why = "the model's config has no such weight"
        report.dropped.append((checkpoint.source_keys.get(path, path), why))
    for variable, array in values:
        variable.assign(ops.convert_to_tensor(np.asarray(array, "float32"), dtype=variable.dtype))
    return report


def _is_block_norm(path):
    """Block and final norms (what `norm` sets); stem norms are the stem's own."""
    parts = path.split("/")
    layer = parts[-2] if len(parts) >= 2 else ""
    return path.startswith("final_norm/") or (
        parts[0].startswith("block_") and layer in ("attn_norm", "mlp_norm")
    )


def _initializer(variable):
    from keras import ops

    value = ops.convert_to_numpy(variable)
    if np.all(value == 1):
        return "ones"
    if np.all(value == 0):
        return "zeros"
    return "random init"


__all__ = [
    "Checkpoint",
    "ConversionReport",
    "FORMATS",
    "build_from_checkpoint",
    "is_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "transfer",
]
