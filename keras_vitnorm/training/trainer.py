"""`train` and `evaluate`: the main job, built on `model.fit` and Keras callbacks.

A run directory holds:

    train_config.json        the settings (a resumed run must match them)
    log.csv                  one row per epoch (CSVLogger)
    tensorboard/             TensorBoard logs
    checkpoints/best.weights.h5, checkpoints/last.weights.h5
    backup/                  ResumableBackup state while the run is unfinished
    preset/                  the final model (`ViT.save_to_preset`)
    metrics.json             status, final validation and test accuracy, timings
"""

import contextlib
import csv
import dataclasses
import datetime
import json
import math
import os
import shutil
import time

import keras
import numpy as np

from keras_vitnorm import backend_ops
from keras_vitnorm.analysis.probes import GradientNormRecorder
from keras_vitnorm.models import PRESETS
from keras_vitnorm.models import ViT
from keras_vitnorm.models.presets import preset_config
from keras_vitnorm.models.vit import validate_config
from keras_vitnorm.training import data as data_lib
from keras_vitnorm.training.callbacks import LossIsNaN
from keras_vitnorm.training.callbacks import ResumableBackup
from keras_vitnorm.training.callbacks import StopOnNaN
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
    """AdamW with linear warm-up then cosine decay, kernel-only weight decay, clipping."""
    lr = config.learning_rate
    warmup = config.warmup_steps
    _check_warmup(warmup, total_steps)
    schedule = keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0 if warmup else lr,
        decay_steps=total_steps - warmup,
        alpha=config.min_learning_rate / lr,
        warmup_target=lr if warmup else None,
        warmup_steps=warmup,
    )
    optimizer = keras.optimizers.AdamW(
        learning_rate=schedule,
        weight_decay=config.weight_decay,
        beta_1=config.beta_1,
        beta_2=config.beta_2,
        global_clipnorm=config.grad_clip or None,
    )
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
    if not os.path.exists(config.preset):
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


def _default_output_dir(config):
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    preset = os.path.basename(os.path.normpath(config.preset))
    dataset = config.dataset.replace(":", "-").replace(os.sep, "_").strip("_")
    return os.path.join("runs", f"{preset}-{dataset}-{stamp}")


