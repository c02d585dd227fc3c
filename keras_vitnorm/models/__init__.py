from keras_vitnorm.models.presets import PRESETS
from keras_vitnorm.models.presets import list_presets
from keras_vitnorm.models.vit import ViT
