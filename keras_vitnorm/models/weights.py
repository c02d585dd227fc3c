"""The one weight-transfer engine: a `Checkpoint`'s named arrays into a built `ViT` whose
image size, classes or normalization may differ, with a report (docs/checkpoints.md)."""

import dataclasses

import numpy as np
from keras import ops

from keras_vitnorm.choices import RESAMPLE_METHODS
from keras_vitnorm.convert import read_checkpoint
from keras_vitnorm.convert import POSITION_EMBEDDING
from keras_vitnorm.validation import check_choice
from keras_vitnorm.validation import check_known_keys

#: Config keys a checkpoint fixes: overrides may not change them.
ARCHITECTURE_KEYS = (
    "width", "depth", "num_heads", "mlp_dim", "patch_size", "num_channels", "qkv_bias", "pooling",
)


def check_overrides(model_class, overrides, what="override"):
    """A `ValueError` naming a key of `overrides` (a `what`) not in `model_class`'s config."""
    check_known_keys(overrides, (*model_class.CONFIG_KEYS, "name", "dtype", "trainable"), what)


def _more(items):
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def resample_position_embedding(embedding, source_grid, target_grid, num_prefix_tokens,
                                method="bilinear"):
    """`embedding` `(1, num_prefix_tokens + h * w, D)` on `source_grid` `(h, w)` resampled
    to `target_grid`, the prefix rows kept: a float32 NumPy array.

    NumPy gives the same values on every backend: `"bilinear"` as big_vision (corner-aligned
    `scipy.ndimage.zoom`, order 1), `"bicubic"` as timm (antialiased `F.interpolate`).
    """
    check_choice("resample", method, RESAMPLE_METHODS)
    embedding = np.asarray(embedding, dtype="float32")
    dim = embedding.shape[-1]
    prefix = embedding[:, :num_prefix_tokens]
    grid = embedding[0, num_prefix_tokens:].reshape(source_grid[0], source_grid[1], dim)
    matrix = _corner_aligned_linear_matrix if method == "bilinear" else _antialiased_bicubic_matrix
    rows = matrix(source_grid[0], target_grid[0])
    columns = matrix(source_grid[1], target_grid[1])
    resized = np.einsum("ih,jw,hwd->ijd", rows, columns, grid.astype("float64"))
    resized = resized.astype("float32").reshape(1, -1, dim)
    return np.concatenate([prefix, resized], axis=1)


