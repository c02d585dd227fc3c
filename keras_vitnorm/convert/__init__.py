"""Standard ViT checkpoints (Hugging Face, big_vision/AugReg, timm, keras-hub), each read by
its module into a `Checkpoint` for `keras_vitnorm.models.weights` (docs/checkpoints.md)."""

import os

import numpy as np

from keras_vitnorm import hub_handles

from keras_vitnorm.convert import big_vision
from keras_vitnorm.convert import huggingface
from keras_vitnorm.convert import keras_hub
from keras_vitnorm.convert import timm
from keras_vitnorm.convert._common import POSITION_EMBEDDING
from keras_vitnorm.convert._common import Checkpoint
from keras_vitnorm.convert._common import read_json
from keras_vitnorm.convert._common import read_npz
from keras_vitnorm.convert._common import read_tensor_file

FORMATS = ("huggingface", "big_vision", "timm", "keras_hub")


def is_checkpoint(path):
    """Whether `path` looks like a checkpoint this module reads (not a keras_vitnorm preset)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return True
    config = os.path.join(path, "config.json")
    return os.path.isfile(config) and read_json(config).get("class_name") != "ViT"


def read_checkpoint(path, num_heads=None):
    """Reads a checkpoint file, directory or hub handle into a `Checkpoint`, detecting its format;
    `num_heads` for state dicts of a non-standard width that do not record it."""
    path = os.fspath(path)
    if hub_handles.is_handle(path):
        path = hub_handles.resolve(path)
    if os.path.isdir(path):
        if keras_hub.is_keras_hub_directory(path):
            backbone, classifier = keras_hub.read_directory(path)
            return keras_hub.convert(backbone, classifier, source=path)
        if timm.is_timm_directory(path):
            return timm.convert(timm.read_directory(path), source=path, num_heads=num_heads)
        if os.path.isfile(os.path.join(path, "config.json")):
            state, hf_config = huggingface.read_directory(path)
            return huggingface.convert(state, hf_config, source=path)
        raise ValueError(
            f"{path!r} is a directory without config.json: not a Hugging Face model, keras-hub "
            "preset or keras_vitnorm preset directory.")
    if not os.path.exists(path):
        raise ValueError(f"Checkpoint {path!r} does not exist.")
    tensors = read_tensor_file(path)
    if big_vision.is_big_vision_state(tensors):
        return big_vision.convert(tensors, source=path)
    if timm.is_timm_state(tensors):
        return timm.convert(tensors, source=path, num_heads=num_heads)
    if huggingface.is_huggingface_state(tensors):
        config_path = os.path.join(os.path.dirname(path), "config.json")
        hf_config = read_json(config_path) if os.path.isfile(config_path) else None
        return huggingface.convert(tensors, hf_config, source=path, num_heads=num_heads)
    first = min(tensors, default=None)
    found = (f"{first!r} with shape {tuple(np.shape(tensors[first]))}." if first
             else "none (empty file).")
    raise ValueError(
        f"{path!r} is not a ViT checkpoint this project reads. Expected the key "
        f"'{timm.PATCH_KEY}' (timm), '...{huggingface.PATCH_KEY}' (Hugging Face) or "
        f"'embedding/kernel' (big_vision/AugReg); the first key found is {found}")


__all__ = ["Checkpoint", "FORMATS", "is_checkpoint", "read_checkpoint"]
