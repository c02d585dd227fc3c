"""`ablate --executor ray`: a study's runs as Ray tasks.

The study is planned as `--plan` plans it (`keras_vitnorm.study.plan`), each job file is
one Ray task that trains it in a child process as `ablate --parallel` does (its output
in `<study>/logs/`), and the finished runs are collected as `--tables-only` collects
them; with a learning-rate sweep, the plan is made again for the runs at the chosen
rates. Ray retries a task whose worker dies (a node lost); a task cancelled or failed
is submitted again by running the same command, each run resuming from its last
checkpoint. The study directory must be on a file system every node shares.
"""

import contextlib
import os
import subprocess
import sys

from keras_vitnorm.study.workers import RunsFailed
from keras_vitnorm.study.workers import start_child

#: Environment variables a task's child process needs as the driver has them.
PASSED_ENVIRONMENT = ("KERAS_BACKEND", "KERAS_VITNORM_NORM_MODULES", "MLFLOW_TRACKING_URI",
                      "MLFLOW_EXPERIMENT_NAME", "PYTHONPATH")


def run_job_file(job, threads):
    """Trains the job file `job["file"]` in a child process, as `ablate --parallel` starts
    one (`workers.start_child`: `threads` compute threads, the output in `job["log"]`);
    returns `(job file, exit status)`.

    The wait is in short steps, so that Ray's cancellation (a `KeyboardInterrupt` raised
    between two Python steps) reaches the task while the run trains; the child is then
    stopped with SIGTERM, which checkpoints the run. Ray kills a dead worker's children.
    It imports nothing of this package (`task`)."""
    process = start_child(job, threads)
    try:
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                return job["file"], process.wait(timeout=1)
    except BaseException:
        process.terminate()
        process.wait()
        raise


def task(ray, cpus_per_run, gpus_per_run):
    """`run_job_file` as a Ray task asking for these resources, retried 3 times where its
    worker dies. It goes to the workers by value, with `workers.start_child`: by
    reference, each worker would import this package, and Keras, before its first run."""
    for module in (__name__, start_child.__module__):
        ray.cloudpickle.register_pickle_by_value(sys.modules[module])
    return ray.remote(num_cpus=cpus_per_run, num_gpus=gpus_per_run, max_retries=3)(run_job_file)


def run_plan_on_ray(plan_study, study_dir, address=None, cpus_per_run=1, gpus_per_run=0,
                    say=print):
    """Plans with `plan_study()` and runs each planned job as a Ray task, until a plan has
    nothing left to train.

    Args:
        plan_study: callable writing the plan (`run_study` in mode `"plan"`); returns the
            list of commands it wrote.
        study_dir: the study directory (its `plan/` holds the job files).
        address: a running Ray cluster's address, or None to start a local Ray.
        cpus_per_run, gpus_per_run: the resources each run's task asks Ray for.
        say: where progress lines go.

    Raises:
        keras_vitnorm.study.workers.RunsFailed: naming the runs whose tasks failed, with
            their logs, once every other task has ended.
    """
    from keras_vitnorm.study.plan import JOB_SUFFIX
    from keras_vitnorm.study.plan import PLAN_FOLDER
    from keras_vitnorm.study.plan import read_job

    try:
        import ray
    except ImportError:
        raise ValueError("--executor ray needs Ray: pip install 'keras-vitnorm[ray]'.") from None
    environment = {key: os.environ[key] for key in PASSED_ENVIRONMENT if key in os.environ}
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, runtime_env={"env_vars": environment},
                 include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    remote = task(ray, cpus_per_run, gpus_per_run)
    logs = os.path.join(study_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    try:
        while plan_study():
            folder = os.path.join(study_dir, PLAN_FOLDER)
            jobs = sorted(os.path.join(folder, name) for name in os.listdir(folder)
                          if name.endswith(JOB_SUFFIX))
            say(f"{len(jobs)} run(s) submitted to Ray, {cpus_per_run} CPU(s) and "
                f"{gpus_per_run} GPU(s) each")
            pending = {}
            for job in jobs:
                described = {**read_job(job), "file": job, "log": os.path.join(
                    logs, os.path.basename(job)[:-len(JOB_SUFFIX)] + ".log")}
                pending[remote.remote(described, max(1, int(cpus_per_run)))] = described
            failed = []
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                described = pending.pop(done[0])
                try:
                    _, status = ray.get(done[0])
                except ray.exceptions.RayError:  # its retries spent, or cancelled
                    status = 1
                if status:
                    failed.append((described, status))
                else:
                    say(f"[{described['group']}] {described['name']} seed {described['seed']}: "
                        "finished")
            if failed:
                raise RunsFailed(failed)
    finally:
        if started_here:
            ray.shutdown()