def _corner_aligned_linear_matrix(in_size, out_size):
    """`(out_size, in_size)` weights of `scipy.ndimage.zoom(..., order=1)` along one axis."""
    step = (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    positions = np.arange(out_size) * step
    sources = np.arange(in_size)
    return np.stack([np.interp(positions, sources, one) for one in np.eye(in_size)], axis=1)


def _cubic(x, a=-0.5):
    """The cubic convolution kernel (Keys) with `a = -0.5`, as PIL's and PyTorch's antialiasing."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _antialiased_bicubic_matrix(in_size, out_size):
    """`(out_size, in_size)` weights of antialiased bicubic resampling along one axis."""
    scale = in_size / out_size
    support = 2.0 * max(scale, 1.0)
    inverse_scale = 1.0 / scale if scale >= 1.0 else 1.0
    matrix = np.zeros((out_size, in_size))
    for i in range(out_size):
        center = scale * (i + 0.5)
        first = max(int(center - support + 0.5), 0)
        last = min(int(center + support + 0.5), in_size)
        taps = np.arange(first, last)
        weights = _cubic((taps - center + 0.5) * inverse_scale)
        matrix[i, first:last] = weights / weights.sum()
    return matrix


@dataclasses.dataclass
class ConversionReport:
    """What `load_checkpoint` did with each weight.

    Attributes:
        format: the detected source format.
        source: the checkpoint path.
        loaded: variable paths filled from the checkpoint unchanged.
        resampled: variable paths resampled to a new shape (the position embedding).
        converted: `(variable path, how)` for weights derived from another kind (a
            LayerNorm scale kept as an RMSNorm scale).
        new: variable paths without a checkpoint value, with their fresh init.
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
        lines = [f"Converted {self.source} ({self.format} format): "
                 f"{len(self.loaded)} weights loaded"]
        if self.resampled:
            lines.append(f"  resampled: {', '.join(self.resampled)}")
        for path, how in self.converted:
            lines.append(f"  converted: {path} ({how})")
        if self.new:
            lines.append(f"  new, freshly initialized ({len(self.new)}): {', '.join(self.new)}")
        for key, why in self.dropped:
            lines.append(f"  dropped: {key} ({why})")
        return "\n".join(lines)


def read_and_build(path, model_class, verbose=False, num_heads=None, resample="bilinear",
                   **overrides):
    """Implements `load_checkpoint`: `(model, ConversionReport)` of the checkpoint at `path`."""
    checkpoint = read_checkpoint(path, num_heads=num_heads)
    if num_heads is not None and num_heads != checkpoint.config["num_heads"]:
        raise ValueError(
            f"num_heads={num_heads} does not fit: the {checkpoint.format} checkpoint {path!r} "
            f"records {checkpoint.config['num_heads']} heads.")
    model, report = build_from_checkpoint(checkpoint, model_class, resample=resample, **overrides)
    if verbose:
        print(report)
    return model, report


def build_from_checkpoint(checkpoint, model_class, resample="bilinear", strict=False,
                          **overrides):
    """`(model, ConversionReport)`: a `model_class` built from `checkpoint`'s config and
    `overrides`, its weights transferred (`strict`: see `transfer`)."""
    defaults = {"qkv_bias": True, "pooling": "cls", "num_channels": 3}
    for key in ARCHITECTURE_KEYS:
        saved = checkpoint.config.get(key, defaults.get(key))
        if key in overrides and overrides[key] != saved:
            path = _first_path_with(checkpoint, key)
            raise ValueError(
                f"Override {key}={overrides[key]!r} does not fit the checkpoint, which has "
                f"{key}={saved!r} (e.g. key {checkpoint.source_keys.get(path, path)!r} "
                f"of shape {tuple(checkpoint.arrays[path].shape)}). Overrides may change the "
                "image size, the classes and the normalization, not the architecture.")
    check_overrides(model_class, overrides)
    model = model_class.from_config({**checkpoint.config, **overrides})
    return model, transfer(model, checkpoint, resample, strict)


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


def transfer(model, checkpoint, resample="bilinear", strict=False):
    """Fills `model` from `checkpoint`; returns the `ConversionReport`.

    Another grid's position embedding is resampled, a new `num_classes` gives a fresh head,
    a new block norm keeps what carries over (docs/checkpoints.md). The converters check
    that a checkpoint is complete, so a weight it lacks is one the overrides added.

    Args:
        model: a built `ViT`.
        checkpoint: a `keras_vitnorm.convert.Checkpoint`.
        resample: str, `"bilinear"` (default) or `"bicubic"`.
        strict: bool, default `False`. Raise a `ValueError` for a weight on one side only
            instead of reporting it.
    """
    check_choice("resample", resample, RESAMPLE_METHODS)
    report = ConversionReport(checkpoint.format, checkpoint.source)
    config = model.get_config()
    arrays = dict(checkpoint.arrays)
    norm = config["norm"]
    source_norm = checkpoint.config.get("norm", "layernorm")
    block_norms_fit = norm == source_norm
    new_head = config["num_classes"] != checkpoint.config.get("num_classes")
    values = []
    for variable in model.weights:
        path, expected, array = variable.path, tuple(variable.shape), None
        if path.startswith("head/") and new_head:
            if path in arrays:
                arrays.pop(path)
                report.dropped.append((checkpoint.source_keys[path], (
                    f"num_classes {checkpoint.config['num_classes']} -> {config['num_classes']}: "
                    "a new head")))
        elif _is_block_norm(path) and not block_norms_fit:
            gamma = path.rsplit("/", 1)[0] + "/gamma"
            if ((source_norm, norm) == ("layernorm", "rmsnorm") and path.endswith("/scale")
                    and gamma in arrays):
                array = arrays.pop(gamma)
                report.converted.append(
                    (path, f"the LayerNorm scale {checkpoint.source_keys[gamma]}"))
        elif path in arrays:
            array = arrays.pop(path)
            if tuple(array.shape) == expected:
                report.loaded.append(path)
            elif path == POSITION_EMBEDDING:
                num_prefix = int(config["pooling"] == "cls")
                tokens = array.shape[1] - num_prefix
                side = int(round(tokens**0.5))
                if array.ndim != 3 or array.shape[-1] != expected[-1] or side * side != tokens:
                    raise ValueError(
                        f"Weight {POSITION_EMBEDDING!r} of shape {array.shape} cannot be "
                        f"resampled to {expected}: only a square grid of the same width can be.")
                grid = model.get_layer("stem").grid_size
                array = resample_position_embedding(array, (side, side), grid, num_prefix,
                                                    resample)
                report.resampled.append(
                    f"{path} ({side}x{side} -> {grid[0]}x{grid[1]} grid, {resample})")
            else:
                source = checkpoint.source_keys.get(path, path)
                renamed = f" (as {path!r})" if source != path else ""
                raise ValueError(
                    f"Checkpoint key {source!r} of {checkpoint.source} has shape "
                    f"{tuple(array.shape)}{renamed}; the model expects {expected}.")
        if array is None:
            report.new.append(f"{path} ({_initializer(variable)})")
        else:
            values.append((variable, array))
    for path in arrays:
        if _is_block_norm(path) and not block_norms_fit:
            why = f"norm={norm!r} replaces the {source_norm} layers"
        else:
            why = "the model's config has no such weight"
        report.dropped.append((checkpoint.source_keys.get(path, path), why))
    if strict and (report.new or report.dropped):
        parts = []
        if report.new:
            parts.append(f"missing from the weights: {report.new[0]!r}{_more(report.new)}")
        if report.dropped:
            parts.append(f"in the weights but not in the model: {report.dropped[0][0]!r}"
                         f"{_more(report.dropped)}")
        raise ValueError(
            "The weights do not fit this model's config (" + "; ".join(parts) + "). "
            "Build the model with the config the weights were saved with.")
    for variable, array in values:
        variable.assign(ops.convert_to_tensor(np.asarray(array, "float32"), dtype=variable.dtype))
    return report


def _is_block_norm(path):
    """Block and final norms (what `norm` sets); stem norms are the stem's own."""
    parts = path.split("/")
    layer = parts[-2] if len(parts) >= 2 else ""
    return path.startswith("final_norm/") or (parts[0].startswith("block_")
                                              and layer in ("attn_norm", "mlp_norm"))


def _initializer(variable):
    value = ops.convert_to_numpy(variable)
    if np.all(value == 1):
        return "ones"
    if np.all(value == 0):
        return "zeros"
    return "random init"
