"""`train`: the main job, built on `model.fit` and Keras callbacks; it puts the run's
modules (docs/training.md lists them) together."""

import contextlib
import os

import keras

from keras_vitnorm import backend
from keras_vitnorm import durable
from keras_vitnorm.models import ViT
from keras_vitnorm.models.vit_config import in_model_range
from keras_vitnorm.training import callbacks as callbacks_lib
from keras_vitnorm.training import data as data_lib
from keras_vitnorm.training import interrupts
from keras_vitnorm.training import replaced_run
from keras_vitnorm.training import run_directory
from keras_vitnorm.training import run_files
from keras_vitnorm.training.config import dtype_policy
from keras_vitnorm.training.config import names_trained_model
from keras_vitnorm.training.fit_loop import Run
from keras_vitnorm.training.fit_loop import TrainingDiverged
from keras_vitnorm.training.fit_loop import augmentation_of
from keras_vitnorm.training.fit_loop import describe_model
from keras_vitnorm.training.run_layout import LOCK_FILE
from keras_vitnorm.training.run_layout import SETTINGS_FILE
from keras_vitnorm.training.run_layout import RunDirectory
from keras_vitnorm.training.run_layout import has_checkpoint_or_result
from keras_vitnorm.training.run_plan import first_process_then_all
from keras_vitnorm.training.run_plan import fit_to_data
from keras_vitnorm.training.run_plan import plan_run

__all__ = ["TrainingDiverged", "describe_model", "load_training_data", "train"]


def _model_overrides(config, data):
    overrides = {"num_classes": data.num_classes, **config.model}
    if not names_trained_model(config.preset):  # a saved model keeps its own channels
        overrides.setdefault("num_channels", data.channels)
    if config.drop_path is not None:
        overrides["drop_path_rate"] = config.drop_path
    overrides = in_model_range(overrides)  # the pipelines feed [-1, 1]
    unknown = sorted(set(overrides) - set(ViT.CONFIG_KEYS))
    if unknown:
        raise ValueError(f"Unknown model setting(s) {unknown}. Valid: "
                         f"{', '.join(ViT.CONFIG_KEYS)}.")
    return overrides


def load_training_data(config):
    """The `Dataset` a `TrainConfig` trains on."""
    return data_lib.load_dataset(
        config.dataset, config.val_fraction, config.data_dir, config.manual_dir,
        config.train_examples, skip_bad_images=bool(config.skip_bad_images),
        val_examples=config.val_examples, pipeline=config.input_pipeline)


def train(config, resume=False, overwrite=False, callbacks=(), verbose=1, take_over_lock=False,
          track=None):
    """Trains a ViT as `config` (a `TrainConfig`) says and returns its metrics.

    The run directory is locked and written atomically: a run killed at any moment
    resumes to an uninterrupted run's final weights (docs/training.md, "What survives a crash").

    Args:
        config: `TrainConfig`.
        resume: bool. Continue the run in `config.output_dir` (same settings
            required); a completed run only returns its metrics.
        overwrite: bool. Replace the run in `config.output_dir` (it comes back if the new
            one fails before its first checkpoint). Without either, an existing run is an error.
        callbacks: extra Keras callbacks for `fit`.
        verbose: 0 (silent), 1 (progress bar) or 2 (one line per epoch).
        take_over_lock: bool. Take over a lock left by a process that no longer runs.
        track: None, or a dict of `keras_vitnorm.training.tracking.TrackedRun`
            arguments: log the run's settings, epochs and metrics to MLflow.

    Returns:
        The dict written to `<output_dir>/metrics.json`.

    Raises:
        TrainingDiverged: the loss became NaN or infinite (`status: "diverged"`).
        run_files.LockedError: another process owns the run directory.
        run_files.StorageError: a run file could not be written (the last checkpoint is
            intact).
        RunInterrupted: SIGTERM or SIGINT stopped the run at a step's end, checkpointed.
    """
    config.validate()
    stop = interrupts.StopRequest()
    with stop.listening():
        try:
            return _train(config, resume, overwrite, callbacks, verbose, take_over_lock, stop,
                          track)
        except interrupts.RunInterrupted as interrupted:
            if interrupted.run_dir is None:  # stopped before the run's directory was claimed
                raise _described(interrupted) from None
            raise
        except Exception as error:  # before the directory was claimed (`_train` after)
            interrupted = stop.stop_behind(error)
            if interrupted is None:
                raise
            raise _described(interrupted) from error


