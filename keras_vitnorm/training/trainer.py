"""`train` and `evaluate`: the main job, built on `model.fit` and Keras callbacks.

A run directory holds:

    run.lock                 the owning process (pid, host) while it runs
    train_config.json        the settings (a resumed run must match them)
    log.csv                  one row per epoch (CSVLogger)
    grad_norms.csv           per-layer gradient norms (with grad_norm_every)
    tensorboard/             TensorBoard logs
    checkpoints/best/, checkpoints/last/   presets of the best-validation and the
                             latest epoch-end model
    backup/step-<N>/         the last training state (weights, optimizer, position)
                             while the run is unfinished
    preset/                  the final model (`ViT.save_to_preset`)
    metrics.json             status, final validation and test accuracy, timings

Every file is written under a temporary name and renamed into place; the order of the
final writes (preset, then metrics.json, then the checkpoint is deleted) means a kill at
any moment leaves a run that `--resume` finishes with the same weights (docs/training.md,
"What survives a crash").
"""

import contextlib
import csv
import dataclasses
import datetime
import importlib.util
import io
import math
import os
import shutil
import time

import keras
import numpy as np

from keras_vitnorm import backend
from keras_vitnorm.analysis.probes import GradientNormRecorder
from keras_vitnorm.models import PRESETS
from keras_vitnorm.models import ViT
from keras_vitnorm.models.presets import preset_config
from keras_vitnorm.models.vit_config import validate_config
from keras_vitnorm.training import callbacks as callbacks_lib
from keras_vitnorm.training import data as data_lib
from keras_vitnorm.training import distribution
from keras_vitnorm import durable
from keras_vitnorm.training import run_files
from keras_vitnorm.training.config import names_trained_model
from keras_vitnorm.training.config import setting_changes


class TrainingDiverged(RuntimeError):
    """Raised when the training loss becomes NaN or infinite; `.step` says when."""

    def __init__(self, message, step):
        super().__init__(message)
        self.step = step


def decayed_variables(model):
    """The variables AdamW decays: kernels only (as big_vision's `.*/kernel$`).

    Norm scales and offsets, biases, DyT's alpha, LayerScale and head gains, the
    position embedding and the class token are not decayed.
    """
    return [v for v in model.trainable_variables if v.name == "kernel"]


def _check_warmup(warmup_steps, total_steps):
    if warmup_steps >= total_steps:
        raise ValueError(
            f"warmup_steps={warmup_steps} leaves no steps to decay over: the run has "
            f"{total_steps} steps. Pass a smaller --warmup-steps (or train longer)."
        )


def make_optimizer(config, total_steps, model):
    """The optimizer a `TrainConfig` names (`adamw` or `sgd_momentum`) with its settings."""
    if config.optimizer == "sgd":
        return sgd_momentum(
            model, total_steps, config.learning_rate, warmup_steps=config.warmup_steps,
            momentum=0.9 if config.momentum is None else config.momentum,
            weight_decay=config.weight_decay, min_learning_rate=config.min_learning_rate,
            grad_clip=config.grad_clip,
        )
    return adamw(
        model, total_steps, config.learning_rate, warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay, min_learning_rate=config.min_learning_rate,
        beta_1=config.beta_1, beta_2=config.beta_2, grad_clip=config.grad_clip,
    )


def warmup_cosine(learning_rate, total_steps, warmup_steps=0, min_learning_rate=0.0):
    """Linear warm-up from 0 to `learning_rate`, then cosine decay to `min_learning_rate`."""
    _check_warmup(warmup_steps, total_steps)
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0 if warmup_steps else learning_rate,
        decay_steps=total_steps - warmup_steps,
        alpha=min_learning_rate / learning_rate,
        warmup_target=learning_rate if warmup_steps else None,
        warmup_steps=warmup_steps,
    )


def adamw(model, total_steps, learning_rate, warmup_steps=0, weight_decay=0.0, min_learning_rate=0.0,
          beta_1=0.9, beta_2=0.999, grad_clip=0.0):
    """AdamW on `warmup_cosine`, kernel-only weight decay, global-norm clipping."""
    optimizer = keras.optimizers.AdamW(
        learning_rate=warmup_cosine(learning_rate, total_steps, warmup_steps, min_learning_rate),
        weight_decay=weight_decay,
        beta_1=beta_1,
        beta_2=beta_2,
        global_clipnorm=grad_clip or None,
    )
    return _decay_kernels_only(optimizer, model)


