"""Saving and loading preset directories, and weight transfer by variable path.

Weights are stored as a NumPy archive keyed by Keras variable path
(`block_0/attention/qkv/kernel`, ...): plain arrays, readable under every backend,
and addressable by name so that a loader can say which weight does not fit and
resample the position embedding.
"""

import datetime
import os

import keras
import numpy as np
import scipy.ndimage
from keras import ops

from keras_vitnorm import durable
from keras_vitnorm.validation import check_choice
from keras_vitnorm.validation import check_known_keys

from keras_vitnorm.models.presets import PRESETS
from keras_vitnorm.models.presets import preset_config
from keras_vitnorm.ops import backend_name

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.weights.npz"
METADATA_FILE = "metadata.json"
POSITION_EMBEDDING = "stem/position_embedding"
HEAD_PREFIX = "head/"


def weights_by_path(model):
    """Returns `{path: variable}` for every weight of `model`."""
    return {variable.path: variable for variable in model.weights}


#: Every value accepted by `resample`: how a position embedding moves to a new grid.
RESAMPLE_METHODS = ("bilinear", "bicubic")


def resample_position_embedding(
    embedding, source_grid, target_grid, num_prefix_tokens, method="bilinear"
):
    """Resamples a learned `(1, prefix + h*w, D)` position embedding to a new grid.

    The prefix (class token) embedding is kept as is; the `(h, w, D)` grid is
    resampled by one of two references:

    - `"bilinear"` (default): big_vision's `resample_posemb`, used for the Dual
      PatchNorm paper's 384-pixel fine-tuning: `scipy.ndimage.zoom(grid,
      (h'/h, w'/w, 1), order=1)`, linear interpolation with the corner
      patches aligned.
    - `"bicubic"`: timm's `resample_abs_pos_embed` defaults: bicubic
      interpolation with antialiasing (PyTorch's `F.interpolate(...,
      mode="bicubic", antialias=True)`: half-pixel centers, the cubic kernel
      with `a = -0.5`, widened by the downscaling factor), written in NumPy so
      that every backend gives the same values.

    Args:
        embedding: array `(1, num_prefix_tokens + h * w, D)`.
        source_grid: `(h, w)` of `embedding`.
        target_grid: `(h', w')` wanted.
        num_prefix_tokens: int, 1 with a class token, else 0.
        method: str, default `"bilinear"`, one of `RESAMPLE_METHODS`.

    Returns:
        A float32 NumPy array `(1, num_prefix_tokens + h' * w', D)`.
    """
    check_choice("resample", method, RESAMPLE_METHODS)
    embedding = np.asarray(embedding, dtype="float32")
    dim = embedding.shape[-1]
    prefix = embedding[:, :num_prefix_tokens]
    grid = embedding[0, num_prefix_tokens:].reshape(source_grid[0], source_grid[1], dim)
    if method == "bilinear":
        zoom = (target_grid[0] / source_grid[0], target_grid[1] / source_grid[1], 1)
        resized = scipy.ndimage.zoom(grid, zoom, order=1)
    else:
        rows = _antialiased_bicubic_matrix(source_grid[0], target_grid[0])
        columns = _antialiased_bicubic_matrix(source_grid[1], target_grid[1])
        resized = np.einsum("ih,jw,hwd->ijd", rows, columns, grid.astype("float64"))
    if resized.shape[:2] != tuple(target_grid):
        raise ValueError(
            f"Resampling the {source_grid} position-embedding grid gave {resized.shape[:2]}, "
            f"not the {tuple(target_grid)} grid asked for."
        )
    resized = resized.astype("float32").reshape(1, -1, dim)
    return np.concatenate([prefix, resized], axis=1)


def _cubic(x, a=-0.5):
    """The cubic convolution kernel (Keys) with `a = -0.5`, as PIL and PyTorch's antialiasing use."""
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _antialiased_bicubic_matrix(in_size, out_size):
    """`(out_size, in_size)` weights of antialiased bicubic resampling along one axis.

    Output sample `i` sits at `(i + 0.5) * in_size / out_size` in input
    coordinates (half-pixel centers); when downscaling, the kernel is widened
    by the scale factor (antialiasing). Weights are normalized to sum to one.
    """
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


def assign_weights(
    model, arrays, resample_position_embedding_ok=True, new_head_ok=False, resample="bilinear"
):
    """Loads `{path: array}` into `model`, checking every name and shape.

    Args:
        model: a built `ViT`.
        arrays: mapping of variable path to array.
        resample_position_embedding_ok: bool. Resample a position embedding whose
            grid differs instead of failing.
        new_head_ok: bool. Keep the model's own (fresh) head when the stored head
            has another number of classes, instead of failing.
        resample: str, default `"bilinear"`: how a position embedding is
            resampled (`resample_position_embedding`).

    Returns:
        The list of paths that kept their fresh initialization (a new head).

    Raises:
        ValueError: naming the first weight that is missing, unexpected or of the
            wrong shape, with the expected and found shapes.
    """
    targets = weights_by_path(model)
    kept_fresh = []
    if new_head_ok:
        arrays = {k: v for k, v in arrays.items() if not k.startswith(HEAD_PREFIX)}
        kept_fresh = [path for path in targets if path.startswith(HEAD_PREFIX)]
        targets = {k: v for k, v in targets.items() if k not in kept_fresh}
    missing = [path for path in targets if path not in arrays]
    unexpected = [path for path in arrays if path not in targets]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing from the file: {missing[0]!r}" + _more(missing))
        if unexpected:
            parts.append(f"in the file but not in the model: {unexpected[0]!r}" + _more(unexpected))
        raise ValueError(
            "The weights do not fit this model's config (" + "; ".join(parts) + "). "
            "Build the model with the config the weights were saved with."
        )
    values = []
    for path, variable in targets.items():
        array = np.asarray(arrays[path])
        expected = tuple(variable.shape)
        if array.shape != expected:
            if path == POSITION_EMBEDDING and resample_position_embedding_ok:
                array = resample_for_model(model, array, resample)
            else:
                raise ValueError(
                    f"Weight {path!r} does not fit: the model expects shape {expected}, "
                    f"the file has {array.shape}. Build the model with the config the "
                    "weights were saved with."
                )
        values.append((variable, array))
    for variable, array in values:
        variable.assign(array.astype(variable.dtype))
    return kept_fresh


