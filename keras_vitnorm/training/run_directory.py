"""Setting up a training run's directory: a new run's name and lock, the run `--resume`
continues, the checks that refuse a directory before anything is written, and `prepare`.
"""

import datetime
import itertools
import os

from keras_vitnorm import durable
from keras_vitnorm.training import replaced_run
from keras_vitnorm.training import run_files
from keras_vitnorm.training.config import setting_changes
from keras_vitnorm.training.run_layout import FINISHED_STATUSES
from keras_vitnorm.training.run_layout import LOCK_FILE
from keras_vitnorm.training.run_layout import METRICS_FILE
from keras_vitnorm.training.run_layout import SETTINGS_FILE
from keras_vitnorm.training.run_layout import contents
from keras_vitnorm.training.run_layout import written_by_run
from keras_vitnorm.validation import check_directory_path

#: Where runs without an `output_dir` go.
RUNS_FOLDER = "runs"


def default_output_dir(config):
    """`runs/<preset>-<dataset>-<time>`."""
    preset = os.path.basename(os.path.normpath(config.preset))
    dataset = config.dataset.replace(":", "-").replace(os.sep, "_").strip("_")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join(RUNS_FOLDER, f"{preset}-{dataset}-{stamp}")


def new_run_lock(config, take_over=False):
    """The acquired lock of a new `default_output_dir` (or, where another run took it,
    that with `-2`, `-3`, ...), made atomically so that two runs never share one."""
    base = default_output_dir(config)
    for number in itertools.count(1):
        path = base if number == 1 else f"{base}-{number}"
        if os.path.lexists(path):
            continue
        lock = run_files.RunLock(path, LOCK_FILE, take_over=take_over, new=True)
        try:
            return lock.acquire()
        except FileExistsError:
            if not os.path.lexists(path):
                raise  # not the name taken: a file in the way above it


def _settings_and_status(path):
    """`(settings, status)` of the run in `path` (status `None`: unfinished); `(None,
    None)` where `path` holds no readable run."""
    try:
        settings = durable.read_json(os.path.join(path, SETTINGS_FILE))
        metrics = durable.read_json(os.path.join(path, METRICS_FILE))
    except (OSError, ValueError):
        return None, None
    if not isinstance(settings, dict):
        return None, None
    status = metrics.get("status") if isinstance(metrics, dict) else None
    return settings, status if status in FINISHED_STATUSES else None


def completed_metrics(path):
    """The `metrics.json` of the run in `path` if it completed, else `None`."""
    try:
        metrics = durable.read_json(os.path.join(path, METRICS_FILE))
    except (OSError, ValueError):
        return None
    return metrics if isinstance(metrics, dict) and metrics.get("status") == "completed" else None


def find_run_to_resume(config):
    """The run that `config` without an `output_dir` resumes: the latest unfinished run
    in `runs/` of the same settings, else the latest of them if it completed (a requeued
    `--resume` succeeds); else a `ValueError` naming the unfinished runs."""
    names = sorted(os.listdir(RUNS_FOLDER)) if os.path.isdir(RUNS_FOLDER) else []
    same, others = [], []  # (path, status) of the runs there, oldest first
    for name in names:
        path = os.path.join(RUNS_FOLDER, name)
        saved, status = _settings_and_status(path)
        if saved is not None:
            (others if _changes(config, saved) else same).append((path, status))
    unfinished = [path for path, status in same if status is None]
    if unfinished:
        return unfinished[-1]  # the names of runs of the same settings differ in their time only
    if same and same[-1][1] == "completed":
        return same[-1][0]
    others = [path for path, status in others if status is None]
    listed = (f" (unfinished runs of other settings there: {', '.join(others[-3:])})"
              if others else "")
    raise ValueError(
        f"--resume without --output-dir continues the latest unfinished run of these settings "
        f"in {RUNS_FOLDER}/, and there is no unfinished run of these settings in "
        f"{RUNS_FOLDER}/{listed}. Pass the run to continue: --resume --output-dir "
        f"{RUNS_FOLDER}/<run>, with the settings it was started with.")