def sgd_momentum(model, total_steps, learning_rate, warmup_steps=0, momentum=0.9, weight_decay=0.0,
                 min_learning_rate=0.0, grad_clip=0.0):
    """SGD with momentum on `warmup_cosine` (big_vision's fine-tuning optimizer), clipping."""
    optimizer = keras.optimizers.SGD(
        learning_rate=warmup_cosine(learning_rate, total_steps, warmup_steps, min_learning_rate),
        momentum=momentum,
        weight_decay=weight_decay or None,
        global_clipnorm=grad_clip or None,
    )
    return _decay_kernels_only(optimizer, model) if weight_decay else optimizer


def _decay_kernels_only(optimizer, model):
    decayed = {id(v) for v in decayed_variables(model)}
    optimizer.exclude_from_weight_decay(
        var_list=[v for v in model.trainable_variables if id(v) not in decayed]
    )
    return optimizer


def plan_segments(total_steps, steps_per_epoch, start_epoch=0, batches_done=0):
    """Splits the remaining training into `fit` calls of whole epochs.

    Returns `[(initial_epoch, epochs, steps_per_epoch, batch_offset), ...]`: the rest
    of an interrupted epoch (if `batches_done`), the full epochs, then a shorter last
    epoch if `total_steps` is not a multiple of `steps_per_epoch`.
    """
    epochs = math.ceil(total_steps / steps_per_epoch)
    last = total_steps - (epochs - 1) * steps_per_epoch

    def length(epoch):
        return last if epoch == epochs - 1 else steps_per_epoch

    segments = []
    epoch = start_epoch
    if batches_done and epoch < epochs:
        segments.append((epoch, epoch + 1, length(epoch) - batches_done, batches_done))
        epoch += 1
    full_end = epochs if last == steps_per_epoch else epochs - 1
    if epoch < full_end:
        segments.append((epoch, full_end, steps_per_epoch, 0))
        epoch = full_end
    if epoch < epochs:
        segments.append((epoch, epochs, length(epoch), 0))
    return segments


