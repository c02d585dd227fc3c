"""`ablate --executor ray`: a study's runs as Ray tasks, each job file of the plan one
task that trains it in a child process (docs/your-norm.md, "Running on Ray")."""

import contextlib
import os
import signal
import subprocess
import sys

from keras_vitnorm.study.workers import RunsFailed
from keras_vitnorm.study.workers import start_child

#: Environment variables a task's child process needs as the driver has them.
PASSED_ENVIRONMENT = ("KERAS_BACKEND", "KERAS_VITNORM_NORM_MODULES", "MLFLOW_TRACKING_URI",
                      "MLFLOW_EXPERIMENT_NAME", "PYTHONPATH")


def run_job_file(job, threads):
    """Trains the job file `job["file"]` in a child process (`workers.start_child`);
    returns `(job file, exit status)`. Imports nothing of this package (`task`).

    The wait is in short steps, so that Ray's cancellation (a `KeyboardInterrupt`) reaches
    the task; the child is then stopped with SIGTERM, which checkpoints the run. Ray raises
    it as SIGINT would, which a worker ignores where Ray was started from a shell's
    background job (`nohup ... &` ignores SIGINT for all it starts): the task listens."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
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
    """`run_job_file` as a Ray task, retried 3 times where its worker dies; sent by value,
    as by reference each worker would import this package, and Keras."""
    for module in (__name__, start_child.__module__):
        ray.cloudpickle.register_pickle_by_value(sys.modules[module])
    return ray.remote(num_cpus=cpus_per_run, num_gpus=gpus_per_run, max_retries=3)(run_job_file)


def run_plan_on_ray(plan_study, study_dir, address=None, cpus_per_run=1, gpus_per_run=0,
                    say=print):
    """Plans with `plan_study()` and runs each planned job as a Ray task, until a plan has
    nothing left to train.

    Args:
        plan_study: callable writing the plan; returns the commands it wrote.
        study_dir: the study directory.
        address: a running Ray cluster's address, or None to start a local Ray.
        cpus_per_run, gpus_per_run: the resources each run's task asks Ray for.
        say: where progress lines go.

    Raises:
        workers.RunsFailed: naming the failed runs, once every other task has ended.
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
