"""`load_checkpoint`: a `ViT` from a standard checkpoint of any format the project reads."""

from keras_vitnorm.models import weights
from keras_vitnorm.models.vit import ViT


def load_checkpoint(path, verbose=False, num_heads=None, resample="bilinear", model_class=ViT,
                    **overrides):
    """Builds a `ViT` from a standard checkpoint; returns `(model, ConversionReport)`.

    Args:
        path: see `read_checkpoint`.
        verbose: bool, default `False`. Print the report.
        num_heads: int, only for state dicts that do not record their head count.
        resample: str, default `"bilinear"` (big_vision) or `"bicubic"` (timm): how a
            new `image_size` resamples the position embedding.
        model_class: the class to build, default `ViT` (a subclass keeps its own).
        **overrides: `ViT` config values that replace the checkpoint's: `image_size`,
            `num_classes`, and any normalization setting (`stem`, `norm`, `attn_norm`,
            `mlp_norm`, `block_style`, `layer_scale`, `qk_norm`, ...).

    Example:
    >>> model, report = load_checkpoint("vit_small_patch16_224.safetensors",
    ...                                 stem="dual_patchnorm", num_classes=10)
    """
    return weights.read_and_build(path, model_class, verbose=verbose, num_heads=num_heads,
                                  resample=resample, **overrides)
