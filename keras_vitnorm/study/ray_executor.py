"""`ablate --executor ray`: a study's runs as Ray tasks.

The study is planned as `--plan` plans it (`keras_vitnorm.study.plan`), each job file is
one Ray task that runs `keras-vitnorm ablate-job FILE` in a child process (its output in
`<study>/logs/`), and the finished runs are collected as `--tables-only` collects them.
With a learning-rate sweep the plan is made again once the sweep's runs have finished,
for the runs at the chosen rates. A task whose worker dies (a node lost) is retried by
Ray, and a task cancelled or failed is submitted again by running the same command: an
`ablate-job` resumes its run from its last checkpoint and skips a finished one. The
study directory must be on a file system every node of the cluster shares.
"""

import os
import subprocess
import sys

#: Environment variables a task's child process needs as the driver has them.
PASSED_ENVIRONMENT = ("KERAS_BACKEND", "KERAS_VITNORM_NORM_MODULES", "MLFLOW_TRACKING_URI",
                      "MLFLOW_EXPERIMENT_NAME", "PYTHONPATH")


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--executor ray needs Ray: pip install 'keras-vitnorm[ray]'.") from None
    return ray


def run_job_file(job_file, log_file):
    """Runs one job file in a child process; returns `(job file, exit status)`."""
    with open(log_file, "ab") as log:
        status = subprocess.call([sys.executable, "-m", "keras_vitnorm", "ablate-job", job_file],
                                 stdout=log, stderr=subprocess.STDOUT)
    return job_file, status


def run_plan_on_ray(plan_study, study_dir, address=None, cpus_per_run=1, gpus_per_run=0,
                    say=print):
    """Plans with `plan_study()` (`run_study` in mode `"plan"`, returning its commands) and
    runs each planned job as a Ray task, until a plan has nothing left to train.

    Args:
        plan_study: callable writing the plan; returns the list of commands it wrote.
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
    from keras_vitnorm.study.workers import RunsFailed

    ray = _ray()
    environment = {key: os.environ[key] for key in PASSED_ENVIRONMENT if key in os.environ}
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, runtime_env={"env_vars": environment},
                 include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    task = ray.remote(num_cpus=cpus_per_run, num_gpus=gpus_per_run, max_retries=3)(run_job_file)
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
                described = {**read_job(job), "log": os.path.join(
                    logs, os.path.basename(job)[:-len(JOB_SUFFIX)] + ".log")}
                pending[task.remote(job, described["log"])] = described
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
