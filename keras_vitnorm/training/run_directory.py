"""A training run's directory: its layout, a new run's set-up, and its logs cut back to
a checkpoint when the run resumes.

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
    analysis.json            what a study reads of the trained model
                             (`keras_vitnorm.study.one_run.run_analysis`)
    .replaced/               the run that `--overwrite` replaces, kept until the new
                             run has its first checkpoint (`move_aside`)
    .replaced.moving/        the same while its entries move in or out

These (`RUN_ENTRIES`) and the temporary names of their atomic writes are all a run
directory holds: `--overwrite` replaces them and refuses a directory that holds
anything else, naming it.

`--overwrite` deletes the old run only once the new one has its first checkpoint: until
then it is moved aside (`move_aside`), a start that fails puts it back, and what a
killed command leaves the next command there settles first (`recover_replaced`).
"""

import contextlib
import csv
import dataclasses
import datetime
import io
import itertools
import os
import shutil

from keras_vitnorm import durable
from keras_vitnorm.training import run_files
from keras_vitnorm.training.config import setting_changes
from keras_vitnorm.validation import check_directory_path

LOCK_FILE = "run.lock"
SETTINGS_FILE = "train_config.json"
METRICS_FILE = "metrics.json"
#: The run that `--overwrite` replaces, whole, until the new run's first checkpoint.
REPLACED = ".replaced"
#: `REPLACED` while the run's entries are renamed into it or back out of it.
MOVING = ".replaced.moving"
#: Every entry a run writes in its directory (the module docstring's layout).
RUN_ENTRIES = (LOCK_FILE, SETTINGS_FILE, "log.csv", "grad_norms.csv", "tensorboard",
               "checkpoints", "backup", "preset", METRICS_FILE, "analysis.json",
               "mlflow_run.json", REPLACED, MOVING)


def written_by_run(entry):
    """Whether the directory entry `entry` is one a run writes: one of `RUN_ENTRIES`,
    or the temporary name of an atomic write of one (`keras_vitnorm.durable`)."""
    for prefix, suffix in (("", ""), (".writing.", ""), (".", ".writing"), (".", ".old")):
        if (entry.startswith(prefix) and entry.endswith(suffix)
                and entry[len(prefix):len(entry) - len(suffix)] in RUN_ENTRIES):
            return True
    return False


@dataclasses.dataclass
class RunDirectory:
    """The paths of a run directory's files."""

    path: str

    def __post_init__(self):
        self.backup = os.path.join(self.path, "backup")
        self.log = os.path.join(self.path, "log.csv")
        self.grad_norms = os.path.join(self.path, "grad_norms.csv")
        self.preset = os.path.join(self.path, "preset")
        self.tensorboard = os.path.join(self.path, "tensorboard")
        self.metrics = os.path.join(self.path, METRICS_FILE)
        self.checkpoints = {name: os.path.join(self.path, "checkpoints", name)
                            for name in ("best", "last")}


#: Where runs without an `output_dir` go.
RUNS_FOLDER = "runs"


def _run_name(config):
    preset = os.path.basename(os.path.normpath(config.preset))
    dataset = config.dataset.replace(":", "-").replace(os.sep, "_").strip("_")
    return f"{preset}-{dataset}"


