"""keras_vitnorm: Vision Transformers where the normalization is a config choice.

The names load on first use, so `import keras_vitnorm` alone does not import Keras."""

import importlib
import sys

from keras_vitnorm.version import __version__

_EXPORTS = ("ViT", "LiT", "Segmenter", "PRESETS", "list_presets", "load_checkpoint")
_SUBPACKAGES = ("analysis", "convert", "layers", "models", "study", "training")

__all__ = ["__version__", *_EXPORTS, *_SUBPACKAGES]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module("keras_vitnorm.models"), name)
    if name in _SUBPACKAGES:
        return importlib.import_module(f"keras_vitnorm.{name}")
    raise AttributeError(f"module 'keras_vitnorm' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


if "keras" in sys.modules:  # Keras is there already: register the models for `load_model`
    importlib.import_module("keras_vitnorm.models")
