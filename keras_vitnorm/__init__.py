"""keras_vitnorm: Vision Transformers where the normalization is a config choice."""

from keras_vitnorm import convert
from keras_vitnorm import layers
from keras_vitnorm.models import PRESETS
from keras_vitnorm.models import ViT
from keras_vitnorm.models import list_presets

__version__ = "0.1.0"