def default_output_dir(config):
    """`runs/<preset>-<dataset>-<time>` (`new_run_lock` adds `-2`, `-3`, ... to a name
    another run took)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join(RUNS_FOLDER, f"{_run_name(config)}-{stamp}")


def new_run_lock(config, take_over=False):
    """The acquired lock of a new directory of its own for a run without an
    `output_dir`: `default_output_dir`, or, where another run took that name (two runs
    started in the same second), the same with `-2`, `-3`, ... Each name is made
    atomically (`RunLock(new=True)`), so two runs never share one."""
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
    """`(settings, status)` of the run in `path`: its `status` is `None` while it is
    unfinished; `(None, None)` where `path` holds no readable run."""
    try:
        settings = durable.read_json(os.path.join(path, SETTINGS_FILE))
        metrics = durable.read_json(os.path.join(path, METRICS_FILE))
    except (OSError, ValueError):
        return None, None
    if not isinstance(settings, dict):
        return None, None
    status = metrics.get("status") if isinstance(metrics, dict) else None
    return settings, status if status in ("completed", "diverged") else None


def completed_metrics(path):
    """The `metrics.json` of the run in `path` if it completed, else `None`."""
    try:
        metrics = durable.read_json(os.path.join(path, METRICS_FILE))
    except (OSError, ValueError):
        return None
    return metrics if isinstance(metrics, dict) and metrics.get("status") == "completed" else None


def find_run_to_resume(config):
    """The run that `config` without an `output_dir` resumes: the latest unfinished run
    in `runs/` with the same settings (`default_output_dir`'s name with the latest time)
    or, where there is none and the latest run of these settings completed, that one
    (resuming it does nothing: a scheduler that runs `--resume` again after a run
    finished gets its success).

    Raises:
        ValueError: there is none; the message names the unfinished runs there are
            and what to pass.
    """
    names = sorted(os.listdir(RUNS_FOLDER)) if os.path.isdir(RUNS_FOLDER) else []
    same, others, latest = [], [], None
    for name in names:
        path = os.path.join(RUNS_FOLDER, name)
        saved, status = _settings_and_status(path)
        if saved is None:
            continue
        current = {**config.to_dict(), "output_dir": saved.get("output_dir")}
        if setting_changes(saved, current):
            if status is None:
                others.append(path)
            continue
        latest = (path, status)
        if status is None:
            same.append(path)
    if same:
        return same[-1]  # the names of runs of the same settings differ in their time only
    if latest is not None and latest[1] == "completed":
        return latest[0]
    listed = (f" (unfinished runs of other settings there: {', '.join(others[-3:])})"
              if others else "")
    raise ValueError(
        f"--resume without --output-dir continues the latest unfinished run of these settings "
        f"in {RUNS_FOLDER}/, and there is no unfinished run of these settings in "
        f"{RUNS_FOLDER}/{listed}. Pass the run to continue: --resume --output-dir "
        f"{RUNS_FOLDER}/<run>, with the settings it was started with."
    )


def check_resumable(output_dir):
    """Raises the `ValueError` of `prepare` if `output_dir` holds no run to resume,
    before anything is locked or created there."""
    check_directory_path(output_dir)
    if not os.path.isdir(output_dir) or not _contents(output_dir):
        raise ValueError(f"Cannot resume: {output_dir} holds no run.")
    if not _holds_run(output_dir):
        raise ValueError(
            f"Cannot resume: {output_dir} has no {SETTINGS_FILE}, so it is not a "
            "keras-vitnorm run directory."
        )


def check_output_dir(output_dir, resume, overwrite):
    """Raises the error of `prepare` for `output_dir` before anything is loaded, locked
    or created there: a file in its place, no run to resume, or a directory a new run
    may not use (not empty without `overwrite`, or holding what no run writes)."""
    if resume:
        check_resumable(output_dir)
    else:
        _check_new_run_dir(output_dir, overwrite)


def _check_new_run_dir(output_dir, overwrite):
    check_directory_path(output_dir)
    contents = _contents(output_dir)
    if not contents:
        return
    if not overwrite:
        raise FileExistsError(
            f"Output directory {output_dir} already exists and is not empty. Pass "
            "--resume to continue the run in it, --overwrite to delete it and start "
            "again, or choose another --output-dir."
        )
    if not _holds_run(output_dir):
        raise FileExistsError(
            f"--overwrite deletes a run directory, but {output_dir} holds files that are "
            f"not a keras-vitnorm run (no {SETTINGS_FILE}; e.g. {sorted(contents)[0]!r}). "
            "Choose another --output-dir."
        )
    foreign = sorted(entry for entry in contents if not written_by_run(entry))
    if foreign:
        raise FileExistsError(
            f"--overwrite replaces what a run wrote, but the run directory {output_dir} also "
            f"holds {', '.join(map(repr, foreign))}, which no run writes: nothing was "
            "deleted. Move them out of it, or choose another --output-dir."
        )


def _contents(output_dir):
    """The entries of `output_dir` other than its lock file."""
    if not os.path.isdir(output_dir):
        return []
    return [entry for entry in os.listdir(output_dir) if entry != LOCK_FILE]


def _holds_run(output_dir):
    """Whether `output_dir` holds a run: its settings, or a run that a killed
    `--overwrite` moved aside (checked once `prepare` has put it back)."""
    return (os.path.isfile(os.path.join(output_dir, SETTINGS_FILE))
            or keeps_replaced_run(output_dir))


def _run_entries(output_dir):
    """What the run in `output_dir` wrote there, but its lock and a run it replaces."""
    return [entry for entry in _contents(output_dir)
            if written_by_run(entry) and entry not in (REPLACED, MOVING)]


def has_checkpoint_or_result(output_dir):
    """Whether the run in `output_dir` has a checkpoint (`backup/step-<N>/`, renamed into
    place whole) or a result (`preset/`, `metrics.json`): what a start that failed lacks."""
    backup = os.path.join(output_dir, "backup")
    steps = os.listdir(backup) if os.path.isdir(backup) else []
    results = (os.path.join(output_dir, name) for name in (METRICS_FILE, "preset"))
    return any(name.startswith("step-") for name in steps) or any(map(os.path.exists, results))


def keeps_replaced_run(output_dir):
    """Whether `output_dir` holds a run that an `--overwrite` moved (or was moving) aside
    and that the next command there puts back: the new run has no checkpoint yet."""
    if os.path.isdir(os.path.join(output_dir, MOVING)):
        return True
    return (os.path.isdir(os.path.join(output_dir, REPLACED))
            and not has_checkpoint_or_result(output_dir))


def move_aside(output_dir):
    """Moves the run in `output_dir` (what a run wrote there, but the lock) into
    `REPLACED`, where it stays until the new run has its first checkpoint
    (`drop_replaced`) or fails before it (`remove_failed_start`). Each entry is renamed
    into `MOVING`, which is then renamed `REPLACED` whole, so a kill part way leaves
    `MOVING`, whose entries the next command puts back (`recover_replaced`)."""
    entries = _run_entries(output_dir)
    if not entries:
        return
    moving = os.path.join(output_dir, MOVING)
    with run_files.storage_errors(output_dir, "The run there is kept.", run_files.AGAIN):
        os.mkdir(moving)
        for entry in entries:
            os.rename(os.path.join(output_dir, entry), os.path.join(moving, entry))
        os.rename(moving, os.path.join(output_dir, REPLACED))


def _put_back(output_dir):
    """Moves the entries of the run that `move_aside` moved aside back into `output_dir`,
    which holds no run entries of its own by then. `REPLACED` is renamed `MOVING` first:
    a kill part way leaves `MOVING`, as a kill in `move_aside` does."""
    replaced, moving = (os.path.join(output_dir, name) for name in (REPLACED, MOVING))
    if os.path.isdir(replaced):
        os.rename(replaced, moving)
    if not os.path.isdir(moving):
        return
    for entry in sorted(os.listdir(moving)):
        target = os.path.join(output_dir, entry)
        if os.path.lexists(target):
            raise FileExistsError(
                f"Cannot put back {os.path.join(moving, entry)}, the run that --overwrite was "
                f"replacing: {target} is in its place. Move one of them out of {output_dir}.")
        os.rename(os.path.join(moving, entry), target)
    os.rmdir(moving)


def drop_replaced(output_dir, strict=False):
    """Deletes the run that `move_aside` kept in `output_dir`, if any: the new run there
    has a checkpoint (or a result) now. Where that fails (a file held open, a
    permission), the error is raised with `strict`; without it the old run stays, and
    the next command there deletes it first (`recover_replaced`), so a run in training
    is not stopped for it."""
    path = os.path.join(output_dir, REPLACED)
    if strict:
        with run_files.storage_errors(path, "Nothing was changed in the new run.",
                                      run_files.AGAIN):
            if os.path.isdir(path):
                shutil.rmtree(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def recover_replaced(output_dir):
    """Settles what a process that replaced the run in `output_dir` left when it was
    killed (`move_aside`): the old run is put back unless the new run has a checkpoint
    or a result, in which case the old run is deleted. The caller holds the lock.

    Returns:
        What was done, for the user, or `None` where there was nothing to settle.
    """
    replaced = os.path.isdir(os.path.join(output_dir, REPLACED))
    if replaced and has_checkpoint_or_result(output_dir):
        drop_replaced(output_dir, strict=True)
        return (f"Deleted the run that an --overwrite was replacing in {output_dir}: the new "
                "run there has a checkpoint.")
    if replaced:  # a new run that never reached its first checkpoint
        remove_failed_start(output_dir)
    elif os.path.isdir(os.path.join(output_dir, MOVING)):  # killed while moving: all old entries
        _put_back(output_dir)
    else:
        return None
    return (f"Put back the run that an --overwrite was replacing in {output_dir}: that "
            "command stopped before the new run's first checkpoint, and what the new run had "
            "written is removed.")


def prepare(config, output_dir, resume, overwrite, say=None):
    """Checks the run directory for `resume` (the run it holds must have the same
    settings) or, for a new run, empties it (`overwrite`: the run there, never anything
    else, is moved aside until the new run's first checkpoint: `move_aside`) and writes
    the settings; the caller holds its lock. A run that a killed `--overwrite` left moved
    aside is settled first (`recover_replaced`), and `say` (e.g. `print`) tells of it.

    Returns:
        The run's `metrics.json` where `resume` finds it completed (nothing to do),
        else `None`.
    """
    if resume and overwrite:
        raise ValueError("Give at most one of resume and overwrite.")
    settled = recover_replaced(output_dir)
    if settled and say:
        say(settled)
    settings = os.path.join(output_dir, SETTINGS_FILE)
    if resume:
        check_resumable(output_dir)
        metrics = durable.read_json(os.path.join(output_dir, METRICS_FILE))
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
        return metrics if metrics and metrics.get("status") == "completed" else None
    _check_new_run_dir(output_dir, overwrite)
    move_aside(output_dir)
    with run_files.storage_errors(settings, "Nothing was trained yet.", run_files.AGAIN):
        durable.write_text(settings, config.to_json())
    return None


def remove_failed_start(output_dir):
    """Removes what a new run that failed before its first checkpoint wrote in
    `output_dir` (the entries of `RUN_ENTRIES` but its lock, which its holder releases;
    anything else stays) and puts back the run it was replacing (`move_aside`), so that
    the same command runs once its cause is fixed, and no run is lost."""
    for entry in _run_entries(output_dir):
        path = os.path.join(output_dir, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    _put_back(output_dir)


def read_log(path):
    """The rows of `log.csv` as dicts of numbers; a row cut short by a kill ends them."""
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


def truncate_csv(path, keep):
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
