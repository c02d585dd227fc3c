"""Training callbacks that Keras core lacks or gets wrong for step-exact, kill-safe runs."""

import glob
import json
import math
import os
import re
import shutil
import time

import keras
import numpy as np

from keras_vitnorm import backend
from keras_vitnorm import durable
from keras_vitnorm.training import run_files

STATE_FILE = "state.json"
ARRAYS_FILE = "state.npz"
_STEP_DIRECTORY = re.compile(r"^step-(\d+)$")


def _step(model):
    return int(keras.ops.convert_to_numpy(model.optimizer.iterations))


def _checkpoints(directory):
    """`{step: path}` of the `step-<N>` directories in `directory`."""
    matches = (_STEP_DIRECTORY.match(name) for name in os.listdir(directory))
    return {int(match.group(1)): os.path.join(directory, match.group(0))
            for match in matches if match}


def training_variables_of(model):
    """The variables of `training_variables(model)`, without their owners."""
    return [variable for _, variable in training_variables(model)]


def training_variables(model):
    """`(owner, variable)` of every variable that decides the next training step, the
    model's then the optimizer's; by position, as seed generators' names vary by process."""
    return ([("model", v) for v in model.variables]
            + [("optimizer", v) for v in model.optimizer.variables])


def save_training_state(model, path, random_state=None):
    """Writes `training_variables(model)` (and `random_state`, if given) to the NumPy
    archive `path`, not a `.weights.h5`: on a full disk Python raises where h5py crashes."""
    variables = training_variables(model)
    arrays = {f"v{i}": keras.ops.convert_to_numpy(v) for i, (_, v) in enumerate(variables)}
    names = np.array([f"{owner}:{variable.path}" for owner, variable in variables])
    if random_state is not None:
        arrays["torch_random_state"] = random_state
    with open(path, "wb") as f:
        np.savez(f, names=names, **arrays)


def read_training_state(model, path):
    """`(values, PyTorch random state or None)` of a `save_training_state` archive,
    checked against a compiled `model`'s `training_variables`; nothing is assigned."""
    model.optimizer.build(model.trainable_variables)
    targets = training_variables(model)
    with np.load(path, allow_pickle=False) as archive:
        arrays = {key: archive[key] for key in archive.files}
    names = list(arrays.pop("names"))
    random_state = arrays.pop("torch_random_state", None)
    if len(names) != len(targets):
        raise ValueError(f"{path} holds {len(names)} variables, this model and optimizer have "
                         f"{len(targets)}: it was saved by another configuration.")
    values = [arrays[f"v{index}"] for index in range(len(targets))]
    for index, (array, (owner, variable)) in enumerate(zip(values, targets)):
        if tuple(array.shape) != tuple(variable.shape):
            raise ValueError(
                f"{path}: variable {index} ({names[index]}) has shape {array.shape}, but "
                f"{owner} variable {variable.path} has shape {tuple(variable.shape)}.")
    return values, random_state