def check_resumable(output_dir):
    """Raises the `ValueError` of `prepare` if `output_dir` holds no run to resume,
    before anything is locked or created there."""
    check_directory_path(output_dir)
    if not os.path.isdir(output_dir) or not contents(output_dir):
        raise ValueError(f"Cannot resume: {output_dir} holds no run.")
    if not _holds_run(output_dir):
        raise ValueError(
            f"Cannot resume: {output_dir} has no {SETTINGS_FILE}, so it is not a "
            "keras-vitnorm run directory.")


def check_output_dir(output_dir, resume, overwrite):
    """Raises the error of `prepare` for `output_dir` before anything is loaded, locked
    or created there."""
    if resume:
        check_resumable(output_dir)
    else:
        _check_new_run_dir(output_dir, overwrite)


def _check_new_run_dir(output_dir, overwrite):
    check_directory_path(output_dir)
    entries = contents(output_dir)
    if not entries:
        return
    if not overwrite:
        raise FileExistsError(
            f"Output directory {output_dir} already exists and is not empty. Pass "
            "--resume to continue the run in it, --overwrite to delete it and start "
            "again, or choose another --output-dir.")
    if not _holds_run(output_dir):
        raise FileExistsError(
            f"--overwrite deletes a run directory, but {output_dir} holds files that are "
            f"not a keras-vitnorm run (no {SETTINGS_FILE}; e.g. {sorted(entries)[0]!r}). "
            "Choose another --output-dir.")
    foreign = sorted(entry for entry in entries if not written_by_run(entry))
    if foreign:
        raise FileExistsError(
            f"--overwrite replaces what a run wrote, but the run directory {output_dir} also "
            f"holds {', '.join(map(repr, foreign))}, which no run writes: nothing was "
            "deleted. Move them out of it, or choose another --output-dir.")


def _holds_run(output_dir):
    """Whether `output_dir` holds a run: its settings, or one a killed `--overwrite` moved
    aside (checked once `prepare` has put it back)."""
    return (os.path.isfile(os.path.join(output_dir, SETTINGS_FILE))
            or replaced_run.keeps_replaced_run(output_dir))


def _changes(config, saved):
    """How `config` differs from the `saved` settings of a run (its directory aside)."""
    return setting_changes(saved, {**config.to_dict(), "output_dir": saved.get("output_dir")})


def prepare(config, output_dir, resume, overwrite, say=None):
    """Checks the locked run directory for `resume` (same settings required) or, for a
    new run, moves the old run aside (`overwrite`) and writes the settings; first settles
    what a killed `--overwrite` left, telling `say`. Returns the run's `metrics.json`
    where `resume` finds it completed, else `None`."""
    if resume and overwrite:
        raise ValueError("Give at most one of resume and overwrite.")
    settled = replaced_run.recover_replaced(output_dir)
    if settled and say:
        say(settled)
    settings = os.path.join(output_dir, SETTINGS_FILE)
    if resume:
        check_resumable(output_dir)
        metrics = durable.read_json(os.path.join(output_dir, METRICS_FILE))
        if metrics and metrics.get("status") == "diverged":
            raise ValueError(
                f"Cannot resume: the run in {output_dir} diverged at step "
                f"{metrics.get('diverged_at_step')}; start a new run (e.g. a lower learning rate).")
        details = _changes(config, durable.read_json(settings))
        if details:
            raise ValueError(
                f"Cannot resume {output_dir} with different settings ({details}). "
                "Resume with the same command, or start a new run.")
        return metrics if metrics and metrics.get("status") == "completed" else None
    _check_new_run_dir(output_dir, overwrite)
    replaced_run.move_aside(output_dir)
    with run_files.storage_errors(settings, "Nothing was trained yet.", run_files.AGAIN):
        durable.write_text(settings, config.to_json())
    return None
