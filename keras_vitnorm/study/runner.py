"""The ablation runner: trains every (variant, seed), then tabulates and plots.

Layout of a study directory:

    <study>/<group>/<variant>/seed_<s>/      one training run (see keras_vitnorm.training)
    <study>/<group>/<variant>/seed_<s>/analysis.json   what the figures and tables read
                                             of the trained model (written when the run ends)
    <study>/results.csv                      one row per run (run directories relative
                                             to the study directory)
    <study>/<group>.md                       the paper-style table of the group
    <study>/<group>_patch_statistics.md      for groups that compare stems: what each
                                             model's predictions rest on, each patch's mean
                                             and std or its pattern
                                             (keras_vitnorm.study.patch_statistics)
    <study>/figures/*.png                    matplotlib figures
    <study>/logs/<group>-<variant>-seed_<s>.log, .job.json   the output and settings of
                                             each run trained in a worker process
                                             (`parallel` > 1)

A run whose `metrics.json` says `completed` or `diverged` is not trained again when the
study is restarted; an interrupted run is resumed from its backup. A variant whose
settings are identical to a run earlier in the study (such as the plain pre-LN baseline
that several groups share) reuses that run instead of training it again; its row's `run_dir`
points at the run it shares.

`export_study` copies what a study's results are made of (tables, figures, and each
finished run's settings, metrics, logs and analysis; no weights) to another directory,
for example one kept under version control. An exported study is itself a study
directory: the same `ablate` command pointed at it skips its finished runs, trains the
missing ones and redraws every figure.
"""

import dataclasses
import json
import os

import numpy as np

from keras_vitnorm import durable
from keras_vitnorm.study import patch_statistics
from keras_vitnorm.study import workers
from keras_vitnorm.study.report import dpn_mechanism
from keras_vitnorm.study.report import make_figures
from keras_vitnorm.study.runs import read_metrics
from keras_vitnorm.study.runs import run_one
from keras_vitnorm.study.tables import write_results
from keras_vitnorm.study.variants import STEM_PAIRS
from keras_vitnorm.study.variants import get_variants
from keras_vitnorm.training import run_files
from keras_vitnorm.training.config import setting_changes


def run_study(base, groups, seeds, output_dir, variants=None, verbose=1, take_over_lock=False,
              parallel=1, threads_per_run=None, train=True):
    """Trains each variant of each group with each seed; returns the result rows.

    Args:
        base: `TrainConfig` every run starts from (its `output_dir`, `seed` and the
            variant's settings are replaced per run).
        groups: list of variant-group names (`keras_vitnorm.study.VARIANT_GROUPS`).
        seeds: list of ints.
        output_dir: the study directory.
        variants: optional `{group: [variant names]}` to run a subset.
        verbose: 0, 1 or 2, passed to `train` (1 also prints one line per run).
        take_over_lock: bool. Take over the study directory (and its runs) if their
            locks were left by a process that no longer runs.
        parallel: int, runs trained at once, each in its own process
            (`keras_vitnorm.study.workers`); 1 trains them one after another here.
        threads_per_run: compute threads of each parallel run; default the CPU
            cores shared out over `parallel`.
        train: bool. False trains nothing: the tables and figures are written from
            the runs of the plan that have finished, the others are named and left
            out (a study part-way, or one exported without weights, re-tabled).

    Runs train seed by seed (every variant's first seed, then every variant's
    second, ...); the result rows and tables follow the groups' order. The study
    directory is locked (`study.lock`) while this runs, and each run's directory by
    `train`; every table is written atomically.
    """
    if not seeds:
        raise ValueError("seeds must name at least one seed.")
    if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
        raise ValueError(f"parallel must be a positive integer (runs at once), got {parallel!r}.")
    if not train and (parallel != 1 or threads_per_run is not None):
        raise ValueError("parallel and threads_per_run (--parallel, --threads-per-run) set how "
                         "runs train; with train=False (--tables-only) nothing trains: leave them out.")
    if not train and not os.path.exists(os.path.join(output_dir, "study_config.json")):
        raise ValueError(f"{output_dir} holds no study (no study_config.json) to write tables for: "
                         "point --output-dir at a study directory.")
    if threads_per_run is not None:
        if parallel == 1:
            raise ValueError("threads_per_run (--threads-per-run) applies to parallel runs: "
                             "set parallel (--parallel) above 1, or leave it out.")
        workers.thread_environment(threads_per_run)  # checks the value before anything runs
    elif parallel > 1:
        threads_per_run = workers.default_threads_per_run(parallel)
    plan = [(group, get_variants(group, (variants or {}).get(group))) for group in groups]
    with run_files.RunLock(output_dir, "study.lock", take_over=take_over_lock,
                           what="study directory"):
        with run_files.storage_errors(output_dir, "Finished runs are intact; rerun to continue."):
            return _run_locked(base, plan, seeds, output_dir, verbose, take_over_lock,
                               parallel, threads_per_run, train)


