"""Named variant groups of the normalization study.

Each group maps variant names to `(model overrides, training overrides)`; the first
variant of a group is its baseline (the one gains are measured against).
"""

from keras_vitnorm.layers._validation import check_choice

_PLACEMENT_VALUES = ("pre", "post", "none")


def _placements():
    variants = {}
    for attn in _PLACEMENT_VALUES:
        for mlp in _PLACEMENT_VALUES:
            variants[f"attn_{attn}-mlp_{mlp}"] = ({"attn_norm": attn, "mlp_norm": mlp}, {})
    return variants


def _depths(depths=(2, 6, 12)):
    variants = {}
    for depth in depths:
        for placement in ("pre", "post"):
            model = {"depth": depth, "attn_norm": placement, "mlp_norm": placement}
            variants[f"{placement}_ln-depth_{depth}"] = (model, {})
            variants[f"{placement}_ln-depth_{depth}-no_warmup"] = (model, {"warmup_steps": 0})
    return variants


#: group name -> {variant name: (model overrides, training overrides)}
VARIANT_GROUPS = {
    "placements": _placements(),
    "block_styles": {
        "pre_ln": ({}, {}),
        "normformer": ({"block_style": "normformer"}, {}),
        "sub_ln": ({"block_style": "sub_ln"}, {}),
        "deepnorm": ({"block_style": "deepnorm", "attn_norm": "post", "mlp_norm": "post"}, {}),
        "pre_post": ({"attn_norm": "pre_post", "mlp_norm": "pre_post"}, {}),
    },
    "norm_types": {
        name: ({"norm": name}, {})
        for name in ("layernorm", "rmsnorm", "dyt", "batchnorm", "groupnorm")
    },
    "stems": {
        "patch": ({"stem": "patch"}, {}),
        "dual_patchnorm": ({"stem": "dual_patchnorm"}, {}),
        "pre_patchnorm": ({"stem": "pre_patchnorm"}, {}),
        "post_patchnorm": ({"stem": "post_patchnorm"}, {}),
        "post_posemb": ({"stem": "post_posemb"}, {}),
        "dpn_rmsnorm": ({"stem": "dual_patchnorm", "stem_norm": "rmsnorm"}, {}),
        "dpn_no_learnable": ({"stem": "dual_patchnorm", "stem_norm_learnable": False}, {}),
        "dpn_only_learnable": ({"stem": "dual_patchnorm", "stem_norm": "affine"}, {}),
        "conv": ({"stem": "conv"}, {}),
    },
    "depth": _depths(),
}


def get_variants(group, names=None):
    """`{variant: (model overrides, training overrides)}` of a group, optionally a subset.

    Args:
        group: a key of `VARIANT_GROUPS`.
        names: optional list of variant names to keep (order kept as given; the
            group's baseline is added first if missing, so gains can be computed).
    """
    check_choice("variant group", group, tuple(VARIANT_GROUPS))
    variants = VARIANT_GROUPS[group]
    if not names:
        return dict(variants)
    for name in names:
        check_choice(f"variant of group {group!r}", name, tuple(variants))
    baseline = next(iter(variants))
    chosen = [baseline] + [name for name in names if name != baseline]
    return {name: variants[name] for name in chosen}
