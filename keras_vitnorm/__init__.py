"""keras_vitnorm: Vision Transformers where the normalization is a config choice.

The names below load on first use, so that `import keras_vitnorm` alone (the
`keras-vitnorm` command answering `--help`) does not import Keras and a backend.
When Keras is already imported, as in `import keras` then `import keras_vitnorm`,
everything loads at once, which registers the model classes with Keras:
`keras.saving.load_model` then reloads a saved ViT, Segmenter or LiT.
"""

import importlib
import sys

from keras_vitnorm.version import __version__

#: name -> the module that defines it.
_EXPORTS = {
    "ViT": "keras_vitnorm.models",
    "LiT": "keras_vitnorm.models",
    "Segmenter": "keras_vitnorm.models",
    "PRESETS": "keras_vitnorm.models",
    "list_presets": "keras_vitnorm.models",
    "load_checkpoint": "keras_vitnorm.models",
}
_SUBPACKAGES = ("analysis", "convert", "layers", "models", "study", "training")

__all__ = ["__version__", *_EXPORTS, *_SUBPACKAGES]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBPACKAGES:
        return importlib.import_module(f"keras_vitnorm.{name}")
    raise AttributeError(f"module 'keras_vitnorm' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


if "keras" in sys.modules:
    importlib.import_module("keras_vitnorm.models")
