"""Training: datasets, the recipe, `train` and `evaluate` (see docs/training.md), and
`train_segmenter` (docs/segmentation.md) and `train_lit` (docs/contrastive.md)."""

from keras_vitnorm.training.config import TrainConfig
from keras_vitnorm.training.contrastive import LiTConfig
from keras_vitnorm.training.contrastive import train_lit
from keras_vitnorm.training.data import load_dataset
from keras_vitnorm.training.recipes import RECIPE_NAMES
from keras_vitnorm.training.recipes import get_recipe
from keras_vitnorm.training.segmentation import SegmentationConfig
from keras_vitnorm.training.segmentation import train_segmenter
from keras_vitnorm.training.segmentation_data import load_segmentation_data
from keras_vitnorm.training.evaluation import evaluate
from keras_vitnorm.training.fit_loop import TrainingDiverged
from keras_vitnorm.training.interrupts import RunInterrupted
from keras_vitnorm.training.trainer import train