def _run_locked(base, plan, seeds, output_dir, verbose, take_over_lock, parallel, threads_per_run,
                train=True):
    _check_study_config(base, output_dir)
    probe_images = _probe_images(base)
    jobs = []  # (group, variant, config, run directory), in the plan's order
    trained = {}  # effective settings -> run directory, to share identical runs
    for group, group_variants in plan:
        for name, (model, settings) in group_variants.items():
            for seed in seeds:
                config = dataclasses.replace(
                    base, **settings, model={**base.model, **model}, seed=seed, output_dir=None
                )
                config.validate()  # a variant the base cannot take fails before anything trains
                key = _settings_key(config)
                run_dir = trained.get(key)
                if run_dir is None:
                    run_dir = trained[key] = os.path.join(output_dir, group, name, f"seed_{seed}")
                elif verbose:
                    print(f"[{group}] {name} seed {seed}: same settings as {run_dir}, shared")
                config.output_dir = run_dir
                jobs.append((group, name, config, run_dir))

    def finished_rows():
        return [run_one(config, group, name, run_dir, 0, take_over_lock, probe_images)
                for group, name, config, run_dir in jobs if _finished(run_dir)]

    # Every variant's first seed trains before any variant's second, so a long study
    # that is stopped part-way already compares all its variants.
    order = sorted(range(len(jobs)), key=lambda i: seeds.index(jobs[i][2].seed))
    if not train:
        finished = [i for i in order if _finished(jobs[i][3])]
        if not finished:
            raise ValueError(f"No run of this plan has finished in {output_dir}: there is nothing "
                             "to table. Leave out --tables-only to train them.")
        if verbose:
            for group, name, config, _ in (jobs[i] for i in order if i not in finished):
                print(f"[{group}] {name} seed {config.seed}: not finished, left out of the tables")
        order = finished
    elif parallel > 1:
        _train_in_parallel([jobs[i] for i in order], output_dir, parallel, threads_per_run, verbose,
                           take_over_lock, on_finish=lambda job: write_results(finished_rows(), output_dir))
    done = {}  # job index -> result row; the tables list them in the plan's order
    for i in order:
        group, name, config, run_dir = jobs[i]
        done[i] = run_one(config, group, name, run_dir, verbose, take_over_lock, probe_images)
        write_results([done[j] for j in sorted(done)], output_dir)  # kept current, read early
    rows = [done[i] for i in sorted(done)]
    make_figures(rows, os.path.join(output_dir, "figures"), probe_images=probe_images)
    patch_statistics.write_tables(rows, output_dir, [group for group, _ in plan if group in STEM_PAIRS],
                                  say=print if verbose else None)
    if any(group == "dpn_factors" for group, _ in plan):
        dpn_mechanism(base, output_dir)
    return rows


def _finished(run_dir):
    metrics = read_metrics(run_dir)
    return metrics is not None and metrics.get("status") in ("completed", "diverged")


def _train_in_parallel(jobs, output_dir, parallel, threads, verbose, take_over_lock, on_finish):
    """Trains the unfinished runs of `jobs` (each shared run once) in worker processes."""
    log_dir = os.path.join(output_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    work, seen = [], set()
    for group, name, config, run_dir in jobs:
        if run_dir in seen or _finished(run_dir):
            continue
        seen.add(run_dir)
        stem = os.path.join(log_dir, workers.job_file_stem(group, name, config.seed))
        job = {"group": group, "name": name, "seed": config.seed, "run_dir": run_dir,
               "config": config.to_dict(), "take_over_lock": take_over_lock, "verbose": 2,
               "file": stem + ".job.json", "log": stem + ".log"}
        durable.write_json(job["file"], job)
        work.append(job)
    if work and verbose:
        print(f"{len(work)} run(s) to train, {parallel} at a time with {threads} thread(s) each")
    workers.train_in_workers(work, parallel, lambda job: workers.start_child(job, threads),
                             on_finish=on_finish, say=print if verbose else None)


def _probe_images(base, count=64):
    """The first `count` validation images of the study's dataset, in model format."""
    from keras_vitnorm.training import data as data_lib

    size = base.model.get("image_size")
    if size is None:
        return None  # the preset's own size: left to the caller
    size = (size, size) if isinstance(size, int) else tuple(size)
    data = data_lib.load_dataset(base.dataset, base.val_fraction, base.data_dir, base.manual_dir,
                                 skip_bad_images=bool(base.skip_bad_images),
                                 pipeline=base.input_pipeline)
    channels = base.model.get("num_channels", data.channels)
    batch = next(iter(data_lib.eval_dataset(data, data.validation, size, channels, count)))
    return np.asarray(batch[0])


def _check_study_config(base, output_dir):
    """Records the base settings; a restart with other settings is refused."""
    path = os.path.join(output_dir, "study_config.json")
    current = {**base.to_dict(), "seed": None, "output_dir": None}
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        details = setting_changes(saved, current)
        if details:
            raise ValueError(
                f"The study in {output_dir} was run with other base settings ({details}). "
                "Use another output directory for a different study."
            )
        return
    os.makedirs(output_dir, exist_ok=True)
    durable.write_json(path, current)


def _settings_key(config):
    """What makes two runs the same: every setting, with the preset's model config
    resolved (so `{"stem": "patch"}` on a plain preset equals no override at all)."""
    from keras_vitnorm.models import PRESETS
    from keras_vitnorm.models import ViT
    from keras_vitnorm.models.presets import preset_config

    settings = config.to_dict()
    if config.preset in PRESETS and not os.path.isdir(config.preset):
        settings["model"] = {**ViT.default_config(), **preset_config(config.preset), **config.model}
    return json.dumps(settings, sort_keys=True, default=str)
