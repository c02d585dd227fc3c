"""Named training recipes (docs/training.md, "Recipes"): each module holds one `RECIPE`
dict of `TrainConfig` fields, and its docstring gives its command and sources.
"""

import importlib

from keras_vitnorm.choices import RECIPE_NAMES


def get_recipe(name):
    """Returns a copy of the `RECIPE` dict of recipe `name`."""
    from keras_vitnorm.validation import check_choice

    check_choice("recipe", name, RECIPE_NAMES)
    recipe = importlib.import_module(f"{__name__}.{name}").RECIPE
    return {key: dict(value) if isinstance(value, dict) else value for key, value in recipe.items()}
