"""Analysis of ViT training for the normalization study (docs/study.md)."""

from keras_vitnorm.analysis.probes import GradientNormRecorder
from keras_vitnorm.analysis.probes import depth_group
from keras_vitnorm.analysis.probes import group_norms
from keras_vitnorm.analysis.probes import layer_of
from keras_vitnorm.analysis.probes import residual_stream
from keras_vitnorm.analysis.probes import stem_scale_map
from keras_vitnorm.backend import value_and_gradients