def _model_overrides(config, data):
    overrides = {"num_classes": data.num_classes, **config.model}
    if not names_trained_model(config.preset):
        # A built-in preset takes the dataset's channels; a saved model keeps its own
        # (the pipeline converts grayscale and RGB to what the model expects).
        overrides.setdefault("num_channels", data.channels)
    if config.drop_path is not None:
        overrides["drop_path_rate"] = config.drop_path
    unknown = sorted(set(overrides) - set(ViT.CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"Unknown model setting(s) {unknown}. Valid: {', '.join(ViT.CONFIG_KEYS)}."
        )
    return overrides


def describe_model(config):
    """The preset and the model settings the run changes in it (the recipe's and the
    given ones), as the line that opens a run names them: `"s16_dpn with depth=6, ..."`."""
    changes = ", ".join(f"{key}={value}" for key, value in sorted(config.model.items()))
    return f"{config.preset} with {changes}" if changes else str(config.preset)


def _default_output_dir(config):
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    preset = os.path.basename(os.path.normpath(config.preset))
    dataset = config.dataset.replace(":", "-").replace(os.sep, "_").strip("_")
    return os.path.join("runs", f"{preset}-{dataset}-{stamp}")


LOCK_FILE = "run.lock"
SETTINGS_FILE = "train_config.json"
METRICS_FILE = "metrics.json"


def _contents(output_dir):
    """The entries of `output_dir` other than its lock file."""
    if not os.path.isdir(output_dir):
        return []
    return [entry for entry in os.listdir(output_dir) if entry != LOCK_FILE]


def _prepare_output_dir(config, output_dir, resume, overwrite):
    """Checks (and for a new run, writes) the run directory; the caller holds its lock."""
    if resume and overwrite:
        raise ValueError("Give at most one of resume and overwrite.")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise FileExistsError(f"Output path {output_dir} exists and is not a directory.")
    settings = os.path.join(output_dir, SETTINGS_FILE)
    contents = _contents(output_dir)
    is_run = os.path.isfile(settings)
    if contents and resume:
        if not is_run:
            raise ValueError(
                f"Cannot resume: {output_dir} has no {SETTINGS_FILE}, so it is not a "
                "keras-vitnorm run directory."
            )
        metrics = durable.read_json(os.path.join(output_dir, METRICS_FILE))
        if metrics and metrics.get("status") == "completed":
            raise ValueError(f"Cannot resume: the run in {output_dir} already completed.")
        if metrics and metrics.get("status") == "diverged":
            raise ValueError(
                f"Cannot resume: the run in {output_dir} diverged at step "
                f"{metrics.get('diverged_at_step')}; start a new run (e.g. a lower learning rate)."
            )
        saved = durable.read_json(settings)
        current = {**config.to_dict(), "output_dir": saved.get("output_dir")}
        details = setting_changes(saved, current)
        if details:
            raise ValueError(
                f"Cannot resume {output_dir} with different settings ({details}). "
                "Resume with the same command, or start a new run."
            )
        return
    if contents and not overwrite:
        raise FileExistsError(
            f"Output directory {output_dir} already exists and is not empty. Pass "
            "--resume to continue the run in it, --overwrite to delete it and start "
            "again, or choose another --output-dir."
        )
    if contents and not is_run:
        raise FileExistsError(
            f"--overwrite deletes a run directory, but {output_dir} holds files that are "
            f"not a keras-vitnorm run (no {SETTINGS_FILE}; e.g. {sorted(contents)[0]!r}). "
            "Choose another --output-dir."
        )
    if resume:
        raise ValueError(f"Cannot resume: {output_dir} holds no run.")
    for entry in contents:
        path = os.path.join(output_dir, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    with run_files.storage_errors(settings, "Nothing was trained yet."):
        durable.write_text(settings, config.to_json())


def _read_log(path):
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                rows.append({key: float(value) if key != "epoch" else int(value)
                             for key, value in row.items() if value not in ("", None)})
            except (TypeError, ValueError):
                break  # a row cut short by a kill: it and anything after are dropped
    return rows


def _truncate_csv(path, keep):
    """Rewrites the CSV `path` (atomically) with the rows for which `keep(row)` holds.

    A last row cut short by a kill (too few fields) is dropped.
    """
    if not os.path.exists(path):
        return
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        rows = [row for row in reader if header and len(row) == len(header)]
    if header is None:
        os.remove(path)
        return
    rows = [row for row in rows if keep(dict(zip(header, row)))]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(header)
    writer.writerows(rows)
    durable.write_text(path, buffer.getvalue())


@contextlib.contextmanager
def _dtype_policy(name):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def _compile(model, optimizer, label_smoothing):
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=label_smoothing),
        # Weighted, so that the blank examples of a padded split do not count.
        weighted_metrics=[keras.metrics.CategoricalAccuracy(name="accuracy")],
    )


def _image_size(model):
    size = model.get_config()["image_size"]
    return (size, size) if isinstance(size, int) else tuple(size)


@dataclasses.dataclass
class _Plan:
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


def _plan(config, data):
    steps_per_epoch = config.steps_per_epoch or data.train.size // config.batch_size
    if steps_per_epoch < 1:
        raise ValueError(
            f"batch_size={config.batch_size} is larger than the training split "
            f"({data.train.size} examples)."
        )
    total_steps = config.steps or config.epochs * steps_per_epoch
    _check_warmup(config.warmup_steps, total_steps)
    overrides = _model_overrides(config, data)
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
    return _Plan(steps_per_epoch, total_steps, overrides, replicas, scope,
                 backend.process_share(), backend.process_index_and_count())


