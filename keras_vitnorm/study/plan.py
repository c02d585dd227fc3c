"""A study as one command per run, for any scheduler, and the command that trains one run
(docs/study.md, "A study on a scheduler: plan and collect")."""

import os
import shlex

from keras_vitnorm import backend
from keras_vitnorm import durable

PLAN_FOLDER = "plan"
COMMANDS_FILE = "commands.txt"
JOB_SUFFIX = ".job.json"


def job_file_stem(run_dir, study_dir):
    """The file name stem of a run's job: its run directory relative to the study."""
    return os.path.relpath(run_dir, study_dir).replace(os.sep, "-")


def job(group, name, config, run_dir, study_dir, take_over_lock=False, track=None):
    """What a job file holds: the run's group, variant, seed, settings, run_dir and track."""
    relative = os.path.relpath(run_dir, study_dir)
    return {"group": group, "name": name, "seed": config.seed, "run_dir": relative,
            "config": {**config.to_dict(), "output_dir": relative},
            "take_over_lock": take_over_lock, "verbose": 2, "track": track}


def write_plan(jobs, study_dir, say=None, track=None):
    """Writes each of `jobs`' job file and `commands.txt`, removing stale ones; returns them."""
    folder = os.path.join(study_dir, PLAN_FOLDER)
    os.makedirs(folder, exist_ok=True)
    backend_name = backend.name()
    commands, kept = [], set()
    for group, name, config, run_dir in jobs:
        file_name = job_file_stem(run_dir, study_dir) + JOB_SUFFIX
        path = os.path.join(folder, file_name)
        durable.write_json(path, job(group, name, config, run_dir, study_dir,
                                     track=track(run_dir) if track else None))
        kept.add(file_name)
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
    """A job file's content, its run directory resolved against its study directory; a
    `ValueError` naming the file if it is missing, unreadable or not a job file."""
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
    """Trains, resumes or skips the run of the job file at `path` and writes its
    `analysis.json` (so `--tables-only` only reads files); returns its result row."""
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
                  take_over_lock=content.get("take_over_lock", False), analyze=False,
                  track=content.get("track"))
    if row["status"] == "completed":
        run_analysis(content["run_dir"], probe_images(config))
    return row
