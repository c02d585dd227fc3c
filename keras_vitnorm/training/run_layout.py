"""What a training run's directory holds: `RUN_ENTRIES` (docs/training.md, "What a run
writes", and a few more) and their atomic writes' temporary names; `--overwrite` refuses
anything else."""
import csv
import dataclasses
import os

LOCK_FILE = "run.lock"
SETTINGS_FILE = "train_config.json"
METRICS_FILE = "metrics.json"
#: The `status` a run writes in `METRICS_FILE` when it ends, the one time it writes it.
FINISHED_STATUSES = ("completed", "diverged")
#: The run that `--overwrite` replaces, whole, until the new run's first checkpoint.
REPLACED = ".replaced"
#: `REPLACED` while the run's entries are renamed into it or back out of it.
MOVING = ".replaced.moving"
#: Every entry a run writes in its directory.
RUN_ENTRIES = (LOCK_FILE, SETTINGS_FILE, "log.csv", "grad_norms.csv", "tensorboard",
               "checkpoints", "backup", "preset", METRICS_FILE, "analysis.json",
               "mlflow_run.json", REPLACED, MOVING)


def written_by_run(entry):
    """Whether `entry` is one of `RUN_ENTRIES` or an atomic write's temporary name of one."""
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


def contents(output_dir):
    """The entries of `output_dir` other than its lock file."""
    if not os.path.isdir(output_dir):
        return []
    return [entry for entry in os.listdir(output_dir) if entry != LOCK_FILE]


def run_entries(output_dir):
    """What the run in `output_dir` wrote there, but its lock and a run it replaces."""
    return [entry for entry in contents(output_dir)
            if written_by_run(entry) and entry not in (REPLACED, MOVING)]


def has_checkpoint_or_result(output_dir):
    """Whether the run in `output_dir` has a checkpoint or a result: what a failed start lacks."""
    backup = os.path.join(output_dir, "backup")
    steps = os.listdir(backup) if os.path.isdir(backup) else []
    results = (os.path.join(output_dir, name) for name in (METRICS_FILE, "preset"))
    return any(name.startswith("step-") for name in steps) or any(map(os.path.exists, results))


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
                break
    return rows
