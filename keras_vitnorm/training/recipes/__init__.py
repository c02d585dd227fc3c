"""Named training recipes: each module holds one `RECIPE` dict of `TrainConfig` fields.

- `small` (the default): a small pre-LN ViT that trains on a CPU.
- `augreg_i1k`: ImageNet-1k as in the Dual PatchNorm paper (AugReg / big_vision).
- `finetune_384`: a trained model fine-tuned at 384x384, as big_vision transfers.
- `vtab_1k`: a trained model fine-tuned on 800 + 200 examples of a task (VTAB-1k).

Each module's docstring gives the command that runs it and where its numbers come from.
"""

import importlib

from keras_vitnorm.choices import RECIPE_NAMES


def get_recipe(name):
    """Returns a copy of the `RECIPE` dict of recipe `name`."""
    from keras_vitnorm.validation import check_choice

    check_choice("recipe", name, RECIPE_NAMES)
    recipe = importlib.import_module(f"{__name__}.{name}").RECIPE
    return {key: dict(value) if isinstance(value, dict) else value for key, value in recipe.items()}
