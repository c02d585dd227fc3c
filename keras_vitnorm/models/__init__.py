from keras_vitnorm.models.presets import PRESETS
from keras_vitnorm.models.presets import list_presets
from keras_vitnorm.models.vit import ViT
from keras_vitnorm.models.weights import ConversionReport
from keras_vitnorm.models.weights import build_from_checkpoint
from keras_vitnorm.models.weights import load_checkpoint
from keras_vitnorm.models.weights import transfer
