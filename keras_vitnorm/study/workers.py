"""Training a study's runs in several processes at once (`ablate --parallel N`), each in
a child process with its own thread count (docs/study.md, "Several runs at once")."""

import os
import subprocess
import sys
import time

#: Exit status of a child whose run could not write a file (as the CLI's).
STORAGE_EXIT_CODE = 4


class RunsFailed(RuntimeError):
    """Runs of a parallel study ended with an error; `.failures` lists `(job, exit status)`."""

    def __init__(self, failures):
        self.failures = failures
        lines = [f"{len(failures)} run(s) failed; finished runs are kept, rerun to continue:"]
        for job, code in failures:
            lines.append(f"  [{job['group']}] {job['name']} seed {job['seed']}: exit status "
                         f"{code}; {_last_line(job['log'])} (log: {job['log']})")
        super().__init__("\n".join(lines))


def _last_line(path):
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return "no log"
    return lines[-1] if lines else "empty log"


def thread_environment(threads, environ=None):
    """A copy of `environ` (default `os.environ`) in which PyTorch, TensorFlow and JAX each
    use `threads` compute threads (TensorFlow one inter-op thread: a step is one graph)."""
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads per run must be a positive integer, got {threads!r}.")
    env = dict(os.environ if environ is None else environ)
    env.update(OMP_NUM_THREADS=str(threads), TF_NUM_INTRAOP_THREADS=str(threads),
               TF_NUM_INTEROP_THREADS="1")
    xla = (f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'} "
           f"intra_op_parallelism_threads={threads}")
    env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} {xla}" if env.get("XLA_FLAGS") else xla
    return env


def usable_cores():
    """The CPU cores this process may run on (its affinity, e.g. under `taskset`);
    `None` where the platform cannot tell."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def default_threads_per_run(parallel):
    """The CPU cores this process may use, shared out over `parallel` runs (at least 1)."""
    return max(1, (usable_cores() or 1) // parallel)


def child_command(job_file):
    """The command of the child process that trains the job in `job_file` (`main`)."""
    return [sys.executable, "-m", "keras_vitnorm.study", job_file]


def start_child(job, threads):
    """Starts the child process that trains `job`; its output goes to `job['log']`."""
    with open(job["log"], "a") as log:
        return subprocess.Popen(child_command(job["file"]), stdout=log,
                                stderr=subprocess.STDOUT, env=thread_environment(threads))


def train_in_workers(jobs, parallel, start, on_finish=None, poll_seconds=1.0, say=print):
    """Trains `jobs` with at most `parallel` children at a time, in the order given.

    Args:
        jobs: list of dicts with at least `group`, `name`, `seed` and `log`.
        parallel: int >= 1, children at once.
        start: `start(job)` -> a started process (`poll()`, `terminate()`, `wait()`).
        on_finish: called with each job whose child exited with status 0.
        poll_seconds: how often the children are checked.
        say: where progress lines go (`None`: nowhere).

    Raises:
        RunsFailed: once the running children have finished, if any failed (no child
            starts after a failure).
        RunInterrupted: SIGTERM or SIGINT, after the children stopped with a checkpoint.
    """
    from keras_vitnorm.training.interrupts import RunInterrupted
    from keras_vitnorm.training.interrupts import StopRequest

    say = say or (lambda text: None)
    # The stop waits for the loop (a child started is a child to stop) and its next poll.
    request = StopRequest(say=lambda text: None)
    pending, running, failures, done = list(jobs), [], [], 0
    with request.listening():
        try:
            with request.deferred():
                while (running or (pending and not failures)) and request.signal is None:
                    while (pending and not failures and len(running) < parallel
                           and request.signal is None):
                        job = pending.pop(0)
                        say(f"[{job['group']}] {job['name']} seed {job['seed']}: training in a "
                            f"worker process (log: {job['log']})")
                        running.append((job, start(job)))
                    time.sleep(poll_seconds)
                    still_running = []
                    for job, process in running:
                        code = process.poll()
                        if code is None:
                            still_running.append((job, process))
                        elif code:
                            failures.append((job, code))
                        else:
                            done += 1
                            say(f"[{job['group']}] {job['name']} seed {job['seed']}: finished "
                                f"({done} of {len(jobs)})")
                            if on_finish:
                                on_finish(job)
                    running[:] = still_running
                if failures:
                    raise RunsFailed(failures)
        except RunInterrupted as stop:
            if running:
                names = ", ".join(f"[{job['group']}] {job['name']} seed {job['seed']}"
                                  for job, _ in running)
                stop.describe(f"{stop} The runs in training ({names}) stopped, each with a "
                              "checkpoint of the step it was at.")
            raise
        finally:  # only left with running children by an exception or a signal
            for _, process in running:
                process.terminate()
            for _, process in running:
                process.wait()


def train_jobs(jobs, study_dir, parallel, threads, take_over_lock, on_finish, say=None,
               track=None):
    """Trains `jobs` in worker processes, each with a job file beside its log in `logs/`."""
    from keras_vitnorm import durable
    from keras_vitnorm.study import plan as plan_lib

    log_dir = os.path.join(study_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    work = []
    for group, name, config, run_dir in jobs:
        stem = os.path.join(log_dir, plan_lib.job_file_stem(run_dir, study_dir))
        job = plan_lib.job(group, name, config, run_dir, study_dir, take_over_lock,
                           track(run_dir) if track else None)
        job.update(file=stem + plan_lib.JOB_SUFFIX, log=stem + ".log")
        durable.write_json(job["file"], job)
        work.append(job)
    if work and say:
        say(f"{len(work)} run(s) to train, {parallel} at a time with {threads} thread(s) each")
    train_in_workers(work, parallel, lambda job: start_child(job, threads),
                     on_finish=on_finish, say=say)


def main(argv=None):
    """Child entry point: trains the run a job file describes; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m keras_vitnorm.study JOB_FILE", file=sys.stderr)
        return 2
    from keras_vitnorm import host_memory

    host_memory.retain_freed_memory()
    from keras_vitnorm.study.plan import run_job
    from keras_vitnorm.training.interrupts import RunInterrupted
    from keras_vitnorm.training.run_files import LockedError
    from keras_vitnorm.training.run_files import StorageError

    try:
        run_job(argv[0])
    # the exit statuses are keras_vitnorm.cli.errors's; a RunInterrupted is the parent
    # passing on a scheduler's stop or Ctrl-C
    except (RunInterrupted, StorageError, ValueError, OSError, LockedError) as error:
        print(f"error: {error}", file=sys.stderr)
        if isinstance(error, RunInterrupted):
            return error.exit_status
        return STORAGE_EXIT_CODE if isinstance(error, StorageError) else 2
    return 0
