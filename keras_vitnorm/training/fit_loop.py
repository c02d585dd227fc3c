"""The fit loop of a training run: `model.fit` from where the run starts, with the
callbacks that log, checkpoint and stop, then the final evaluation and results, in an
order `--resume` finishes after a kill anywhere (docs/training.md, "What survives a crash").
"""

import dataclasses
import importlib.util
import math
import os
import shutil
import sys
import time

import keras

from keras_vitnorm import backend
from keras_vitnorm import durable
from keras_vitnorm.analysis.probes import GradientNormRecorder
from keras_vitnorm.models import ViT
from keras_vitnorm.training import callbacks as callbacks_lib
from keras_vitnorm.training import data as data_lib
from keras_vitnorm.training import interrupts
from keras_vitnorm.training import run_files
from keras_vitnorm.training.evaluation import image_size
from keras_vitnorm.training.optimizer import compile_classifier
from keras_vitnorm.training.optimizer import make_optimizer
from keras_vitnorm.training.replaced_run import drop_replaced
from keras_vitnorm.training.resume import restore_last_checkpoint
from keras_vitnorm.training.run_layout import read_log
from keras_vitnorm.training.run_plan import first_process_then_all


def progress_verbosity(verbose, stream=None):
    """Keras' `verbose` for `fit`: its progress bar (1) only where `stream` (default
    `sys.stdout`) is a terminal; in a file or a pipe, one line per epoch (2)."""
    isatty = getattr(sys.stdout if stream is None else stream, "isatty", None)
    return 2 if verbose == 1 and not (callable(isatty) and isatty()) else verbose


class TrainingDiverged(RuntimeError):
    """Raised when the training loss becomes NaN or infinite; `.step` says when."""

    def __init__(self, message, step):
        super().__init__(message)
        self.step = step


def plan_segments(total_steps, steps_per_epoch, start_epoch=0, batches_done=0):
    """Splits the remaining training into `fit` calls of whole epochs.

    Returns `[(initial_epoch, epochs, steps_per_epoch, batch_offset), ...]`: the rest of
    an interrupted epoch, the full epochs, then a shorter last epoch if there is one.
    """
    epochs = math.ceil(total_steps / steps_per_epoch)
    last = total_steps - (epochs - 1) * steps_per_epoch
    full_end = epochs if last == steps_per_epoch else epochs - 1
    segments = []
    epoch = start_epoch
    if batches_done and epoch < epochs:
        length = last if epoch == epochs - 1 else steps_per_epoch
        segments.append((epoch, epoch + 1, length - batches_done, batches_done))
        epoch += 1
    if epoch < full_end:
        segments.append((epoch, full_end, steps_per_epoch, 0))
        epoch = full_end
    if epoch < epochs:  # the shorter last epoch
        segments.append((epoch, epochs, last, 0))
    return segments


def describe_model(config):
    """The preset and the model settings the run changes: `"s16_dpn with depth=6, ..."`."""
    changes = ", ".join(f"{key}={value}" for key, value in sorted(config.model.items()))
    return f"{config.preset} with {changes}" if changes else str(config.preset)


def augmentation_of(config):
    """The `Augmentation` that a `TrainConfig`'s fields of the same names describe."""
    return data_lib.Augmentation(**{field.name: getattr(config, field.name)
                                    for field in dataclasses.fields(data_lib.Augmentation)})