def _more(paths):
    return f" (and {len(paths) - 1} more)" if len(paths) > 1 else ""


def resample_for_model(model, array, method="bilinear"):
    """`array`, a square-grid position embedding, resampled to `model`'s grid by `method`."""
    num_prefix = 1 if model.pooling == "cls" else 0
    stem = model.get_layer("stem")
    target = tuple(stem.pos_embedding.shape)
    source_tokens = array.shape[1] - num_prefix
    side = int(round(source_tokens**0.5))
    if array.ndim != 3 or array.shape[-1] != target[-1] or side * side != source_tokens:
        raise ValueError(
            f"Weight {POSITION_EMBEDDING!r} of shape {array.shape} cannot be resampled to "
            f"{target}: only a square grid of the same width can be."
        )
    return resample_position_embedding(array, (side, side), stem.grid_size, num_prefix, method)





def save_preset(model, directory, overwrite=False):
    """Writes `model`'s config, weights and metadata to `directory`."""
    directory = os.fspath(directory)
    if os.path.exists(os.path.join(directory, CONFIG_FILE)) and not overwrite:
        raise FileExistsError(
            f"{directory!r} already holds a preset ({CONFIG_FILE}). Pass overwrite=True to "
            "replace it, or choose another directory."
        )
    os.makedirs(directory, exist_ok=True)
    from keras_vitnorm import __version__

    # Weights first, config last: a directory with a config.json always has its weights.
    arrays = {path: ops.convert_to_numpy(v) for path, v in weights_by_path(model).items()}
    durable.write_file(os.path.join(directory, WEIGHTS_FILE), lambda path: np.savez(path, **arrays))
    durable.write_json(
        os.path.join(directory, CONFIG_FILE),
        {"class_name": type(model).__name__, "config": model.get_config()},
    )
    durable.write_json(
        os.path.join(directory, METADATA_FILE),
        {
            "keras_vitnorm_version": __version__,
            "keras_version": keras.__version__,
            "backend": backend_name(),
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "parameter_count": int(model.count_params()),
        },
    )


def read_preset_directory(directory):
    """Returns `(config, {path: array})` of a preset directory.

    A missing, truncated or corrupt file is a `ValueError` naming it.
    """
    from keras_vitnorm.convert._common import read_json
    from keras_vitnorm.convert._common import read_npz

    config_path = os.path.join(directory, CONFIG_FILE)
    weights_path = os.path.join(directory, WEIGHTS_FILE)
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise ValueError(
                f"{directory!r} is not a keras_vitnorm preset directory: {os.path.basename(path)} "
                f"is missing. A preset directory holds {CONFIG_FILE} and {WEIGHTS_FILE} "
                "(written by save_to_preset)."
            )
    saved = read_json(config_path)
    config = saved.get("config")
    if saved.get("class_name") != "ViT" or not isinstance(config, dict):
        raise ValueError(
            f"{config_path} is not a keras_vitnorm preset config: it needs 'class_name': 'ViT' "
            f"and a 'config' object (found keys {sorted(saved)})."
        )
    return config, read_npz(weights_path)


def load_preset(cls, preset, overrides, resample="bilinear"):
    """Implements `ViT.from_preset`: a built-in name or a preset directory."""
    preset = os.fspath(preset)
    valid_keys = (*cls.CONFIG_KEYS, "name", "dtype", "trainable")
    check_known_keys(overrides, valid_keys, "override")
    check_choice("resample", resample, RESAMPLE_METHODS)
    if preset in PRESETS and not os.path.isdir(preset):
        return cls(**{**preset_config(preset), **overrides})
    from keras_vitnorm import convert

    if os.path.exists(preset) and convert.is_checkpoint(preset):
        model, _ = convert.load_checkpoint(preset, verbose=True, resample=resample, **overrides)
        return model
    if not os.path.isdir(preset):
        preset_config(preset)  # raises the "unknown preset" error with suggestions
    config, arrays = read_preset_directory(preset)
    check_known_keys(config, valid_keys, f"key in {os.path.join(preset, CONFIG_FILE)}")
    checkpoint = convert.Checkpoint("keras_vitnorm", preset, config, arrays, {k: k for k in arrays})
    model, report = convert.build_from_checkpoint(
        checkpoint, model_class=cls, resample=resample, **overrides
    )
    if report.resampled or report.converted or report.new or report.dropped:
        print(report)
    return model
