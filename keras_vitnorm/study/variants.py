"""Named variant groups of the normalization study (docs/study.md, "Variant groups"):
variant names to `(model overrides, training overrides)`, the first the baseline."""

from keras_vitnorm.validation import check_choice


def _placements(values=("pre", "post", "none")):
    return {f"attn_{attn}-mlp_{mlp}": ({"attn_norm": attn, "mlp_norm": mlp}, {})
            for attn in values for mlp in values}


def _depths(depths=(2, 6, 12)):
    variants = {}
    for depth in depths:
        for placement in ("pre", "post"):
            model = {"depth": depth, "attn_norm": placement, "mlp_norm": placement}
            variants[f"{placement}_ln-depth_{depth}"] = (model, {})
            variants[f"{placement}_ln-depth_{depth}-no_warmup"] = (model, {"warmup_steps": 0})
    return variants


#: Training-set sizes and patch sizes of the `dpn_factors` group.
DPN_TRAIN_SIZES = (2500, 10000, 40000)
DPN_PATCH_SIZES = (4, 8)
_DPN_BASE_SIZE = 10000


#: The paper's Table 6 stem ablations of Dual PatchNorm (its two LayerNorms are LN_0
#: on the flattened patches and LN_1 on the embeddings): stem name -> model overrides.
DPN_ABLATIONS = {
    "pre_patchnorm": {"stem": "pre_patchnorm"},  # "Pre": LN_0 only
    "post_patchnorm": {"stem": "post_patchnorm"},  # "Post": LN_1 only
    # "Only learnable": both norms a learned scale and shift, no standardization
    "dpn_only_learnable": {"stem": "dual_patchnorm", "stem_norm": "affine"},
    # "No learnable": both norms standardize only
    "dpn_no_learnable": {"stem": "dual_patchnorm", "stem_norm_learnable": False},
    "dpn_rmsnorm": {"stem": "dual_patchnorm", "stem_norm": "rmsnorm"},  # RMSNorm in both
}


#: The two stems every DPN factor level compares: name prefix -> model overrides.
_DPN_STEMS = {"patch": {"stem": "patch"}, "dpn": {"stem": "dual_patchnorm"}}


def _dpn_factors():
    """Plain stem against Dual PatchNorm by training-set and patch size, with `DPN_ABLATIONS`."""
    variants, factors = {}, {}

    def add(stem, model, patch, size):
        name = f"{stem}-p{patch}-n{size}"
        variants[name] = ({**model, "patch_size": patch}, {"train_examples": size})
        factors[name] = {"stem": stem, "patch_size": patch, "train_examples": size}

    for size in DPN_TRAIN_SIZES:
        for stem, model in _DPN_STEMS.items():
            add(stem, model, DPN_PATCH_SIZES[0], size)
    for patch in DPN_PATCH_SIZES[1:]:
        for stem, model in _DPN_STEMS.items():
            add(stem, model, patch, _DPN_BASE_SIZE)
    for stem, model in DPN_ABLATIONS.items():
        add(stem, model, DPN_PATCH_SIZES[0], _DPN_BASE_SIZE)
    return variants, factors


#: Schedule lengths (training steps) of the `dpn_schedule` group; the shortest is
#: `dpn_factors`'s, whose runs at the same level it shares.
DPN_SCHEDULE_STEPS = (3000, 12000)


def _dpn_schedule():
    """Plain stem against Dual PatchNorm by schedule length, at `dpn_factors`'s base
    level: whether DPN's deficit on short schedules closes as training goes on."""
    variants, factors = {}, {}
    for steps in DPN_SCHEDULE_STEPS:
        for stem, model in _DPN_STEMS.items():
            name = f"{stem}-s{steps}"
            # a length in steps replaces a base given in epochs
            variants[name] = ({**model, "patch_size": DPN_PATCH_SIZES[0]},
                              {"train_examples": _DPN_BASE_SIZE, "steps": steps, "epochs": None})
            factors[name] = {"stem": stem, "patch_size": DPN_PATCH_SIZES[0],
                             "train_examples": _DPN_BASE_SIZE, "steps": steps}
    return variants, factors


#: The factors a stem group varies besides the stem: (factor, table column, cell
#: format, format in words).
LEVEL_COLUMNS = (
    ("patch_size", "patch size", "{}", "patch {}"),
    ("train_examples", "training images", "{:,}", "{:,} images"),
    ("steps", "training steps", "{:,}", "{:,} steps"),
)


def level_text(level):
    """A level in words, e.g. `"patch 4, 10,000 images, 12,000 steps"`."""
    return ", ".join(words.format(level[key]) for key, _, _, words in LEVEL_COLUMNS if key in level)


#: Depths, placements and warm-up of the `depth_stability` group.
DEPTHS = (6, 12, 24)
_DEPTH_PLACEMENTS = {
    "pre_ln": {},
    "post_ln": {"attn_norm": "post", "mlp_norm": "post"},
    "deepnorm": {"block_style": "deepnorm"},
}


def _depth_stability():
    """Pre-LN, post-LN and DeepNorm at each depth, with the base's warm-up and without."""
    variants, factors = {}, {}
    for placement, model in _DEPTH_PLACEMENTS.items():
        for depth in DEPTHS:
            for warmup in (True, False):
                name = f"{placement}-depth_{depth}" + ("" if warmup else "-no_warmup")
                variants[name] = ({**model, "depth": depth}, {} if warmup else {"warmup_steps": 0})
                factors[name] = {"placement": placement, "depth": depth, "warmup": warmup}
    return variants, factors