def _prepare_output_dir(config, output_dir, resume, overwrite):
    if resume and overwrite:
        raise ValueError("Give at most one of resume and overwrite.")
    settings = os.path.join(output_dir, "train_config.json")
    exists = os.path.isdir(output_dir) and bool(os.listdir(output_dir))
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise FileExistsError(f"Output path {output_dir} exists and is not a directory.")
    if exists and resume:
        if not os.path.exists(settings):
            raise ValueError(
                f"Cannot resume: {output_dir} has no train_config.json, so it is not a "
                "keras-vitnorm run directory."
            )
        metrics = _read_json(os.path.join(output_dir, "metrics.json"))
        if metrics and metrics.get("status") == "completed":
            raise ValueError(f"Cannot resume: the run in {output_dir} already completed.")
        if metrics and metrics.get("status") == "diverged":
            raise ValueError(
                f"Cannot resume: the run in {output_dir} diverged at step "
                f"{metrics.get('diverged_at_step')}; start a new run (e.g. a lower learning rate)."
            )
        saved = _read_json(settings)
        current = {**config.to_dict(), "output_dir": saved.get("output_dir")}
        details = setting_changes(saved, current)
        if details:
            raise ValueError(
                f"Cannot resume {output_dir} with different settings ({details}). "
                "Resume with the same command, or start a new run."
            )
        return
    if exists and not overwrite:
        raise FileExistsError(
            f"Output directory {output_dir} already exists and is not empty. Pass "
            "--resume to continue the run in it, --overwrite to delete it and start "
            "again, or choose another --output-dir."
        )
    if resume:
        raise ValueError(f"Cannot resume: {output_dir} holds no run.")
    if exists:
        shutil.rmtree(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    with open(settings, "w") as f:
        f.write(config.to_json())


def _read_json(path):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _write_json(path, value):
    temporary = path + ".writing"
    with open(temporary, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
    os.replace(temporary, path)


def _read_log(path):
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return [
            {key: float(value) if key != "epoch" else int(value) for key, value in row.items() if value != ""}
            for row in csv.DictReader(f)
        ]


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
        metrics=[keras.metrics.CategoricalAccuracy(name="accuracy")],
    )


def _image_size(model):
    size = model.get_config()["image_size"]
    return (size, size) if isinstance(size, int) else tuple(size)


def train(config, resume=False, overwrite=False, callbacks=(), verbose=1):
    """Trains a ViT as `config` (a `TrainConfig`) says and returns its metrics.

    Args:
        config: `TrainConfig`.
        resume: bool. Continue the unfinished run in `config.output_dir` from its
            last backup (same settings required).
        overwrite: bool. Delete an existing non-empty `config.output_dir` first.
            Without `resume` or `overwrite`, an existing run directory is an error.
        callbacks: extra Keras callbacks for `fit`.
        verbose: 0 (silent), 1 (progress bar) or 2 (one line per epoch).

    Returns:
        The dict written to `<output_dir>/metrics.json`.

    Raises:
        TrainingDiverged: the loss became NaN or infinite (metrics.json records the
            step and `status: "diverged"`).
    """
    config.validate()
    output_dir = config.output_dir or _default_output_dir(config)
    say = print if verbose else (lambda *args, **kwargs: None)
    data = data_lib.load_dataset(
        config.dataset, config.val_fraction, config.data_dir, config.manual_dir,
        config.train_examples,
    )
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
    if config.distribute:
        scope, replicas = backend_ops.data_parallel_scope()
        if config.batch_size % replicas:
            raise ValueError(
                f"batch_size={config.batch_size} does not split over {replicas} devices; "
                f"use a multiple of {replicas}."
            )
    else:
        scope, replicas = contextlib.nullcontext(), 1
    _prepare_output_dir(config, output_dir, resume, overwrite)
    keras.utils.set_random_seed(config.seed)
    say(data.describe())
    if replicas > 1:
        say(f"Data-parallel over {replicas} devices ({keras.backend.backend()}).")
    with _dtype_policy(config.mixed_precision), scope:
        return _train(
            config, data, output_dir, resume, callbacks, verbose, replicas, say,
            steps_per_epoch, total_steps, overrides,
        )


def _train(config, data, output_dir, resume, extra_callbacks, verbose, replicas, say,
           steps_per_epoch, total_steps, overrides):
    model = ViT.from_preset(config.preset, **overrides)
    image_size, channels = _image_size(model), model.get_config()["num_channels"]
    _compile(model, make_optimizer(config, total_steps, model), config.label_smoothing)
    say(
        f"Model {config.preset} ({model.count_params():,} parameters, {image_size[0]}x"
        f"{image_size[1]}x{channels}); {total_steps} steps of batch {config.batch_size}, "
        f"{steps_per_epoch} steps per epoch; output in {output_dir}"
    )

    backup_dir = os.path.join(output_dir, "backup")
    state = ResumableBackup.read_state(backup_dir) if resume else None
    start_epoch, batches_done, start_step = 0, 0, 0
    if state:
        start_epoch, batches_done, start_step = state["epoch"], state["batch"], state["step"]
        if start_step != start_epoch * steps_per_epoch + batches_done:
            raise ValueError(
                f"The backup in {backup_dir} (epoch {start_epoch}, batch {batches_done}, "
                f"step {start_step}) does not fit {steps_per_epoch} steps per epoch."
            )
        if batches_done >= steps_per_epoch:
            start_epoch, batches_done = start_epoch + 1, 0
        say(f"Resuming from step {start_step} (epoch {start_epoch + 1}, batch {batches_done}).")

    eval_batch = max(config.batch_size, 256 // replicas * replicas)
    val_data = data_lib.eval_dataset(data, data.validation, image_size, channels, eval_batch)
    log_path = os.path.join(output_dir, "log.csv")
    previous_best = max((row.get("val_accuracy", -1.0) for row in _read_log(log_path)), default=None)
    os.makedirs(os.path.join(output_dir, "checkpoints"), exist_ok=True)
    backup = ResumableBackup(backup_dir, save_freq=config.backup_every or "epoch")
    nan_stop = StopOnNaN()
    callbacks = [
        nan_stop,
        backup,
        keras.callbacks.CSVLogger(log_path, append=True),
        keras.callbacks.ModelCheckpoint(
            os.path.join(output_dir, "checkpoints", "best.weights.h5"),
            monitor="val_accuracy",
            mode="max",
            save_best_only=True,
            save_weights_only=True,
            initial_value_threshold=previous_best,
        ),
        keras.callbacks.ModelCheckpoint(
            os.path.join(output_dir, "checkpoints", "last.weights.h5"), save_weights_only=True
        ),
        *extra_callbacks,
    ]
    if config.grad_norm_every:
        probe = data_lib.eval_dataset(data, data.validation, image_size, channels, 64)
        images, labels = next(iter(probe))
        callbacks.append(
            GradientNormRecorder(
                np.asarray(images), np.asarray(labels), every=config.grad_norm_every,
                path=os.path.join(output_dir, "grad_norms.csv"),
            )
        )
    if config.tensorboard:
        callbacks.append(
            keras.callbacks.TensorBoard(os.path.join(output_dir, "tensorboard"), write_graph=False)
        )
    augmentation = data_lib.Augmentation(
        **{field.name: getattr(config, field.name) for field in dataclasses.fields(data_lib.Augmentation)}
    )

    began = time.perf_counter()
    for initial_epoch, epochs, steps, offset in plan_segments(
        total_steps, steps_per_epoch, start_epoch, batches_done
    ):
        stream = data_lib.train_stream(
            data,
            image_size,
            channels,
            config.batch_size,
            config.seed,
            augmentation,
            start_step=initial_epoch * steps_per_epoch + offset,
            end_step=total_steps,
            shuffle_buffer=config.shuffle_buffer,
        )
        backup.batch_offset = nan_stop.batch_offset = offset
        try:
            model.fit(
                stream,
                initial_epoch=initial_epoch,
                epochs=epochs,
                steps_per_epoch=steps,
                validation_data=val_data,
                shuffle=False,  # the stream is shuffled by pass, reproducibly
                callbacks=callbacks,
                verbose=verbose,
            )
        except LossIsNaN:
            break
    seconds = time.perf_counter() - began
    steps_done = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    record = {
        "backend": keras.backend.backend(),
        "dataset": data.name,
        "preset": config.preset,
        "planned_steps": total_steps,
        "steps": steps_done,
        "resumed_from_step": start_step,
        "train_seconds_this_run": round(seconds, 2),
        "replicas": replicas,
        "class_names": data.class_names,
        "model_config": {k: v for k, v in model.get_config().items() if k in ViT.CONFIG_KEYS},
    }
    metrics_path = os.path.join(output_dir, "metrics.json")
    if nan_stop.step is not None:
        last = os.path.join(output_dir, "checkpoints", "last.weights.h5")
        message = (
            f"Training diverged: the loss became NaN/inf at step {nan_stop.step} "
            f"(epoch {nan_stop.epoch}, batch {nan_stop.batch}). Stopped. "
            + (f"The last end-of-epoch weights before it are in {last}." if os.path.exists(last)
               else "No checkpoint was written before it.")
        )
        _write_json(metrics_path, {"status": "diverged", "diverged_at_step": nan_stop.step, **record})
        raise TrainingDiverged(message, nan_stop.step)

    test_data = data_lib.eval_dataset(data, data.test, image_size, channels, eval_batch)
    val = model.evaluate(val_data, return_dict=True, verbose=0)
    test = model.evaluate(test_data, return_dict=True, verbose=0)
    log = _read_log(log_path)
    best = max(log, key=lambda row: row.get("val_accuracy", -1.0), default={})
    model.save_to_preset(os.path.join(output_dir, "preset"))
    metrics = {
        "status": "completed",
        "val_accuracy": float(val["accuracy"]),
        "val_loss": float(val["loss"]),
        "test_accuracy": float(test["accuracy"]),
        "test_loss": float(test["loss"]),
        "best_val_accuracy": best.get("val_accuracy"),
        "best_epoch": best["epoch"] + 1 if "epoch" in best else None,
        "val_examples": data.validation.size,
        "test_examples": data.test.size,
        **record,
    }
    _write_json(metrics_path, metrics)
    shutil.rmtree(backup_dir, ignore_errors=True)
    say(
        f"Done in {seconds:.0f} s: validation accuracy {metrics['val_accuracy']:.4f}, "
        f"test accuracy {metrics['test_accuracy']:.4f} ({data.test.size} images). "
        f"Model saved to {os.path.join(output_dir, 'preset')}."
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
    from keras_vitnorm.layers._validation import check_choice

    check_choice("split", split, ("test", "validation", "train"))
    path = os.fspath(path)
    run_settings = _read_json(os.path.join(path, "train_config.json")) or {}
    preset_dir = os.path.join(path, "preset") if run_settings else path
    if not os.path.isdir(preset_dir):
        raise ValueError(f"{path!r} is neither a preset directory nor a run directory.")
    dataset = dataset or run_settings.get("dataset")
    if dataset is None:
        raise ValueError(f"{path} is not a run directory; name the dataset to score it on.")
    val_fraction = val_fraction or run_settings.get("val_fraction", 0.1)
    model = ViT.from_preset(preset_dir)
    data = data_lib.load_dataset(dataset, val_fraction, data_dir, manual_dir)
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
