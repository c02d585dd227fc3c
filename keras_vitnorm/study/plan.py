"""A study as one command per run, for any scheduler, and the command that trains one run.

`ablate --plan` (`run_study(..., mode="plan")`) trains nothing: it writes, in
`<study>/plan/`, a job file for every run that can train now and `commands.txt`, one
shell command a line, each training one run:

    KERAS_BACKEND=jax keras-vitnorm ablate-job <study>/plan/<group>-<variant>-seed_<s>.job.json

Any scheduler can run the lines, in any order and on any machines that share the
study directory: a Slurm job array (one line per task), Ray, `xargs -P`, or a GPU at
hand. A command resumes its run if it was interrupted and does nothing if the run has
finished, so a line can be run again at any time. The same `ablate` command with
`--tables-only` then collects whatever has finished into the study's tables, and with
`--plan` again writes the runs still to train (with a learning-rate sweep: the runs
at the chosen rates once the sweep has finished).

A job file names its run directory relative to the study directory, which is the
parent of the job file's folder, so a study directory can be moved or copied with
its plan; the dataset and preset paths of its settings are used as given.
"""

import os
import shlex

from keras_vitnorm import backend
from keras_vitnorm import durable

PLAN_FOLDER = "plan"
COMMANDS_FILE = "commands.txt"
JOB_SUFFIX = ".job.json"


def job_file_stem(run_dir, study_dir):
    """The file name stem of a run's job, e.g. `converged-dyt-lr_0.001-seed_0`: its run
    directory relative to the study, one name."""
    return os.path.relpath(run_dir, study_dir).replace(os.sep, "-")


def job(group, name, config, run_dir, study_dir, take_over_lock=False):
    """What a job file holds: the run's group, variant, seed and settings, its run
    directory relative to the study directory."""
    relative = os.path.relpath(run_dir, study_dir)
    return {"group": group, "name": name, "seed": config.seed, "run_dir": relative,
            "config": {**config.to_dict(), "output_dir": relative},
            "take_over_lock": take_over_lock, "verbose": 2}


def write_plan(jobs, study_dir, say=None):
    """Writes the job file of each of `jobs` (`(group, variant, config, run directory)`,
    unfinished runs, each once) and `commands.txt`; job files of runs no longer in the
    plan are removed. Returns the commands, in the plan's order."""
    folder = os.path.join(study_dir, PLAN_FOLDER)
    os.makedirs(folder, exist_ok=True)
    backend_name = backend.name()
    commands, kept = [], set()
    for group, name, config, run_dir in jobs:
        file_name = job_file_stem(run_dir, study_dir) + JOB_SUFFIX
        durable.write_json(os.path.join(folder, file_name),
                           job(group, name, config, run_dir, study_dir))
        kept.add(file_name)
        path = os.path.join(study_dir, PLAN_FOLDER, file_name)
        commands.append(f"KERAS_BACKEND={backend_name} keras-vitnorm ablate-job "
                        f"{shlex.quote(path)}")
    durable.write_text(os.path.join(folder, COMMANDS_FILE),
                       "".join(command + "\n" for command in commands))
    for file_name in sorted(os.listdir(folder)):
        if file_name.endswith(JOB_SUFFIX) and file_name not in kept:
            os.remove(os.path.join(folder, file_name))
    if say:
        say(f"{len(commands)} run(s) to train: one command each in "
            f"{os.path.join(folder, COMMANDS_FILE)}. Run them with any scheduler "
            "(docs/study.md), then rerun this command with --tables-only for the tables"
            + (" (and with --plan for the runs that follow)." if commands else "."))
    return commands


def read_job(path):
    """A job file's content, with its `run_dir` and settings' `output_dir` resolved
    against its study directory.

    Raises:
        ValueError: naming the file, if it is missing, unreadable or not a job file.
    """
    content = durable.read_json(path)  # names the file if it is not JSON
    if content is None:
        raise ValueError(f"No job file at {path}: `ablate --plan` writes them in "
                         f"<study>/{PLAN_FOLDER}/.")
    keys = ("group", "name", "run_dir", "config")
    if not isinstance(content, dict) or not all(key in content for key in keys):
        raise ValueError(f"{path} is not a job file: it needs the keys {', '.join(keys)}.")
    study_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    content["run_dir"] = os.path.join(study_dir, content["run_dir"])
    content["config"] = {**content["config"], "output_dir": content["run_dir"]}
    return content


def run_job(path, verbose=None):
    """Trains, resumes or skips (if finished) the run of the job file at `path`, then
    writes its `analysis.json` where it completed; returns its result row
    (`keras_vitnorm.study.one_run.run_one`).

    The job analyzes its own run, on the study's probe images, so that the runs of a
    plan are analyzed side by side where they trained, and `--tables-only` only reads
    the files instead of loading every run's model one after another.
    """
    from keras_vitnorm.study.one_run import probe_images
    from keras_vitnorm.study.one_run import run_analysis
    from keras_vitnorm.study.one_run import run_one
    from keras_vitnorm.training import TrainConfig

    content = read_job(path)
    try:
        config = TrainConfig(**content["config"])
    except TypeError as error:  # a setting this version does not have
        raise ValueError(f"{path} holds settings this version cannot take ({error}).") from None
    row = run_one(config, content["group"], content["name"], content["run_dir"],
                  content.get("verbose", 2) if verbose is None else verbose,
                  take_over_lock=content.get("take_over_lock", False), analyze=False)
    if row["status"] == "completed":
        run_analysis(content["run_dir"], probe_images(config))
    return row
