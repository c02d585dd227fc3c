"""`ablate --variants-file study.toml`: a study's variants written as data, one variant
group checked whole before anything trains (docs/your-norm.md, "The variants file")."""

import dataclasses
import os
import tomllib

from keras_vitnorm.study.lr_sweep import check_rates
from keras_vitnorm.validation import check_known_keys

#: Training settings a variant cannot set: the study sets them for every run.
STUDY_SETTINGS = ("model", "output_dir", "seed", "recipe", "preset", "dataset")


def read_variants_file(path, base):
    """`(group name, {variant: (model overrides, training overrides)}, {variant: its
    lr_sweep})`, the baseline first, each variant checked on top of `base`.

    Raises:
        ValueError: naming the file, variant and key that is missing, unknown or refused.
    """
    try:
        with open(path, "rb") as file:
            content = tomllib.load(file)
    except OSError as error:
        raise ValueError(f"Cannot read the variants file {path}: {error.strerror}.") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"The variants file {path} is not TOML: {error}.") from None
    check_known_keys(content, ("study", "variants"), f"table in {path}")
    study = content.get("study", {})
    check_known_keys(study, ("name", "baseline"), f"key of [study] in {path}")
    name = study.get("name", os.path.splitext(os.path.basename(path))[0])
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{path}: [study] name must be letters, digits and underscores (the "
                         f"group's folder and table name), got {name!r}.")
    variants = content.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise ValueError(f"{path} defines no variants: add a [variants.<name>] table for each, "
                         "one of them the baseline.")
    baseline = study.get("baseline", next(iter(variants)))
    if baseline not in variants:
        raise ValueError(f"{path}: [study] baseline {baseline!r} is not one of its variants "
                         f"({', '.join(variants)}).")
    group, sweeps = {}, {}
    for variant in [baseline, *(v for v in variants if v != baseline)]:
        group[variant] = _variant(path, variant, variants[variant], base)
        if "lr_sweep" in variants[variant]:
            sweeps[variant] = variants[variant]["lr_sweep"]
    return name, group, sweeps


def _variant(path, variant, table, base):
    from keras_vitnorm.models import ViT
    from keras_vitnorm.models.presets import PRESETS
    from keras_vitnorm.models.presets import preset_config
    from keras_vitnorm.models.vit_config import validate_config
    from keras_vitnorm.training import TrainConfig

    where = f"{path}: variant {variant!r}"
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table ([variants.{variant}]).")
    check_known_keys(table, ("model", "train", "lr_sweep"), f"key of variant {variant!r} in {path}")
    model, train = table.get("model", {}), table.get("train", {})
    for key, value in (("model", model), ("train", train)):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {key} must be a table of settings, got {value!r}.")
    check_known_keys(model, ViT.CONFIG_KEYS, f"model key of variant {variant!r} in {path}")
    settable = [field for field in TrainConfig.field_names() if field not in STUDY_SETTINGS]
    check_known_keys(train, settable, f"train key of variant {variant!r} in {path}")
    if "lr_sweep" in table and "learning_rate" in train:
        raise ValueError(f"{where} sets both train.learning_rate and lr_sweep: its rate is "
                         "chosen from the sweep. Give one.")
    try:
        if "lr_sweep" in table:
            check_rates(table["lr_sweep"] if isinstance(table["lr_sweep"], list)
                        else [table["lr_sweep"]])
        config = dataclasses.replace(base, model={**base.model, **model}, **train)
        config.validate()
        # a saved model's config is known only once the run reads it
        if config.preset in PRESETS:
            validate_config({**ViT.default_config(), **preset_config(config.preset),
                             **config.model})
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None
    return model, train