def train(config, resume=False, overwrite=False, callbacks=(), verbose=1, take_over_lock=False):
    """Trains a ViT as `config` (a `TrainConfig`) says and returns its metrics.

    The run directory is locked (`run.lock`) while this runs; every file in it is
    written atomically, and the training state is checkpointed as one unit
    (`backup/step-<N>/`), so a run killed at any moment resumes (`resume=True`) to
    the same final weights as an uninterrupted run of the same seed.

    Args:
        config: `TrainConfig`.
        resume: bool. Continue the unfinished run in `config.output_dir` from its
            last checkpoint (same settings required); a run killed after its last
            step goes straight to its final evaluation.
        overwrite: bool. Delete an existing run in `config.output_dir` first (a
            directory holding anything but a run is never deleted).
            Without `resume` or `overwrite`, an existing run directory is an error.
        callbacks: extra Keras callbacks for `fit`.
        verbose: 0 (silent), 1 (progress bar) or 2 (one line per epoch).
        take_over_lock: bool. Take over a run directory whose lock was left by a
            process that no longer runs.

    Returns:
        The dict written to `<output_dir>/metrics.json`.

    Raises:
        TrainingDiverged: the loss became NaN or infinite (metrics.json records the
            step and `status: "diverged"`).
        run_files.LockedError: another process owns the run directory.
        run_files.StorageError: a file of the run could not be written (full disk,
            permissions); the last checkpoint is intact.
    """
    config.validate()
    output_dir = config.output_dir or _default_output_dir(config)
    say = print if verbose else (lambda *args, **kwargs: None)
    data = data_lib.load_dataset(
        config.dataset, config.val_fraction, config.data_dir, config.manual_dir,
        config.train_examples, skip_bad_images=bool(config.skip_bad_images),
        val_examples=config.val_examples, pipeline=config.input_pipeline,
    )
    plan = _plan(config, data)
    if not plan.lead:  # another process of a torch run: its first process owns the files
        say = lambda *args, **kwargs: None  # noqa: E731
    with contextlib.ExitStack() as held:
        def claim_output_dir():  # the first process locks and prepares the run directory
            held.enter_context(run_files.RunLock(output_dir, LOCK_FILE, take_over=take_over_lock))
            _prepare_output_dir(config, output_dir, resume, overwrite)

        _first_process_then_all(plan, claim_output_dir)
        keras.utils.set_random_seed(config.seed)
        say(data.describe())
        if plan.replicas > 1:
            say(f"Data-parallel over {plan.replicas} devices ({backend.name()}).")
        if not data_lib.resumes_exactly(_augmentation(config)) and resume:
            say("Note: RandAugment, MixUp and CutMix draw from Keras' stateful generators; "
                "the resumed run sees other (equally distributed) draws of them.")
        # A refused write anywhere else (the CSV and TensorBoard logs) is named the same way.
        safe = f"The run's last checkpoint (in {os.path.join(output_dir, 'backup')}), if any, is intact."
        with (_dtype_policy(config.mixed_precision), plan.scope,
              data_lib.unreadable_images_named(data), run_files.storage_errors(output_dir, safe)):
            return _Run(config, data, output_dir, plan, say).execute(resume, callbacks, verbose)


def _first_process_then_all(plan, work):
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


def _augmentation(config):
    return data_lib.Augmentation(
        **{field.name: getattr(config, field.name) for field in dataclasses.fields(data_lib.Augmentation)}
    )


