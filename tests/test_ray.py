"""`ablate --executor ray` on a local Ray on this CPU: a 2-run plan trained as Ray tasks,
with one run failing first (named with its log, the other run kept), then the same
command again, which trains the failed run and skips the finished one; its tables are
those of the same plan trained by `ablate` itself. Runs whose tasks Ray cancels, or
whose worker it kills, resume from their checkpoints when the command runs again."""

import csv
import glob
import json
import os
import signal
import time

import pytest

from keras_vitnorm import cli
from keras_vitnorm.layers.normalization import NORM_MODULES_VARIABLE
from keras_vitnorm.study import plan as plan_lib
from keras_vitnorm.study import ray_executor
from keras_vitnorm.training import run_layout
from keras_vitnorm.training.run_files import LockedError
from test_training import assert_unlocked

ray = pytest.importorskip("ray", reason="Ray is the optional `ray` extra")

TINY = ["--image-size", "16", "--patch-size", "4", "--width", "32", "--depth", "1",
        "--num-heads", "2", "--mlp-dim", "64", "--steps", "4", "--grad-norm-every", "2",
        "--batch-size", "32", "--warmup-steps", "1", "--verbose", "0"]
SLOW_NORM = os.path.join(os.path.dirname(__file__), "slow_norm.py")
PLAN = ["ablate", "--groups", "stems", "--variants", "stems:dual_patchnorm", "--seeds", "0"]


def _results(path):
    """results.csv without its timings, which differ from one training to the next."""
    with open(path, newline="") as file:
        return [{key: value for key, value in row.items() if key != "train_seconds"}
                for row in csv.DictReader(file)]


@pytest.mark.one_backend
def test_a_plan_on_ray_names_a_failed_run_resumes_and_tables_as_ablate_does(tmp_path, capsys):
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        study = tmp_path / "ray"
        blocked = study / "stems" / "patch" / "seed_0"
        blocked.mkdir(parents=True)
        (blocked / "notes.txt").write_text("mine")  # a file of the user's: the run refuses
        argv = [*PLAN, "--output-dir", str(study), "--executor", "ray", *TINY]
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert "[stems] patch seed 0: exit status 2" in err and "stems-patch-seed_0.log" in err
        finished = study / "stems" / "dual_patchnorm" / "seed_0" / run_layout.METRICS_FILE
        assert finished.exists()
        written = finished.stat().st_mtime_ns
        os.remove(blocked / "notes.txt")
        assert cli.main(argv) == 0  # the failed run trains; the finished one is skipped
        assert finished.stat().st_mtime_ns == written
    finally:
        ray.shutdown()
    assert cli.main([*PLAN, "--output-dir", str(tmp_path / "direct"), *TINY]) == 0
    assert (study / "stems.md").read_text() == (tmp_path / "direct" / "stems.md").read_text()
    assert _results(study / "results.csv") == _results(tmp_path / "direct" / "results.csv")


def _wait_for(condition, what, seconds=300):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {seconds} s"
        time.sleep(0.2)


@pytest.mark.one_backend
def test_runs_whose_ray_tasks_are_cancelled_or_killed_resume_from_their_checkpoints(
        tmp_path, monkeypatch):
    # 200 steps in epochs of 20, a checkpoint at each epoch's end: each task is cancelled
    # once its run has one, the first as `ray.cancel` asks a task to stop, the second by
    # killing its worker (force=True), as a node lost would. Neither run goes on training
    # or holds its lock; the same command on Ray then resumes each from a checkpoint and
    # finishes it. A norm that sleeps keeps each run training for seconds on any host. Ray
    # is started with SIGINT ignored, as a shell's background job (`nohup ... &`) starts
    # it: its workers inherit that, and the cancel must arrive all the same.
    monkeypatch.setenv(NORM_MODULES_VARIABLE, SLOW_NORM)
    study = tmp_path / "ray"
    options = {**dict(zip(TINY[::2], TINY[1::2])), "--steps": "200", "--steps-per-epoch": "20",
               "--verbose": "1", "--norm": "slow_layernorm"}
    argv = [*PLAN, "--output-dir", str(study), *(part for item in options.items() for part in item)]
    assert cli.main([*argv, "--plan"]) == 0
    jobs = sorted(glob.glob(str(study / plan_lib.PLAN_FOLDER / f"*{plan_lib.JOB_SUFFIX}")))
    runs = [plan_lib.read_job(job)["run_dir"] for job in jobs]
    assert len(jobs) == 2
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING",
                 log_to_driver=False, runtime_env={"env_vars": {NORM_MODULES_VARIABLE: SLOW_NORM}})
    finally:
        signal.signal(signal.SIGINT, interrupt)
    try:
        task = ray_executor.task(ray, 1, 0).options(max_retries=0)
        tasks = [task.remote({"file": job, "log": str(tmp_path / f"{i}.log")}, 1)
                 for i, job in enumerate(jobs)]
        for run_dir, ref, force in zip(runs, tasks, (False, True)):
            _wait_for(lambda: glob.glob(os.path.join(run_dir, "backup", "step-*", "state.json")),
                      f"checkpoint in {run_dir}")
            ray.cancel(ref, force=force)
        for ref in tasks:  # waited for after both cancels, so neither run ends meanwhile
            with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
                ray.get(ref, timeout=120)
        for run_dir in runs:
            _wait_for(lambda: _unlocked(run_dir), f"release of {run_dir}", 120)
            assert not os.path.exists(os.path.join(run_dir, run_layout.METRICS_FILE))
        # the task asked to stop stopped its run with a checkpoint of the step it was at
        assert "stopped" in (tmp_path / "0.log").read_text().lower()
        assert cli.main([*argv, "--executor", "ray"]) == 0
    finally:
        ray.shutdown()
    for job, run_dir in zip(jobs, runs):
        log = (study / "logs" / (os.path.basename(job)[:-len(plan_lib.JOB_SUFFIX)] + ".log"))
        assert "Resuming from step" in log.read_text()
        assert _steps(run_dir) == 200


def _unlocked(run_dir):
    try:
        assert_unlocked(run_dir)
    except LockedError:
        return False
    return True


def _steps(run_dir):
    with open(os.path.join(run_dir, run_layout.METRICS_FILE)) as file:
        return json.load(file)["steps"]