def _tracked(track, config, directory, run, callbacks):
    """`run(callbacks)` with the run tracked in MLflow (`keras_vitnorm.training.tracking`)."""
    from keras_vitnorm.training import tracking

    tracked = tracking.TrackedRun(directory.path, params=config.to_dict(),
                                  **{"name": os.path.basename(directory.path), **track})
    try:
        metrics = run([*callbacks, tracked.callback()])
    except TrainingDiverged:
        metrics = durable.read_json(directory.metrics)
        tracked.finish(metrics or {}, status="FAILED")
        raise
    tracked.finish(metrics)
    return metrics


def _described(interrupted, directory=None, plan=None):
    """`interrupted` with a message that says where the run stands and what resumes it
    (read while the run's lock is held)."""
    name = interrupts.signal_name(interrupted.signal)
    if directory and replaced_run.keeps_replaced_run(directory.path):
        return interrupted.describe(  # not resumable: the next command puts the old run back
            f"Stopped by {name} before the new run's first checkpoint: the run it replaces in "
            f"{directory.path} is kept, and comes back with the next command there.",
            directory.path)
    if not (directory and os.path.isfile(os.path.join(directory.path, SETTINGS_FILE))):
        return interrupted.describe(
            f"Stopped by {name} before the run directory was set up: nothing was written.")
    found = callbacks_lib.RunCheckpoint.latest(directory.backup)
    step = found[1]["step"] if found else None
    if step is None:
        where = f"before its first checkpoint: resumed, the run in {directory.path} starts " \
                "from step 0."
    elif step >= plan.total_steps:
        where = (f"after the last step ({step}): resumed, the run in {directory.path} goes "
                 "straight to its final evaluation.")
    else:
        where = (f"at step {step} of {plan.total_steps}: the run in {directory.path} resumes "
                 f"from its checkpoint of that step ({found[0]}).")
    return interrupted.describe(f"Stopped by {name} {where}", directory.path, resumable=True)


def _train(config, resume, overwrite, callbacks, verbose, take_over_lock, stop, track=None):
    """`train`, with `stop` listening for signals."""
    say = print if verbose else (lambda *args, **kwargs: None)
    if config.output_dir:  # a directory the run cannot use is refused before anything loads
        run_directory.check_output_dir(config.output_dir, resume, overwrite)
    data = load_training_data(config)
    config, notes = fit_to_data(config, data.train.size)
    plan = plan_run(config, data, _model_overrides(config, data))
    for note in notes:
        say(note)
    if not plan.lead:  # another process of a torch run: its first process owns the files
        say = lambda *args, **kwargs: None  # noqa: E731
    path = config.output_dir
    if not path and resume:
        path = run_directory.find_run_to_resume(config)
        if run_directory.completed_metrics(path) is None:
            say(f"Resuming {path}, the latest unfinished run of these settings (--output-dir "
                "names another).")
    if resume:  # nothing to resume: refused before the lock creates anything
        run_directory.check_resumable(path)
    # Without a path, the first process makes a new directory in runs/ when it claims it.
    directory = RunDirectory(path or run_directory.default_output_dir(config))
    with contextlib.ExitStack() as held:
        claimed = []

        def claim_output_dir():  # the first process locks and prepares the run directory
            nonlocal directory
            if path:
                lock = run_files.RunLock(path, LOCK_FILE, take_over=take_over_lock)
                held.enter_context(lock)
            else:
                lock = run_directory.new_run_lock(config, take_over_lock)  # acquired
                held.callback(lock.release)
                directory = RunDirectory(lock.directory)
            claimed.append(directory)
            return run_directory.prepare(config, directory.path, resume, overwrite, say)

        def run(callbacks):
            return _run_or_undo_start(config, data, directory, plan, resume, say, stop, callbacks,
                                      verbose, bool(claimed))

        try:
            completed = first_process_then_all(plan, claim_output_dir)
            if plan.process[1] > 1:
                completed = backend.from_first_process(completed)
            if completed is not None:
                say(f"The run in {directory.path} has already completed: nothing to resume "
                    f"(test accuracy {completed.get('test_accuracy')}).")
                return completed
            if track is None or not plan.lead:
                return run(callbacks)
            return _tracked(track, config, directory, run, callbacks)
        except (Exception, interrupts.RunInterrupted) as error:
            interrupted = (error if isinstance(error, interrupts.RunInterrupted)
                           else stop.stop_behind(error))
            if interrupted is None:
                raise
            completed = claimed and run_directory.completed_metrics(claimed[0].path)
            if completed:  # the signal came after the run completed: nothing to stop
                say(f"{interrupts.signal_name(interrupted.signal)} received after the run in "
                    f"{claimed[0].path} completed.")
                return completed
            raise _described(interrupted, claimed[0] if claimed else None, plan) from None