def _deep(depth=12):
    """Pre-LN, post-LN and DeepNorm at `depth`, with the base's warm-up: post-LN given its
    best chance against the two that train at depth."""
    variants, factors = {}, {}
    for placement, model in _DEPTH_PLACEMENTS.items():
        variants[placement] = ({"depth": depth, **model}, {})
        factors[placement] = {"placement": placement, "depth": depth, "warmup": True}
    return variants, factors


def _depth_drop_path(depth=DEPTHS[-1], rate=0.1):
    """The deepest models with and without stochastic depth; those without leave
    `drop_path` unset, so they share `depth_stability`'s runs."""
    variants, factors = {}, {}
    for placement, model in _DEPTH_PLACEMENTS.items():
        for drop_path in (0.0, rate):
            name = f"{placement}-depth_{depth}" + (f"-drop_path_{rate}" if drop_path else "")
            variants[name] = ({**model, "depth": depth},
                              {"drop_path": drop_path} if drop_path else {})
            factors[name] = {"placement": placement, "depth": depth, "drop_path": drop_path}
    return variants, factors


#: group name -> (variants, factor levels) of the groups built over factors
_FACTOR_GROUPS = {"deep": _deep(), "dpn_factors": _dpn_factors(), "dpn_schedule": _dpn_schedule(),
                  "depth_stability": _depth_stability(), "depth_drop_path": _depth_drop_path()}

#: group name -> {variant name: (model overrides, training overrides)}
VARIANT_GROUPS = {
    "placements": _placements(),
    "block_styles": {
        "pre_ln": ({}, {}),
        "normformer": ({"block_style": "normformer"}, {}),
        "sub_ln": ({"block_style": "sub_ln"}, {}),
        "deepnorm": ({"block_style": "deepnorm"}, {}),
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
    # The converged CIFAR-10 comparison: one change each against pre-LN LayerNorm.
    "converged": {
        "pre_ln": ({}, {}),
        "dual_patchnorm": ({"stem": "dual_patchnorm"}, {}),
        "post_ln": ({"attn_norm": "post", "mlp_norm": "post"}, {}),
        # post-LN made trainable at depth (alpha-weighted residual, beta-scaled init)
        "deepnorm": ({"block_style": "deepnorm"}, {}),
        "conv_stem": ({"stem": "conv"}, {}),
        "rmsnorm": ({"norm": "rmsnorm"}, {}),
        "dyt": ({"norm": "dyt"}, {}),
        "batchnorm": ({"norm": "batchnorm"}, {}),
    },
    # The CPU Imagenette study's nine (recipes/imagenette_study.sh, `cpu`): the converged
    # group's eight and, after post-LN, Peri-LN (a norm before and after each sublayer,
    # the identity path untouched: Sandwich-LN, Peri-LN).
    "core": {
        "pre_ln": ({}, {}),
        "dual_patchnorm": ({"stem": "dual_patchnorm"}, {}),
        "post_ln": ({"attn_norm": "post", "mlp_norm": "post"}, {}),
        "peri_ln": ({"attn_norm": "pre_post", "mlp_norm": "pre_post"}, {}),
        "deepnorm": ({"block_style": "deepnorm"}, {}),
        "conv_stem": ({"stem": "conv"}, {}),
        "rmsnorm": ({"norm": "rmsnorm"}, {}),
        "dyt": ({"norm": "dyt"}, {}),
        "batchnorm": ({"norm": "batchnorm"}, {}),
    },
    **{group: variants for group, (variants, _) in _FACTOR_GROUPS.items()},
}

#: group -> (plain-stem variant, Dual PatchNorm variant) compared by the stem analyses
#: (gradient norms, the learned scale of the first stem norm).
STEM_PAIRS = {
    "stems": ("patch", "dual_patchnorm"),
    "converged": ("pre_ln", "dual_patchnorm"),
    "core": ("pre_ln", "dual_patchnorm"),
    "dpn_factors": ("patch-p4-n10000", "dpn-p4-n10000"),
    "dpn_schedule": ("patch-s12000", "dpn-s12000"),
}


#: group name -> {variant name: {factor: level}} for the groups built over factors.
VARIANT_FACTORS = {group: levels for group, (_, levels) in _FACTOR_GROUPS.items()}


def variant_factors(group, name):
    """`{factor: level}` of a variant of a factor group; `{}` for the other groups."""
    return dict(VARIANT_FACTORS.get(group, {}).get(name, {}))


#: Groups read from variants files in this process (`add_variant_group`).
FILE_GROUPS = {}


def add_variant_group(name, variants):
    """Makes `variants` the group `name`, as a variants file defines one."""
    if name in VARIANT_GROUPS:
        raise ValueError(f"A variants file's group cannot be named {name!r}: that is a built-in "
                         "group. Set another [study] name.")
    FILE_GROUPS[name] = dict(variants)


def get_variants(group, names=None):
    """`{variant: (model overrides, training overrides)}` of a group, or of its `names`
    (order kept) with the baseline first."""
    groups = {**VARIANT_GROUPS, **FILE_GROUPS}
    check_choice("variant group", group, tuple(groups))
    variants = groups[group]
    if not names:
        return dict(variants)
    for name in names:
        check_choice(f"variant of group {group!r}", name, tuple(variants))
    baseline = next(iter(variants))
    chosen = [baseline] + [name for name in names if name != baseline]
    return {name: variants[name] for name in chosen}