class _Run:
    """One training run in its (locked) directory: resume point, `fit`, final results."""

    def __init__(self, config, data, output_dir, plan, say):
        self.config = config
        self.data = data
        self.output_dir = output_dir
        self.plan = plan
        self.say = say
        self.backup_dir = os.path.join(output_dir, "backup")
        self.log_path = os.path.join(output_dir, "log.csv")
        self.grad_norms_path = os.path.join(output_dir, "grad_norms.csv")
        self.preset_dir = os.path.join(output_dir, "preset")
        self.model_checkpoints = {
            name: os.path.join(output_dir, "checkpoints", name) for name in ("best", "last")
        }

    def execute(self, resume, extra_callbacks, verbose):
        config, plan = self.config, self.plan
        model = ViT.from_preset(config.preset, **plan.overrides)
        self.image_size = _image_size(model)
        self.channels = model.get_config()["num_channels"]
        _compile(model, make_optimizer(config, plan.total_steps, model), config.label_smoothing)
        if plan.share[1] > 1:  # torchrun: JAX averages over its devices itself
            backend.average_gradients(model.optimizer)
        self.say(
            f"Model {describe_model(config)} ({model.count_params():,} parameters, "
            f"{self.image_size[0]}x{self.image_size[1]}x{self.channels}); "
            f"{plan.total_steps} steps of batch {config.batch_size}, {plan.steps_per_epoch} steps "
            f"per epoch; output in {self.output_dir}"
        )
        self.checkpoint = callbacks_lib.RunCheckpoint(
            self.backup_dir, save_freq=config.backup_every or "epoch"
        )
        start, restored = (0, 0, 0), None
        several = plan.process[1] > 1
        if several:
            # With several processes, every one creates and assigns variables at once
            # (on JAX each is a step of all processes): the optimizer's first.
            model.optimizer.build(model.trainable_variables)
        if resume:
            start, restored = _first_process_then_all(
                plan, lambda: self._restore(model, assign=not several)) or (start, restored)
        if several:  # every process starts where the first one restored
            start = backend.from_first_process(start)
            # A fresh start where every process seeded the same (set_random_seed above)
            # and so created its variables equal (JAX) needs nothing.
            if resume or not backend.processes_start_equal():
                backend.share_variables(callbacks_lib.training_variables_of(model), restored)
            if resume:
                # Every process draws its dropout masks from the global generator (PyTorch's),
                # whose state is the same on all of them at every step: the restored one.
                backend.share_global_random_state(self.checkpoint.random_state, plan.lead)
        start_epoch, batches_done, start_step = start
        eval_batch = max(config.batch_size, 256 // plan.replicas * plan.replicas)
        pad = plan.processes_split_batches
        self.val_data, self.test_data = (
            data_lib.eval_dataset(self.data, split, self.image_size, self.channels, eval_batch, pad)
            for split in (self.data.validation, self.data.test))
        # A padded split's mean loss counts the blanks (weight 0): scaled back to its own.
        self.loss_scale = {
            role: data_lib.padded_size(split.size, eval_batch) / split.size if pad else 1.0
            for role, split in (("validation", self.data.validation), ("test", self.data.test))}
        began = self.checkpoint.began = time.perf_counter()
        nan_stop = self._fit(model, start_epoch, batches_done, extra_callbacks, verbose)
        seconds = time.perf_counter() - began
        before = self.checkpoint.seconds_before
        total = None if before is None else round(before + seconds, 2)
        record = {
            "backend": backend.name(),
            "dataset": self.data.name,
            "preset": config.preset,
            "planned_steps": plan.total_steps,
            "steps": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
            "resumed_from_step": start_step,
            "train_seconds_this_run": round(seconds, 2),
            # Summed over every run that trained this model's steps (None if unknown).
            "train_seconds": total,
            "replicas": plan.replicas,
            "class_names": self.data.class_names,
            "model_config": {k: v for k, v in model.get_config().items() if k in ViT.CONFIG_KEYS},
        }
        if nan_stop.step is not None:
            self._diverged(nan_stop, record)
        return self._finish(model, record, seconds)

    def _restore(self, model, assign=True):
        """Loads the last checkpoint; returns `((epoch, batches done in it, step), values)`:
        the checkpoint's variable values if `assign` is False (else `None`)."""
        for directory in (self.preset_dir, *self.model_checkpoints.values()):
            durable.recover_directory(directory)
        found = callbacks_lib.RunCheckpoint.latest(self.backup_dir)
        epoch, batch, step = 0, 0, 0
        values = None
        if found:
            path, state = found
            epoch, batch, step = state["epoch"], state["batch"], state["step"]
            if step != epoch * self.plan.steps_per_epoch + batch:
                raise ValueError(
                    f"The checkpoint {path} (epoch {epoch}, batch {batch}, step {step}) does "
                    f"not fit {self.plan.steps_per_epoch} steps per epoch."
                )
            values = self.checkpoint.restore(model, path, assign=assign)
            # A checkpoint whose state has no `train_seconds` leaves the total unknown.
            self.checkpoint.seconds_before = state.get("train_seconds")
            if batch >= self.plan.steps_per_epoch:
                epoch, batch = epoch + 1, 0
            where = ("all steps done: final evaluation" if step >= self.plan.total_steps
                     else f"epoch {epoch + 1}, batch {batch}")
            self.say(f"Resuming from step {step} ({where}).")
        # Logs hold exactly the rows up to the checkpoint (a kill may have left more).
        _truncate_csv(self.log_path, lambda row: int(row["epoch"]) < epoch)
        if step == 0:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.grad_norms_path)
        else:
            _truncate_csv(self.grad_norms_path, lambda row: int(row["step"]) <= step)
        return (epoch, batch, step), values

    def _callbacks(self, extra_callbacks):
        config = self.config
        previous_best = max(
            (row.get("val_accuracy", -1.0) for row in _read_log(self.log_path)), default=None
        )
        nan_stop = callbacks_lib.StopOnNaN(
            agree=backend.any_process if self.plan.process[1] > 1 else None)
        scale = callbacks_lib.ScaleLog("val_loss", self.loss_scale["validation"])
        checkpoint = self.checkpoint
        recorders = []
        if config.grad_norm_every:
            probe = data_lib.eval_dataset(
                self.data, self.data.validation, self.image_size, self.channels, 64
            )
            images, labels = next(iter(probe))
            recorders.append(
                GradientNormRecorder(
                    np.asarray(images), np.asarray(labels), every=config.grad_norm_every,
                    # Every process computes the records (a step of JAX's processes runs
                    # on all of them); the first one writes them.
                    path=self.grad_norms_path if self.plan.lead else None,
                )
            )
        if not self.plan.lead:  # the first process writes the logs and checkpoints
            return [nan_stop, scale, *recorders, *extra_callbacks], nan_stop, checkpoint
        log = keras.callbacks.CSVLogger(self.log_path, append=True)
        checkpoint.flush = [recorder.flush for recorder in recorders]
        # Order matters: the NaN stop acts before anything saves; records and the log
        # row of a step are written before the checkpoint of that step.
        callbacks = [
            nan_stop,
            scale,
            *recorders,
            log,
            callbacks_lib.PresetCheckpoint(
                self.model_checkpoints["best"],
                monitor="val_accuracy",
                initial_best=previous_best,
                stage="best",
            ),
            callbacks_lib.PresetCheckpoint(self.model_checkpoints["last"], stage="last"),
            checkpoint,
            *extra_callbacks,
        ]
        if config.tensorboard and importlib.util.find_spec("tensorflow") is None:
            self.say("No TensorBoard logs: keras.callbacks.TensorBoard needs TensorFlow, which "
                     "is not installed; log.csv has every epoch (--no-tensorboard drops this note).")
        elif config.tensorboard:
            callbacks.append(
                keras.callbacks.TensorBoard(os.path.join(self.output_dir, "tensorboard"),
                                            write_graph=False)
            )
        return callbacks, nan_stop, checkpoint

    def _fit(self, model, start_epoch, batches_done, extra_callbacks, verbose):
        config, plan = self.config, self.plan
        callbacks, nan_stop, checkpoint = self._callbacks(extra_callbacks)
        augmentation = _augmentation(config)
        for initial_epoch, epochs, steps, offset in plan_segments(
            plan.total_steps, plan.steps_per_epoch, start_epoch, batches_done
        ):
            stream = data_lib.train_stream(
                self.data,
                self.image_size,
                self.channels,
                config.batch_size,
                config.seed,
                augmentation,
                start_step=initial_epoch * plan.steps_per_epoch + offset,
                end_step=plan.total_steps,
                shuffle_buffer=config.shuffle_buffer,
                share=plan.share,
            )
            checkpoint.batch_offset = nan_stop.batch_offset = offset
            try:
                model.fit(
                    stream,
                    initial_epoch=initial_epoch,
                    epochs=epochs,
                    steps_per_epoch=steps,
                    validation_data=self.val_data,
                    shuffle=False,  # the stream is shuffled by pass, reproducibly
                    callbacks=callbacks,
                    verbose=verbose if plan.lead else 0,
                )
            except callbacks_lib.LossIsNaN:
                break
        return nan_stop

    def _diverged(self, nan_stop, record):
        last = self.model_checkpoints["last"]
        message = (
            f"Training diverged: the loss became NaN/inf at step {nan_stop.step} "
            f"(epoch {nan_stop.epoch}, batch {nan_stop.batch}). Stopped. "
            + (f"The model at the last epoch end before it is in {last} "
               "(ViT.from_preset)." if os.path.exists(last)
               else "No checkpoint was written before it.")
        )
        if self.plan.lead:
            durable.write_json(
                os.path.join(self.output_dir, METRICS_FILE),
                {"status": "diverged", "diverged_at_step": nan_stop.step, **record},
            )
        raise TrainingDiverged(message, nan_stop.step)

    def _finish(self, model, record, seconds):
        """Final evaluation, then the preset, then `metrics.json`, then the checkpoint goes.

        Each is written atomically and in this order, so a kill anywhere here leaves
        the checkpoint of the last step: `--resume` comes back to this evaluation.
        """
        val = model.evaluate(self.val_data, return_dict=True, verbose=0)
        test = model.evaluate(self.test_data, return_dict=True, verbose=0)
        val["loss"] *= self.loss_scale["validation"]
        test["loss"] *= self.loss_scale["test"]
        durable.fault_point("final:evaluated")
        log = _read_log(self.log_path) if self.plan.lead else []
        best = max(log, key=lambda row: row.get("val_accuracy", -1.0), default={})
        metrics = {
            "status": "completed",
            "val_accuracy": float(val["accuracy"]),
            "val_loss": float(val["loss"]),
            "test_accuracy": float(test["accuracy"]),
            "test_loss": float(test["loss"]),
            "best_val_accuracy": best.get("val_accuracy"),
            "best_epoch": best["epoch"] + 1 if "epoch" in best else None,
            "val_examples": self.data.validation.size,
            "test_examples": self.data.test.size,
            **record,
        }
        if not self.plan.lead:  # the first process writes the results
            return metrics
        safe = f"The checkpoint in {self.backup_dir} is intact."
        with run_files.storage_errors(self.preset_dir, safe):
            durable.write_directory(self.preset_dir, model.save_to_preset, stage="preset")
        metrics_path = os.path.join(self.output_dir, METRICS_FILE)
        with run_files.storage_errors(metrics_path, safe):
            durable.write_json(metrics_path, metrics, stage="metrics")
        durable.fault_point("final:completed")
        shutil.rmtree(self.backup_dir, ignore_errors=True)
        self.say(
            f"Done in {seconds:.0f} s: validation accuracy {metrics['val_accuracy']:.4f}, "
            f"test accuracy {metrics['test_accuracy']:.4f} ({self.data.test.size} images). "
            f"Model saved to {self.preset_dir}."
        )
        return metrics