class RunCheckpoint(keras.callbacks.Callback):
    """Saves the whole training state as one unit: `<directory>/step-<N>/`.

    Keras' `BackupAndRestore` restores the epoch only and writes weights and metadata as
    two files (a kill between them pairs weights with the wrong step). Here a checkpoint
    is one directory renamed into place whole (`state.npz`, `state.json`), with PyTorch's
    dropout generator, so masks depend on the step only. Saves at every epoch end and
    every `save_freq` batches; `flush` callables run before each save, `after_save` after.
    """

    def __init__(self, directory, save_freq="epoch"):
        super().__init__()
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int)
                                     or save_freq < 1):
            raise ValueError(f"save_freq must be 'epoch' or a positive int, got {save_freq!r}.")
        self.directory = directory
        self.save_freq = save_freq
        self.flush = []
        self.after_save = []
        self.batch_offset = 0
        self._epoch = 0
        self._batches_done = 0
        self._since_save = 0
        self.random_state = None  # PyTorch's, of the restored or last saved step
        self.seconds_before = 0.0  # of earlier runs; None where a checkpoint lacks them
        self.began = None  # `time.perf_counter()` as this process's training began
        self.saved_step = None

    @staticmethod
    def latest(directory):
        """`(path, state)` of the newest complete checkpoint in `directory`, or `None`;
        leftovers of an interrupted save are removed or put back."""
        if not os.path.isdir(directory):
            return None
        for name in os.listdir(directory):
            if name.startswith(".step-") and name.endswith(".old"):
                # A replacement of the same step cut off: the old copy goes back.
                durable.recover_directory(os.path.join(directory, name[1:-len(".old")]))
        for leftover in glob.glob(os.path.join(directory, ".step-*")):
            shutil.rmtree(leftover, ignore_errors=True)
        for _, path in sorted(_checkpoints(directory).items(), reverse=True):
            state_path = os.path.join(path, STATE_FILE)
            if os.path.isfile(state_path) and os.path.isfile(os.path.join(path, ARRAYS_FILE)):
                try:
                    with open(state_path) as f:
                        state = json.load(f)
                except ValueError as error:
                    raise ValueError(
                        f"Checkpoint state {state_path} is unreadable ({error}).") from error
                if not {"epoch", "batch", "step"} <= set(state):
                    raise ValueError(f"{state_path} is not a keras-vitnorm checkpoint state "
                                     f"(keys {sorted(state)}); cannot resume from it.")
                return path, state
        return None

    def restore(self, model, path, assign=True):
        """Loads a checkpoint's variables into a compiled `model` (and its random state);
        with `assign=False` returns them instead, in `training_variables` order."""
        arrays = os.path.join(path, ARRAYS_FILE)
        try:
            values, self.random_state = read_training_state(model, arrays)
        except Exception as error:
            raise ValueError(
                f"Checkpoint {arrays} cannot be loaded into this run ({error}). Delete the "
                f"checkpoint directory {path} to resume from the one before it.") from error
        if not assign:
            return values
        for variable, value in zip(training_variables_of(model), values):
            variable.assign(value)

    def train_seconds(self):
        """Training seconds of every step so far, earlier runs' included (`None`: unknown)."""
        if self.seconds_before is None or self.began is None:
            return None
        return round(self.seconds_before + time.perf_counter() - self.began, 2)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._batches_done = self.batch_offset

    def on_train_batch_begin(self, batch, logs=None):
        if self.random_state is not None:
            backend.set_global_random_state(self.random_state)

    def on_train_batch_end(self, batch, logs=None):
        self.random_state = backend.global_random_state()
        self._batches_done = self.batch_offset + batch + 1
        if self.save_freq != "epoch":
            self._since_save += 1
            if self._since_save >= self.save_freq:
                self.save()

    def on_epoch_end(self, epoch, logs=None):
        self._epoch = epoch + 1
        self._batches_done = 0
        self.batch_offset = 0
        self.save()

    def save_if_new(self):
        """Writes the checkpoint of the current step unless it is written already."""
        if _step(self.model) != self.saved_step:
            self.save()

    def save(self):
        """Writes `step-<N>/` for the current state and deletes the older checkpoints."""
        self._since_save = 0
        for flush in self.flush:
            flush()
        step = _step(self.model)
        state = {"epoch": self._epoch, "batch": self._batches_done, "step": step,
                 "train_seconds": self.train_seconds()}
        final = os.path.join(self.directory, f"step-{step:09d}")
        previous = RunCheckpoint.latest(self.directory)
        safe = (f"The checkpoint {previous[0]} (step {previous[1]['step']}) is intact."
                if previous else "No earlier checkpoint exists.")

        def write(temporary):
            os.makedirs(temporary)
            durable.fault_point("checkpoint:begin")
            save_training_state(self.model, os.path.join(temporary, ARRAYS_FILE),
                                self.random_state)
            durable.fault_point("checkpoint:weights")
            durable.write_json(os.path.join(temporary, STATE_FILE), state)

        with run_files.storage_errors(final, safe):
            os.makedirs(self.directory, exist_ok=True)
            # One of the same step (an epoch end after a backup) is replaced whole too.
            durable.write_directory(final, write, stage="checkpoint:state")
        self.saved_step = step
        durable.fault_point("checkpoint:renamed")
        for after_save in self.after_save:
            after_save()
        for old, path in _checkpoints(self.directory).items():
            if old != step:
                shutil.rmtree(path, ignore_errors=True)


class PresetCheckpoint(keras.callbacks.Callback):
    """Saves the model as a preset directory at the end of epochs, renamed into place
    whole (a kill leaves the previous one); with `monitor`, only when that value beats
    the best so far, starting from `initial_best`."""

    def __init__(self, path, monitor=None, initial_best=None, stage="preset-checkpoint"):
        super().__init__()
        self.path = path
        self.monitor = monitor
        self.best = -math.inf if initial_best is None else initial_best
        self.stage = stage

    def on_epoch_end(self, epoch, logs=None):
        if self.monitor is not None:
            value = (logs or {}).get(self.monitor)
            if value is None or not value > self.best:
                return
            self.best = float(value)
        with run_files.storage_errors(self.path, "The run's checkpoint is unaffected."):
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            durable.write_directory(self.path, self.model.save_to_preset, stage=self.stage)


class ScaleLog(keras.callbacks.Callback):
    """Multiplies the epoch log `key` by `factor` for the callbacks after it (a padded
    validation split's loss, `data.eval_dataset(pad=True)`)."""

    def __init__(self, key, factor):
        super().__init__()
        self.key = key
        self.factor = factor

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and self.key in logs and self.factor != 1.0:
            logs[self.key] = logs[self.key] * self.factor


class LossIsNaN(RuntimeError):
    """Raised by `StopOnNaN` out of `fit`."""


class StopOnNaN(keras.callbacks.Callback):
    """Raises `LossIsNaN` at the first non-finite loss, so nothing saves after it (Keras'
    `TerminateOnNaN` ends the epoch, whose checkpoints save NaN weights); records `step`,
    `epoch` and `batch` (1-based). `agree(flag)` makes all processes stop together."""

    def __init__(self, agree=None):
        super().__init__()
        self.agree = agree
        self.step = None
        self.epoch = None
        self.batch = None
        self.batch_offset = 0
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        bad = loss is not None and not math.isfinite(float(loss))
        if self.agree is not None:
            bad = self.agree(bad)
        if not bad:
            return
        self.step = _step(self.model)
        self.epoch = self._epoch + 1
        self.batch = self.batch_offset + batch + 1
        raise LossIsNaN(f"loss {loss} at step {self.step}")
