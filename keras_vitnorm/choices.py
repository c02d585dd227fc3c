"""The config vocabulary: every name a string option takes. Imports nothing, so the command
line offers these choices without importing Keras."""

#: `norm`: the block norms (docs/normalization.md gives each one's formula).
NORM_TYPES = ("layernorm", "rmsnorm", "batchnorm", "groupnorm", "dyt", "identity")
#: `stem_norm`: the block norms plus `affine` (only the learnable scale and shift).
STEM_NORM_TYPES = NORM_TYPES + ("affine",)
#: `qk_norm`: the norms whose statistics stay within one head's q or k of one token.
QK_NORM_TYPES = ("layernorm", "rmsnorm", "dyt", "identity")
#: `stem`: the patch embedding and where its norms go.
STEM_TYPES = ("patch", "dual_patchnorm", "pre_patchnorm", "post_patchnorm", "post_posemb", "conv")
#: `attn_norm` and `mlp_norm`: where a block's norms go.
PLACEMENTS = ("pre", "post", "pre_post", "none")
#: `block_style`: the block designs with their own norms and init.
BLOCK_STYLES = ("standard", "normformer", "sub_ln", "deepnorm")
#: `resample`: how a position embedding moves to a new grid.
RESAMPLE_METHODS = ("bilinear", "bicubic")

#: Named training recipes (keras_vitnorm/training/recipes/<name>.py).
RECIPE_NAMES = ("small", "augreg_i1k", "finetune_384", "vtab_1k")
#: Training precision policies.
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
#: Optimizers of the training recipes.
OPTIMIZERS = ("adamw", "sgd")
#: `distribute`: data-parallel, or data-parallel with the kernels sharded too (JAX).
DISTRIBUTIONS = ("data", "fsdp")
#: Random-crop augmentation modes.
CROP_MODES = ("none", "pad", "zoom")
#: `input_pipeline`: tf.data, or Keras' PyDataset without TensorFlow (digits and
#: folders); `auto` is tf.data where TensorFlow is installed.
INPUT_PIPELINES = ("auto", "tf.data", "python")

#: The study's variant groups (keras_vitnorm/study/variants.py defines their variants).
VARIANT_GROUP_NAMES = (
    "placements", "block_styles", "norm_types", "stems", "depth", "converged", "core", "deep",
    "dpn_factors", "dpn_schedule", "depth_stability", "depth_drop_path",
)