def evaluate(path, dataset=None, split="test", batch_size=256, val_fraction=None,
             data_dir=None, manual_dir=None, verbose=1):
    """Scores a saved model on a split of a dataset.

    Args:
        path: a preset directory (`save_to_preset`) or a run directory from `train`
            (its `preset/` is scored, and its dataset and validation fraction are the
            defaults).
        dataset: dataset string; default the run's dataset.
        split: `"test"`, `"validation"` or `"train"`.
        batch_size: int.
        val_fraction: float; default the run's (0.1 outside a run directory).

    Returns:
        `{"dataset", "split", "examples", "accuracy", "loss", "preset"}`.
    """
    from keras_vitnorm.validation import check_choice

    check_choice("split", split, ("test", "validation", "train"))
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} does not exist or is not a directory.")
    run_settings = durable.read_json(os.path.join(path, SETTINGS_FILE)) or {}
    preset_dir = os.path.join(path, "preset") if run_settings else path
    metrics = (durable.read_json(os.path.join(path, METRICS_FILE)) or {}) if run_settings else {}
    if run_settings and metrics.get("status") != "completed":
        status = metrics.get("status", "unfinished (no metrics.json)")
        last = os.path.join(path, "checkpoints", "last")
        raise ValueError(
            f"The run in {path!r} has not completed, so it has no final model to score: its "
            f"status is {status}. "
            + ("Start a new run." if status == "diverged" else
               f"Finish it with `keras-vitnorm train --resume --output-dir {path}`.")
            + (f" Its model at the latest epoch end is the preset {last}."
               if os.path.exists(last) else "")
        )
    if not run_settings and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"{path!r} is neither a preset directory (config.json, model.weights.npz) nor a "
            f"run directory ({SETTINGS_FILE})."
        )
    dataset = dataset or run_settings.get("dataset")
    if dataset is None:
        raise ValueError(f"{path} is not a run directory; name the dataset to score it on.")
    val_fraction = val_fraction or run_settings.get("val_fraction", 0.1)
    model = ViT.from_preset(preset_dir)
    # The run's own dataset is split as the run split it (a held-out val_examples too).
    own = dataset == run_settings.get("dataset")
    data = data_lib.load_dataset(
        dataset, val_fraction, data_dir, manual_dir,
        skip_bad_images=bool(run_settings.get("skip_bad_images")),
        train_examples=run_settings.get("train_examples") if own else None,
        val_examples=run_settings.get("val_examples") if own else None,
    )
    classes = model.get_config()["num_classes"]
    if classes != data.num_classes:
        raise ValueError(
            f"The model in {preset_dir} has {classes} classes but {data.name} has "
            f"{data.num_classes}; it was not trained on this dataset."
        )
    chosen = getattr(data, split)
    images = data_lib.eval_dataset(
        data, chosen, _image_size(model), model.get_config()["num_channels"], batch_size
    )
    _compile(model, "sgd", 0.0)  # the optimizer is unused: evaluate only
    result = model.evaluate(images, return_dict=True, verbose=verbose)
    return {
        "preset": preset_dir,
        "dataset": data.name,
        "split": f"{split} ({chosen.name})",
        "examples": chosen.size,
        "accuracy": float(result["accuracy"]),
        "loss": float(result["loss"]),
    }
