"""Layers of keras_vitnorm: norms, stem, attention, MLP, encoder block."""

from keras_vitnorm.layers.attention import QK_NORM_TYPES
from keras_vitnorm.layers.attention import MultiHeadSelfAttention
from keras_vitnorm.layers.dense import FusedDense
from keras_vitnorm.layers.dense import StandardizedConv2D
from keras_vitnorm.layers.encoder_block import BLOCK_STYLES
from keras_vitnorm.layers.encoder_block import PLACEMENTS
from keras_vitnorm.layers.encoder_block import EncoderBlock
from keras_vitnorm.layers.encoder_block import LayerScale
from keras_vitnorm.layers.encoder_block import default_placements
from keras_vitnorm.layers.encoder_block import deepnorm_alpha
from keras_vitnorm.layers.encoder_block import deepnorm_beta
from keras_vitnorm.layers.encoder_block import sub_ln_gamma
from keras_vitnorm.layers.initializers import FusedKernelInitializer
from keras_vitnorm.layers.mlp import MLP
from keras_vitnorm.layers.normalization import NORM_TYPES
from keras_vitnorm.layers.normalization import STEM_NORM_TYPES
from keras_vitnorm.layers.normalization import Affine
from keras_vitnorm.layers.normalization import BatchNorm
from keras_vitnorm.layers.normalization import DyT
from keras_vitnorm.layers.normalization import LayerNormalization
from keras_vitnorm.layers.normalization import RMSNorm
from keras_vitnorm.layers.normalization import make_norm
from keras_vitnorm.layers.pooling import ClassTokenPooling
from keras_vitnorm.layers.patch_stem import STEM_TYPES
from keras_vitnorm.layers.patch_stem import PatchStem
from keras_vitnorm.layers.patch_stem import patchify
