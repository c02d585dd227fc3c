"""The ablation runner: trains every (variant, seed) of a study, then tabulates and plots
(docs/study.md). Finished runs are kept, interrupted ones resume, identical ones are shared."""

import contextlib
import dataclasses
import json
import os

from keras_vitnorm import durable
from keras_vitnorm.study import lr_sweep as lr_sweep_lib
from keras_vitnorm.study import patch_statistics
from keras_vitnorm.study import plan as plan_lib
from keras_vitnorm.study import workers
from keras_vitnorm.study.report import dpn_mechanism
from keras_vitnorm.study.report import make_figures
from keras_vitnorm.study.one_run import probe_images
from keras_vitnorm.study.one_run import is_finished
from keras_vitnorm.study.one_run import recorded_differences
from keras_vitnorm.study.one_run import resolved_model
from keras_vitnorm.study.one_run import run_one
from keras_vitnorm.study.tables import write_results
from keras_vitnorm.study.tables import write_rows
from keras_vitnorm.study.variants import STEM_PAIRS
from keras_vitnorm.study.variants import get_variants
from keras_vitnorm.training import run_files
from keras_vitnorm.training.config import setting_changes
from keras_vitnorm.training.run_layout import SETTINGS_FILE
from keras_vitnorm.training.run_plan import FITTED_SETTINGS
from keras_vitnorm.training.run_plan import fit_to_data
from keras_vitnorm.training.trainer import load_training_data
from keras_vitnorm.validation import check_choice
from keras_vitnorm.validation import check_distinct


MODES = ("train", "tables", "plan")


def run_study(base, groups, seeds, output_dir, variants=None, verbose=1, take_over_lock=False,
              parallel=1, threads_per_run=None, mode="train", lr_sweep=None, sweep_seeds=None,
              extend_sweep=False, track=False, variant_sweeps=None):
    """Trains each variant of each group with each seed; returns the result rows of the
    runs at the chosen settings (mode `"plan"`: the commands written).

    Args:
        base: `TrainConfig` every run starts from.
        groups: list of variant-group names (`keras_vitnorm.study.VARIANT_GROUPS`).
        seeds: list of ints.
        output_dir: the study directory (locked as `study.lock` while this runs).
        variants: optional `{group: [variant names]}` to run a subset.
        verbose: 0, 1 or 2, passed to `train` (1 also prints one line per run).
        take_over_lock: bool. Take over locks left by a process that no longer runs.
        parallel: int, runs trained at once, each in its own process (`workers`).
        threads_per_run: compute threads of each parallel run (default: cores / parallel).
        mode: `"train"` trains, then writes the tables and figures; `"tables"` only
            writes them; `"plan"` writes one command per run that can train now.
        lr_sweep: optional peak learning rates, each variant's chosen on validation.
        variant_sweeps: optional `{(group, variant): rates}`, a variant's own grid.
        sweep_seeds: seeds of the sweep runs; default the first of `seeds`.
        extend_sweep: bool. Widen a grid whose choice is at its end (`lr_sweep.extend`).
        track: bool. The study is an MLflow run and each of its runs a child run.
    """
    if not seeds:
        raise ValueError("seeds must name at least one seed.")
    check_distinct("seeds (--seeds)", seeds)
    check_distinct("groups (--groups)", groups)
    check_choice("mode", mode, MODES)
    if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
        raise ValueError(f"parallel must be a positive integer (runs at once), got {parallel!r}.")
    if mode != "train" and (parallel != 1 or threads_per_run is not None):
        flag = "--tables-only" if mode == "tables" else "--plan"
        raise ValueError("parallel and threads_per_run (--parallel, --threads-per-run) set how "
                         f"runs train here; with mode {mode!r} ({flag}) nothing trains here: "
                         "leave them out.")
    if os.path.isfile(os.path.join(output_dir, SETTINGS_FILE)):
        raise ValueError(f"{output_dir} is a training run's directory (it holds "
                         "train_config.json), not a study's: the study's files would mix with "
                         "the run's. Point --output-dir at a study directory, or a new one.")
    if mode == "tables" and not os.path.exists(os.path.join(output_dir, "study_config.json")):
        raise ValueError(f"{output_dir} holds no study (no study_config.json) to write tables for: "
                         "point --output-dir at a study directory.")
    if threads_per_run is not None:
        if parallel == 1:
            raise ValueError("threads_per_run (--threads-per-run) applies to parallel runs: "
                             "set parallel (--parallel) above 1, or leave it out.")
        workers.thread_environment(threads_per_run)  # checks the value before anything runs
    elif parallel > 1:
        threads_per_run = workers.default_threads_per_run(parallel)
    plan = [(group, list(get_variants(group, (variants or {}).get(group)).items()))
            for group in groups]
    grids, sweep_seeds = lr_sweep_lib.sweep_of(plan, seeds, lr_sweep, variant_sweeps,
                                               sweep_seeds, extend_sweep, base.learning_rate)
    with run_files.RunLock(output_dir, "study.lock", take_over=take_over_lock,
                           what="study directory"):
        with run_files.storage_errors(output_dir, "Finished runs are intact.",
                                      "rerun the same command to continue"):
            study = _Study(base, output_dir, verbose, take_over_lock, parallel, threads_per_run,
                           mode)
            run = study.tracked if track else study.run
            return run(plan, seeds, grids, sweep_seeds, extend_sweep)