def _run_or_undo_start(config, data, directory, plan, resume, say, stop, callbacks, verbose,
                       claimed):
    """`_run`; a new run in a directory this process `claimed` that fails before its first
    checkpoint removes what it wrote and puts back the run it replaced (`replaced_run`)."""
    new = claimed and not resume
    try:
        metrics = _run(config, data, directory, plan, resume, say, stop, callbacks, verbose)
    except Exception as error:
        interrupted = stop.stop_behind(error)
        if interrupted is not None:  # not a failed start: a stop, the run kept to resume
            raise interrupted from error
        if not new:
            raise
        if has_checkpoint_or_result(directory.path):
            replaced_run.drop_replaced(directory.path)  # e.g. a diverged run's result
        elif isinstance(error, run_files.StorageError) and \
                replaced_run.keeps_replaced_run(directory.path):
            # Nothing to resume: the old run goes back, and the same command (not --resume,
            # which would continue the old run) starts the new one once there is space.
            replaced_run.remove_failed_start(directory.path)
            raise run_files.StorageError(error.errno, str(error).replace(
                "continue with --resume", f"{run_files.AGAIN}: the run it was replacing in "
                f"{directory.path} is back in place")) from error
        # A storage error after the first checkpoint leaves a run to continue.
        elif not isinstance(error, (TrainingDiverged, run_files.StorageError)):
            replaced_run.remove_failed_start(directory.path)
        raise
    if new:
        replaced_run.drop_replaced(directory.path)
    return metrics


def _run(config, data, directory, plan, resume, say, stop, callbacks, verbose):
    """Trains in the claimed run directory."""
    keras.utils.set_random_seed(config.seed)
    say(data.describe())
    if plan.replicas > 1:
        say(f"Data-parallel over {plan.replicas} devices ({backend.name()}).")
    if not data_lib.resumes_exactly(augmentation_of(config), data.pipeline.NAME) and resume:
        say("Note: under tf.data, RandAugment, MixUp and CutMix draw from Keras' stateful "
            "generators; the resumed run sees other (equally distributed) draws of them "
            "(the python input pipeline keys them and resumes exactly).")
    # A refused write anywhere else (the CSV and TensorBoard logs) is named the same way.
    safe = f"The run's last checkpoint (in {directory.backup}), if any, is intact."
    with (dtype_policy(config.mixed_precision), plan.scope, data_lib.unreadable_images_named(data),
          run_files.storage_errors(directory.path, safe)):
        return Run(config, data, directory, plan, resume, say, stop).execute(callbacks, verbose)
