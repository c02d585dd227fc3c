"""What a run trains and on which devices and processes: its `Plan`; and how the
processes of a run agree on what the first one did.

With several processes (torchrun's on PyTorch, JAX's multi-process runs) the first
one owns the run directory and writes every file; the others train and learn from it
what they need (`first_process_then_all`, `keras_vitnorm.backend`).
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
        """Whether the backend splits each batch among several processes (JAX's), so
        that every batch, evaluation ones too, must be full."""
        return self.process[1] > 1 and self.share[1] == 1

    @property
    def lead(self):
        """Whether this process writes the run's files (the first of several, or the only one)."""
        return self.process[0] == 0


def plan_run(config, data, overrides):
    """The `Plan` of `config` on `data`; the model's `overrides` are checked against the
    preset, and the distribution scope is made (which starts torchrun's process group)."""
    steps_per_epoch = config.steps_per_epoch or data.train.size // config.batch_size
    if steps_per_epoch < 1:
        raise ValueError(
            f"batch_size={config.batch_size} is larger than the training split "
            f"({data.train.size} examples)."
        )
    total_steps = config.steps or config.epochs * steps_per_epoch
    check_warmup(config.warmup_steps, total_steps)
    if config.preset in PRESETS and not os.path.isdir(config.preset):
        validate_config({**ViT.default_config(), **preset_config(config.preset), **overrides})
    scope, replicas = contextlib.nullcontext(), 1
    if config.distribute:
        scope, replicas = distribution.distribution_scope(
            "data" if config.distribute is True else config.distribute)
        if config.batch_size % replicas:
            raise ValueError(
                f"batch_size={config.batch_size} does not split over {replicas} devices; "
                f"use a multiple of {replicas}."
            )
    return Plan(steps_per_epoch, total_steps, overrides, replicas, scope,
                 backend.process_share(), backend.process_index_and_count())


def first_process_then_all(plan, work):
    """Runs `work()` on the first process and returns its result there (`None` on the
    others); its error, if any, is raised on every process, so that none of them waits
    for a first process that has stopped."""
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