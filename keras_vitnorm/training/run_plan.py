"""What a run trains and on which devices and processes (its `Plan`); the first process
owns the run directory and the others learn from it (`first_process_then_all`).
"""

import contextlib
import dataclasses
import os

from keras_vitnorm import backend
from keras_vitnorm.models import PRESETS
from keras_vitnorm.models import ViT
from keras_vitnorm.models.presets import preset_config
from keras_vitnorm.models.vit_config import validate_config
from keras_vitnorm.training import distribution
from keras_vitnorm.training.data.augmentation import check_randaugment
from keras_vitnorm.training.optimizer import check_warmup


@dataclasses.dataclass
class Plan:
    """What a run trains: its length, the model's overrides and the devices."""

    steps_per_epoch: int
    total_steps: int
    overrides: dict
    replicas: int
    scope: object
    share: tuple = (0, 1)  # (index, count) of this process's share of each batch it reads
    process: tuple = (0, 1)  # (index, count) of this process among the training processes

    @property
    def processes_split_batches(self):
        """Whether the backend splits each batch among processes (JAX), so that every
        batch, evaluation ones too, must be full."""
        return self.process[1] > 1 and self.share[1] == 1

    @property
    def lead(self):
        """Whether this process writes the run's files (the first of several, or the only one)."""
        return self.process[0] == 0


#: The settings `fit_to_data` fits where the user did not give them.
FITTED_SETTINGS = ("batch_size", "warmup_steps")


def _given(config, name):
    return config.given is None or name in config.given


def fit_to_data(config, train_size):
    """`(config, notes)`: `config` with the recipe's defaults that `train_size` examples
    cannot take fitted to them, a note on each (docs/training.md, "Recipes"); a setting
    the user gave is kept for `plan_run` to refuse."""
    changes, notes = {}, []
    if config.batch_size > train_size and not _given(config, "batch_size"):
        changes["batch_size"] = 1 << (max(train_size, 1).bit_length() - 1)
        notes.append(f"Note: batch size {changes['batch_size']} instead of the recipe's "
                     f"{config.batch_size}, which is more than the {train_size} training "
                     "examples (--batch-size sets it).")
    batch_size = changes.get("batch_size", config.batch_size)
    total = config.steps or config.epochs * (config.steps_per_epoch or train_size // batch_size)
    if config.warmup_steps >= total and not _given(config, "warmup_steps"):
        changes["warmup_steps"] = total // 10
        notes.append(f"Note: {total // 10} warm-up steps instead of the recipe's "
                     f"{config.warmup_steps}, which leave no steps to decay over in the run's "
                     f"{total} (--warmup-steps sets it).")
    return (dataclasses.replace(config, **changes) if changes else config), notes


def plan_run(config, data, overrides):
    """The `Plan` of `config` on `data`; the model's `overrides` are checked against the
    preset, and the distribution scope is made (which starts torchrun's process group)."""
    if config.batch_size > data.train.size:
        raise ValueError(
            f"batch_size={config.batch_size} is more than the {data.train.size} training "
            f"examples of {data.name}: each batch would repeat examples. Pass --batch-size "
            f"{data.train.size} or less.")
    steps_per_epoch = config.steps_per_epoch or data.train.size // config.batch_size
    total_steps = config.steps or config.epochs * steps_per_epoch
    check_warmup(config.warmup_steps, total_steps)
    if config.preset in PRESETS and not os.path.isdir(config.preset):
        validate_config({**ViT.default_config(), **preset_config(config.preset), **overrides})
    if "num_channels" in overrides:  # a saved model's own channels are known once it loads
        check_randaugment(config.randaugment_ops, overrides["num_channels"])
    scope, replicas = contextlib.nullcontext(), 1
    if config.distribute:
        scope, replicas = distribution.distribution_scope(
            "data" if config.distribute is True else config.distribute)
        if config.batch_size % replicas:
            raise ValueError(
                f"batch_size={config.batch_size} does not split over {replicas} devices; "
                f"use a multiple of {replicas}.")
    return Plan(steps_per_epoch, total_steps, overrides, replicas, scope,
                 backend.process_share(), backend.process_index_and_count())


def first_process_then_all(plan, work):
    """Runs `work()` on the first process, returning its result there (`None` on the
    others); its error is raised on every process, so none waits for a stopped one."""
    if plan.process[1] == 1:
        return work()
    result = error = None
    if plan.lead:
        try:
            result = work()
        except (ValueError, OSError, RuntimeError) as caught:  # LockedError is a RuntimeError
            error = caught
    message = backend.from_first_process(None if error is None else str(error))
    if error is not None:
        raise error
    if message is not None:
        raise ValueError(f"The first process stopped: {message}")
    return result