"""keras_vitnorm: Vision Transformers where the normalization is a config choice."""

from keras_vitnorm import convert
from keras_vitnorm import layers
from keras_vitnorm.models import PRESETS
from keras_vitnorm.models import LiT
from keras_vitnorm.models import Segmenter
from keras_vitnorm.models import ViT
from keras_vitnorm.models import list_presets
from keras_vitnorm.models import load_checkpoint
from keras_vitnorm.version import __version__
