"""The preset registry: standard ViT sizes, each with a Dual PatchNorm twin."""

import difflib

from keras_vitnorm import hub_handles

_SIZES = {
    "ti": {"width": 192, "depth": 12, "mlp_dim": 768, "num_heads": 3},
    "s": {"width": 384, "depth": 12, "mlp_dim": 1536, "num_heads": 6},
    "b": {"width": 768, "depth": 12, "mlp_dim": 3072, "num_heads": 12},
    "l": {"width": 1024, "depth": 24, "mlp_dim": 4096, "num_heads": 16},
}
_SIZE_NAMES = {"ti": "Tiny", "s": "Small", "b": "Base", "l": "Large"}
_BASE = {"image_size": 224, "num_channels": 3, "num_classes": 1000, "pooling": "cls"}


def _build_registry():
    presets = {}
    for size, patch in (("ti", 16), ("s", 16), ("s", 32), ("b", 16), ("b", 32), ("l", 16)):
        name = f"{size}{patch}"
        config = {**_BASE, **_SIZES[size], "patch_size": patch}
        label = f"ViT-{_SIZE_NAMES[size]}/{patch}, 224x224, pre-LN"
        presets[name] = {
            "config": {**config, "stem": "patch"},
            "description": f"{label}, plain patch embedding (the standard ViT layout).",
        }
        presets[f"{name}_dpn"] = {
            "config": {**config, "stem": "dual_patchnorm"},
            "description": f"{label}, Dual PatchNorm stem (LayerNorm before and after "
            "the patch embedding; Kumar et al. 2023).",
        }
    return presets


#: name -> {"config": ViT keyword arguments, "description": str}
PRESETS = _build_registry()


def list_presets():
    """Returns `{name: description}` for every built-in preset."""
    return {name: spec["description"] for name, spec in PRESETS.items()}


def preset_config(name):
    """Returns a copy of the ViT config of a built-in preset; an unknown `name` is a
    `ValueError` naming the close matches and every valid name."""
    if name not in PRESETS:
        close = difflib.get_close_matches(str(name), PRESETS, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"Unknown preset {name!r}, and no preset directory exists at that path.{hint} "
            f"Built-in presets: {', '.join(sorted(PRESETS))}; or a hub handle, "
            f"{hub_handles.HANDLE_FORMS}.")
    return dict(PRESETS[name]["config"])