class _Study:
    """One invocation of `run_study` on a locked study directory."""

    def __init__(self, base, output_dir, verbose, take_over_lock, parallel, threads, mode):
        self.base, self.output_dir, self.verbose = base, output_dir, verbose
        self.take_over_lock, self.parallel, self.threads, self.mode = (
            take_over_lock, parallel, threads, mode)
        self.trained = {}  # settings -> (run directory, its (group, variant)): shared runs
        self.planned = []  # the jobs of mode "plan", every phase's
        self.probe_images = None
        self.selection = None  # (the sweep's choices, every rate swept) with a sweep
        self.train_sizes = {}  # the training split's size of each data setting
        self.said = set()  # the notes and left-out runs named already
        self.differences = {}  # run directory -> how its recorded settings differ from the plan's
        self.parent = None  # the study's MLflow run (`tracked`)

    def say(self, text):
        if self.verbose:
            print(text)

    def run(self, plan, seeds, grids, sweep_seeds, extend_sweep=False):
        _check_study_config(self.base, self.output_dir)
        if self.mode != "plan":
            self.probe_images = probe_images(self.base)
        # The tables and figures agree with each other: outside training (whose tables
        # are written as its runs finish), a step that fails leaves every one as it was.
        outputs = (self.output_dir, os.path.join(self.output_dir, "figures"))
        with (durable.written_together(*outputs) if self.mode != "train"
              else contextlib.nullcontext()):
            if grids:
                plan = self.sweep(plan, grids, sweep_seeds, extend_sweep)
            jobs = self.jobs(plan, seeds, rate_dirs=bool(grids))
            if self.mode == "plan":
                # an extended sweep lists its unfinished runs once per pass over its grids
                return plan_lib.write_plan(self._unfinished(self.planned + jobs),
                                           self.output_dir, say=self.say, track=self.track_of)
            rows = self.rows(jobs, seeds, required=not grids)
            if not rows:
                return rows
            with durable.written_together(*outputs):
                self.write_outputs(plan, rows, grids)
        return rows

    def tracked(self, plan, seeds, grids, sweep_seeds, extend_sweep):
        """`run`, with the study an MLflow run whose children are its runs."""
        from keras_vitnorm.training import tracking

        self.parent = tracking.TrackedRun(
            self.output_dir, os.path.basename(os.path.abspath(self.output_dir)),
            params={**self.base.to_dict(), "groups": [g for g, _ in plan], "seeds": seeds})
        rows = self.run(plan, seeds, grids, sweep_seeds, extend_sweep)
        if self.mode != "plan":
            self.parent.log_artifacts(tracking.study_outputs(self.output_dir))
            self.parent.finish({})
        return rows

    def track_of(self, run_dir):
        """The `track` argument of a run: a child of the study's MLflow run, or None."""
        if self.parent is None:
            return None
        return {"parent_run_id": self.parent.run_id,
                "name": plan_lib.job_file_stem(run_dir, self.output_dir)}

    def write_outputs(self, plan, rows, grids):
        """The selection tables (with a sweep), figures and the tables read with them."""
        if grids:  # the seed noise of the final runs says which rates tie
            lr_sweep_lib.write_selection_tables(*self.selection, self.output_dir, rows)
        make_figures(rows, os.path.join(self.output_dir, "figures"),
                     probe_images=self.probe_images)
        stem_groups = [group for group, _ in plan if group in STEM_PAIRS]
        patch_statistics.write_tables(rows, self.output_dir, stem_groups,
                                      say=print if self.verbose else None)
        if stem_groups:  # the overview's train accuracy is the patch statistics' own
            write_results(rows, self.output_dir)
        if any(group == "dpn_factors" for group, _ in plan):
            dpn_mechanism(self.base, self.output_dir)

    def sweep(self, plan, base_grids, seeds, extend):
        """Trains (or reads) the sweep of `plan`; returns `plan` at the chosen rates."""
        grids = base_grids
        while True:
            sweep = [(group, lr_sweep_lib.at_rates(variants, grids, group))
                     for group, variants in plan]
            rows = self.rows(self.jobs(sweep, seeds, rate_dirs=True), seeds, required=False,
                             sweep=True)
            selection = lr_sweep_lib.select(rows, plan, grids, seeds)
            wider = lr_sweep_lib.extend(grids, selection, base_grids) if extend else grids
            if wider == grids:
                break
            grids = wider
        if self.mode == "tables" and not rows:
            raise ValueError(f"No run of this plan's learning-rate sweep has finished in "
                             f"{self.output_dir}: there is nothing to table. Leave out "
                             "--tables-only to train them.")
        self.selection = (selection, lr_sweep_lib.all_rates(grids))
        if rows:
            lr_sweep_lib.write_selection(rows, *self.selection, self.output_dir)
        return lr_sweep_lib.at_chosen_rates(plan, selection, say=self.say)

    def jobs(self, plan, seeds, rate_dirs=False):
        """`(group, variant, config, run directory)` of the runs of `plan`; equal ones share."""
        jobs = []
        for group, group_variants in plan:
            for name, (model, settings) in group_variants:
                for seed in seeds:
                    config = dataclasses.replace(self.base, **settings,
                                                 model={**self.base.model, **model}, seed=seed,
                                                 output_dir=None)
                    config.validate()  # a variant the base cannot take fails before anything trains
                    if self.base.given is not None:
                        config.given = self.base.given | set(settings)
                    config = self.fitted(config)
                    key = _settings_key(config)
                    run_dir, owner = self.trained.get(key, (None, None))
                    if run_dir is None:
                        rate = [lr_sweep_lib.rate_folder(config.learning_rate)] if rate_dirs else []
                        run_dir = os.path.join(self.output_dir, group, name, *rate, f"seed_{seed}")
                        self.trained[key] = (run_dir, (group, name))
                    elif owner != (group, name) and self.mode != "plan":
                        self.say(f"[{group}] {name} seed {seed}: same settings as {run_dir}, "
                                 "shared")
                    config.output_dir = run_dir
                    jobs.append((group, name, config, run_dir))
        return jobs

    def fitted(self, config):
        """`config` with the recipe's defaults that its data cannot take fitted as `train`
        fits them, each change noted once: a run records the settings its job says."""
        if config.given is None or set(FITTED_SETTINGS) <= config.given:
            return config
        data_settings = (config.dataset, config.val_fraction, config.data_dir, config.manual_dir,
                         config.train_examples, config.val_examples, config.skip_bad_images,
                         config.input_pipeline)
        if data_settings not in self.train_sizes:  # the data `train` loads
            self.train_sizes[data_settings] = load_training_data(config).train.size
        config, notes = fit_to_data(config, self.train_sizes[data_settings])
        for note in notes:
            self._say_once(note)
        return config

    def _say_once(self, text):
        if text not in self.said:
            self.said.add(text)
            self.say(text)

    def left_out(self, job):
        """Whether `job`'s finished run is left out, its recorded settings not the plan's."""
        group, name, config, run_dir = job
        if run_dir not in self.differences:
            self.differences[run_dir] = recorded_differences(config, run_dir)
        differences = self.differences[run_dir]
        if differences is None:
            self._say_once(f"[{group}] {name} seed {config.seed}: {run_dir} has no "
                           "train_config.json: its settings cannot be checked against the "
                           "plan's.")
        elif differences:
            self._say_once(f"[{group}] {name} seed {config.seed}: left out of the tables: "
                           f"{run_dir} holds a run of other settings than the plan's "
                           f"({differences}). Move it aside to train the run as planned.")
        return bool(differences)

    def rows(self, jobs, seeds, required=True, sweep=False):
        """The result rows of `jobs` after training them (mode `"train"`), or of those
        that have finished, written as they come (`required`: raise without one)."""
        # Every variant's first seed trains before any variant's second, so a long study
        # that is stopped part-way already compares all its variants.
        order = sorted(range(len(jobs)), key=lambda i: seeds.index(jobs[i][2].seed))
        if self.mode != "train":
            finished = [i for i in order if is_finished(jobs[i][3])]
            if self.mode == "plan":
                self.planned += jobs
            elif not finished and required:
                raise ValueError(f"No run of this plan has finished in {self.output_dir}: there "
                                 "is nothing to table. Leave out --tables-only to train them.")
            else:
                for group, name, config, _ in (jobs[i] for i in order if i not in finished):
                    self.say(f"[{group}] {name} seed {config.seed}: not finished, left out of the "
                             "tables")
            order = finished
        elif self.parallel > 1:
            workers.train_jobs(self._unfinished([jobs[i] for i in order]), self.output_dir,
                               self.parallel, self.threads, self.take_over_lock,
                               on_finish=lambda job: self._write(jobs, sweep),
                               say=print if self.verbose else None, track=self.track_of)
        done = {}  # job index -> result row; the tables list them in the plan's order
        for i in order:
            group, name, config, run_dir = jobs[i]
            if is_finished(run_dir) and self.left_out(jobs[i]):
                continue
            verbose = self.verbose if self.mode == "train" else 0
            done[i] = run_one(config, group, name, run_dir, verbose, self.take_over_lock,
                              self.probe_images, analyze=self.mode != "plan",
                              track=self.track_of(run_dir) if self.mode == "train" else None)
            if self.mode != "plan":
                self._write_rows([done[j] for j in sorted(done)], sweep)  # read early
        return [done[i] for i in sorted(done)]

    def _write(self, jobs, sweep):
        finished = [job for job in jobs if is_finished(job[3]) and not self.left_out(job)]
        self._write_rows([run_one(config, group, name, run_dir, 0, self.take_over_lock,
                                  self.probe_images)
                          for group, name, config, run_dir in finished], sweep)

    def _write_rows(self, rows, sweep):
        if sweep:
            write_rows(rows, self.output_dir, "lr_sweep.csv")
        else:
            write_results(rows, self.output_dir)

    @staticmethod
    def _unfinished(jobs):
        """The first job of each unfinished run directory, in order."""
        first = {}
        for job in jobs:
            first.setdefault(job[3], job)
        return [job for job in first.values() if not is_finished(job[3])]


def _check_study_config(base, output_dir):
    """Records the base settings; a restart with other settings is refused."""
    path = os.path.join(output_dir, "study_config.json")
    current = {**base.to_dict(), "seed": None, "output_dir": None}
    saved = durable.read_json(path)
    if saved is None:
        os.makedirs(output_dir, exist_ok=True)
        durable.write_json(path, current)
    elif details := setting_changes(saved, current):
        raise ValueError(f"The study in {output_dir} was run with other base settings "
                         f"({details}). Use another output directory for a different study.")


def _settings_key(config):
    """What makes two runs the same: every setting, the model as its preset resolves it."""
    settings = config.to_dict()
    settings["model"] = resolved_model(config.preset, config.model)
    return json.dumps(settings, sort_keys=True, default=str)
