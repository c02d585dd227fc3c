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
"""

import csv
import dataclasses
import datetime
import io
import os
import shutil

from keras_vitnorm import durable
from keras_vitnorm.training import run_files
from keras_vitnorm.training.config import setting_changes

LOCK_FILE = "run.lock"
SETTINGS_FILE = "train_config.json"
METRICS_FILE = "metrics.json"


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
    """`runs/<preset>-<dataset>-<time>`."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return os.path.join(RUNS_FOLDER, f"{_run_name(config)}-{stamp}")


def _unfinished_settings(path):
    """The settings of the unfinished run in `path`, or `None` (no run, or finished)."""
    try:
        settings = durable.read_json(os.path.join(path, SETTINGS_FILE))
        metrics = durable.read_json(os.path.join(path, METRICS_FILE))
    except (OSError, ValueError):
        return None
    if not isinstance(settings, dict):
        return None
    if isinstance(metrics, dict) and metrics.get("status") in ("completed", "diverged"):
        return None
    return settings


def find_run_to_resume(config):
    """The run that `config` without an `output_dir` resumes: the latest unfinished run
    in `runs/` with the same settings (`default_output_dir`'s name with the latest time).

    Raises:
        ValueError: there is none; the message names the unfinished runs there are
            and what to pass.
    """
    names = sorted(os.listdir(RUNS_FOLDER)) if os.path.isdir(RUNS_FOLDER) else []
    same, others = [], []
    for name in names:
        path = os.path.join(RUNS_FOLDER, name)
        saved = _unfinished_settings(path)
        if saved is None:
            continue
        current = {**config.to_dict(), "output_dir": saved.get("output_dir")}
        (others if setting_changes(saved, current) else same).append(path)
    if same:
        return same[-1]  # the names of runs of the same settings differ in their time only
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
    if not os.path.isdir(output_dir) or not _contents(output_dir):
        raise ValueError(f"Cannot resume: {output_dir} holds no run.")
    if not os.path.isfile(os.path.join(output_dir, SETTINGS_FILE)):
        raise ValueError(
            f"Cannot resume: {output_dir} has no {SETTINGS_FILE}, so it is not a "
            "keras-vitnorm run directory."
        )



def _contents(output_dir):
    """The entries of `output_dir` other than its lock file."""
    if not os.path.isdir(output_dir):
        return []
    return [entry for entry in os.listdir(output_dir) if entry != LOCK_FILE]


def prepare(config, output_dir, resume, overwrite):
    """Checks the run directory for `resume` (the unfinished run it holds must have the
    same settings) or, for a new run, empties it (`overwrite`) and writes the settings;
    the caller holds its lock."""
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
    with run_files.storage_errors(settings, "Nothing was trained yet.", run_files.AGAIN):
        durable.write_text(settings, config.to_json())


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
