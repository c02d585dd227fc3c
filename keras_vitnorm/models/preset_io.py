"""Preset directories: the config, and the weights as a NumPy archive keyed by variable path
that every backend reads, loaded by the same transfer engine as a foreign checkpoint."""

import datetime
import os

import keras
import numpy as np
from keras import ops

from keras_vitnorm import durable
from keras_vitnorm import hub_handles
from keras_vitnorm.convert import Checkpoint
from keras_vitnorm.convert import is_checkpoint
from keras_vitnorm.convert import read_json
from keras_vitnorm.convert import read_npz
from keras_vitnorm.models import weights as weights_lib
from keras_vitnorm.models.presets import PRESETS
from keras_vitnorm.models.presets import preset_config
from keras_vitnorm.ops import backend_name
from keras_vitnorm.validation import check_choice
from keras_vitnorm.validation import check_directory_path
from keras_vitnorm.version import __version__

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.weights.npz"
METADATA_FILE = "metadata.json"


def save_preset(model, directory, overwrite=False):
    """Writes `model`'s config, weights and metadata to `directory`."""
    directory = check_directory_path(directory, "preset directory")
    if os.path.exists(os.path.join(directory, CONFIG_FILE)) and not overwrite:
        raise FileExistsError(
            f"{directory!r} already holds a preset ({CONFIG_FILE}). Pass overwrite=True to "
            "replace it, or choose another directory.")
    os.makedirs(directory, exist_ok=True)

    # Weights first, config last: a directory with a config.json always has its weights.
    arrays = {path: ops.convert_to_numpy(v) for path, v in model.weights_by_path().items()}
    durable.write_file(os.path.join(directory, WEIGHTS_FILE), lambda path: np.savez(path, **arrays))
    durable.write_json(os.path.join(directory, CONFIG_FILE),
                       {"class_name": type(model).__name__, "config": model.get_config()})
    durable.write_json(os.path.join(directory, METADATA_FILE), {
        "keras_vitnorm_version": __version__, "keras_version": keras.__version__,
        "backend": backend_name(), "parameter_count": int(model.count_params()),
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat()})


def read_preset_directory(directory):
    """`(config, {path: array})` of a preset directory; a missing or damaged file is a
    `ValueError` naming it."""
    config_path = os.path.join(directory, CONFIG_FILE)
    weights_path = os.path.join(directory, WEIGHTS_FILE)
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            names = os.listdir(directory) if os.path.isdir(directory) else []
            inside = sorted(name for name in names
                            if os.path.isfile(os.path.join(directory, name, CONFIG_FILE)))
            hint = (f" Its folder {os.path.join(directory, inside[0])!r} holds one (a training "
                    "run's final model is its preset/)." if inside else "")
            raise ValueError(
                f"{directory!r} is not a keras_vitnorm preset directory: {os.path.basename(path)} "
                f"is missing. A preset directory holds {CONFIG_FILE} and {WEIGHTS_FILE} "
                f"(written by save_to_preset).{hint}")
    saved = read_json(config_path)
    config = saved.get("config")
    if saved.get("class_name") != "ViT" or not isinstance(config, dict):
        raise ValueError(
            f"{config_path} is not a keras_vitnorm preset config: it needs 'class_name': 'ViT' "
            f"and a 'config' object (found keys {sorted(saved)}).")
    return config, read_npz(weights_path)


def load_preset(cls, preset, overrides, resample="bilinear"):
    """Implements `ViT.from_preset`: a built-in name, a preset directory or a checkpoint."""
    preset = os.fspath(preset)
    weights_lib.check_overrides(cls, overrides)
    check_choice("resample", resample, weights_lib.RESAMPLE_METHODS)
    if hub_handles.is_handle(preset):
        preset = hub_handles.resolve(preset)
    if preset in PRESETS and not os.path.isdir(preset):
        return cls(**{**preset_config(preset), **overrides})
    if os.path.exists(preset) and is_checkpoint(preset):
        model, _ = weights_lib.read_and_build(preset, cls, verbose=True, resample=resample,
                                              **overrides)
        return model
    if not os.path.isdir(preset):
        preset_config(preset)  # raises the "unknown preset" error with suggestions
    config, arrays = read_preset_directory(preset)
    weights_lib.check_overrides(cls, config, f"key in {os.path.join(preset, CONFIG_FILE)}")
    checkpoint = Checkpoint("keras_vitnorm", preset, config, arrays, {k: k for k in arrays})
    # Unless an override changes the model, the file must hold exactly its weights (a
    # damaged archive is an error, not a fresh init); `pixel_range` changes no weight.
    changes = {key: value for key, value in overrides.items()
               if key != "pixel_range" and (key not in config or config[key] != value)}
    try:
        model, report = weights_lib.build_from_checkpoint(checkpoint, cls, resample=resample,
                                                          strict=not changes, **overrides)
    except ValueError as error:
        raise ValueError(f"Preset {preset!r}: {error}") from error
    if not changes and report.resampled:  # saved for another image size than its config's
        raise ValueError(
            f"Preset {preset!r}: its weights do not fit its config.json: they hold a position "
            f"embedding of another grid ({report.resampled[0]}) than its "
            f"image_size={config.get('image_size')} makes. A preset holds "
            "its own model's weights; pass image_size=<the size they were saved for> to load "
            "them, or another size to resample them on purpose.")
    if report.resampled or report.converted or report.new or report.dropped:
        print(report)
    return model