class Run:
    """One training run in its locked, prepared `RunDirectory`: where it starts, `fit`,
    the results; `stop` is the `interrupts.StopRequest` its signals set."""

    def __init__(self, config, data, directory, plan, resume, say, stop):
        self.config = config
        self.stop = stop
        self.data = data
        self.directory = directory
        self.plan = plan
        self.resume = resume
        self.say = say

    def execute(self, extra_callbacks, verbose):
        """Trains (from the start, or from the last checkpoint); returns the metrics."""
        config, plan, resume = self.config, self.plan, self.resume
        self.stop.check()  # a signal during start-up whose exception was dropped
        model = ViT.from_preset(config.preset, **plan.overrides)
        model.check_datasets = False  # the pipelines give the model's range by construction
        self.image_size = image_size(model)
        self.channels = model.get_config()["num_channels"]
        compile_classifier(model, make_optimizer(config, plan.total_steps, model),
                           config.label_smoothing)
        if plan.share[1] > 1:  # torchrun: JAX averages over its devices itself
            backend.average_gradients(model.optimizer)
        self.say(f"Model {describe_model(config)} ({model.count_params():,} parameters, "
                 f"{self.image_size[0]}x{self.image_size[1]}x{self.channels}); "
                 f"{plan.total_steps} steps of batch {config.batch_size}, "
                 f"{plan.steps_per_epoch} steps per epoch; output in {self.directory.path}")
        self.checkpoint = callbacks_lib.RunCheckpoint(self.directory.backup,
                                                      save_freq=config.backup_every or "epoch")
        start, restored = (0, 0, 0), None
        several = plan.process[1] > 1
        if several:
            # All processes create variables together (on JAX, a step of all): optimizer's first.
            model.optimizer.build(model.trainable_variables)
        if resume:
            start, restored = first_process_then_all(plan, lambda: restore_last_checkpoint(
                self.directory, self.checkpoint, model, plan, self.say, assign=not several)
            ) or (start, restored)
        if several:  # every process starts where the first one restored
            start = backend.from_first_process(start)
            # A fresh start whose processes seeded equal variables (JAX) needs nothing.
            if resume or not backend.processes_start_equal():
                backend.share_variables(callbacks_lib.training_variables_of(model), restored)
            if resume:
                # PyTorch's dropout generator: the same restored state on every process.
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
        record = {
            "backend": backend.name(),
            "dataset": self.data.name,
            "preset": config.preset,
            "planned_steps": plan.total_steps,
            "steps": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
            "resumed_from_step": start_step,
            "train_seconds_this_run": round(seconds, 2),
            "train_seconds": None if before is None else round(before + seconds, 2),
            "replicas": plan.replicas,
            "class_names": self.data.class_names,
            "model_config": {k: v for k, v in model.get_config().items() if k in ViT.CONFIG_KEYS},
        }
        if nan_stop.step is not None:
            self._diverged(nan_stop, record)
        return self._finish(model, record, seconds)

    def _callbacks(self, extra_callbacks):
        """`(callbacks of fit, their StopOnNaN)`; the first process's also write the run."""
        config, checkpoint = self.config, self.checkpoint
        agree = backend.any_process if self.plan.process[1] > 1 else None
        nan_stop = callbacks_lib.StopOnNaN(agree=agree)
        recorders = []
        if config.grad_norm_every:
            images, labels = data_lib.first_eval_batch(
                self.data, self.data.validation, self.image_size, self.channels, 64)
            # Every process computes them (a JAX step runs on all); the first writes them.
            recorders.append(GradientNormRecorder(
                images, labels, every=config.grad_norm_every,
                path=self.directory.grad_norms if self.plan.lead else None))
        # Order matters: the NaN stop acts before anything saves; records and the log row
        # of a step are written before the checkpoint of that step.
        callbacks = [nan_stop, callbacks_lib.ScaleLog("val_loss", self.loss_scale["validation"]),
                     *recorders]
        if self.plan.lead:  # the first process writes the logs and checkpoints
            checkpoint.flush = [recorder.flush for recorder in recorders]
            # The run an --overwrite replaces is kept until this one has a checkpoint.
            checkpoint.after_save = [lambda: drop_replaced(self.directory.path)]
            best = max((row.get("val_accuracy", -1.0) for row in read_log(self.directory.log)),
                       default=None)
            callbacks += [
                keras.callbacks.CSVLogger(self.directory.log, append=True),
                callbacks_lib.PresetCheckpoint(
                    self.directory.checkpoints["best"], monitor="val_accuracy",
                    initial_best=best, stage="best"),
                callbacks_lib.PresetCheckpoint(self.directory.checkpoints["last"], stage="last"),
                checkpoint,
            ]
        callbacks += extra_callbacks
        if self.plan.lead and config.tensorboard:
            if importlib.util.find_spec("tensorflow") is None:
                self.say("No TensorBoard logs: keras.callbacks.TensorBoard needs TensorFlow, "
                         "which is not installed; log.csv has every epoch (--no-tensorboard "
                         "drops this note).")
            else:
                callbacks.append(
                    keras.callbacks.TensorBoard(self.directory.tensorboard, write_graph=False))
        # Last: a signal ends the step with every other callback's work of it done.
        callbacks.append(interrupts.StopOnSignal(
            self.stop, checkpoint if self.plan.lead else None, agree=agree))
        return callbacks, nan_stop

    def _fit(self, model, start_epoch, batches_done, extra_callbacks, verbose):
        """`model.fit` over the segments of `plan_segments`; returns the `StopOnNaN`."""
        config, plan = self.config, self.plan
        callbacks, nan_stop = self._callbacks(extra_callbacks)
        augmentation = augmentation_of(config)
        with self.stop.deferred():
            for initial_epoch, epochs, steps, offset in plan_segments(
                    plan.total_steps, plan.steps_per_epoch, start_epoch, batches_done):
                stream = data_lib.train_stream(
                    self.data, self.image_size, self.channels, config.batch_size, config.seed,
                    augmentation, start_step=initial_epoch * plan.steps_per_epoch + offset,
                    end_step=plan.total_steps, shuffle_buffer=config.shuffle_buffer,
                    share=plan.share)
                self.checkpoint.batch_offset = nan_stop.batch_offset = offset
                try:
                    model.fit(stream, initial_epoch=initial_epoch, epochs=epochs,
                              steps_per_epoch=steps, validation_data=self.val_data,
                              shuffle=False,  # the stream is shuffled by pass, reproducibly
                              callbacks=callbacks,
                              verbose=progress_verbosity(verbose) if plan.lead else 0)
                except callbacks_lib.LossIsNaN:
                    break
        return nan_stop

    def _diverged(self, nan_stop, record):
        last = self.directory.checkpoints["last"]
        message = (
            f"Training diverged: the loss became NaN/inf at step {nan_stop.step} "
            f"(epoch {nan_stop.epoch}, batch {nan_stop.batch}). Stopped. "
            + (f"The model at the last epoch end before it is in {last} "
               "(ViT.from_preset)." if os.path.exists(last)
               else "No checkpoint was written before it.")
        )
        if self.plan.lead:
            durable.write_json(self.directory.metrics,
                               {"status": "diverged", "diverged_at_step": nan_stop.step, **record})
        raise TrainingDiverged(message, nan_stop.step)

    def _finish(self, model, record, seconds):
        """Final evaluation, then the preset, then `metrics.json`, then the checkpoint
        goes: a kill anywhere here leaves the last step's checkpoint to resume from."""
        with self.stop.deferred():  # a signal here: resumed, the run evaluates again
            val = model.evaluate(self.val_data, return_dict=True, verbose=0)
            test = model.evaluate(self.test_data, return_dict=True, verbose=0)
        val["loss"] *= self.loss_scale["validation"]
        test["loss"] *= self.loss_scale["test"]
        durable.fault_point("final:evaluated")
        log = read_log(self.directory.log) if self.plan.lead else []
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
        safe = f"The checkpoint in {self.directory.backup} is intact."
        with run_files.storage_errors(self.directory.preset, safe):
            durable.write_directory(self.directory.preset, model.save_to_preset, stage="preset")
        with run_files.storage_errors(self.directory.metrics, safe):
            durable.write_json(self.directory.metrics, metrics, stage="metrics")
        durable.fault_point("final:completed")
        shutil.rmtree(self.directory.backup, ignore_errors=True)
        self.say(f"Done in {seconds:.0f} s: validation accuracy {metrics['val_accuracy']:.4f}, "
                 f"test accuracy {metrics['test_accuracy']:.4f} ({self.data.test.size} images). "
                 f"Model saved to {self.directory.preset}.")
        return metrics

