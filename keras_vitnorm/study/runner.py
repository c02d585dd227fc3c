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

import csv
import dataclasses
import io
import json
import math
import os
import re
import shutil

import numpy as np

from keras_vitnorm.study import factors
from keras_vitnorm.study import patch_statistics
from keras_vitnorm.study import workers
from keras_vitnorm.study.runs import RUN_RESULT_FILES
from keras_vitnorm.study.runs import read_grad_norms
from keras_vitnorm.study.runs import read_metrics
from keras_vitnorm.study.runs import run_analysis
from keras_vitnorm.study.runs import run_one
from keras_vitnorm.study.stats import confidence_interval
from keras_vitnorm.study.stats import difference_interval
from keras_vitnorm.study.stats import difference_text
from keras_vitnorm.study.stats import holm_adjusted
from keras_vitnorm.study.stats import p_value_header
from keras_vitnorm.study.stats import p_value_text
from keras_vitnorm.study.stats import welch_p_value
from keras_vitnorm.study.variants import DEPTHS
from keras_vitnorm.study.variants import DPN_PATCH_SIZES
from keras_vitnorm.study.variants import get_variants
from keras_vitnorm import durable
from keras_vitnorm.training import run_files
from keras_vitnorm.training.config import setting_changes

RESULT_FIELDS = (
    "group", "variant", "seed", "status", "test_accuracy", "val_accuracy",
    "diverged_at_step", "steps", "train_seconds", "run_dir",
)


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


def make_figures(rows, figure_dir, probe_images=None):
    """Writes every figure (and the tables computed with them) the results allow.

    Per group: gains (`<group>_gains.png`, and per epoch, paired by seed,
    `<group>_gain_curves.png`; for a group whose variants vary the stem by factor
    level, only `<group>_differences.png`: each stem against the plain stem at its
    own level), loss curves (`<group>_loss.png`) and
    validation accuracy curves with CIs (`<group>_accuracy.png`). For
    each group of `STEM_PAIRS` with gradient-norm records of both stems:
    `<group>_gradient_norms.png`; with a finished Dual PatchNorm run:
    `<group>_stem_scales.png` (its first seed). For `depth_stability`: test accuracy
    by depth per placement (`depth_stability_by_depth.png`) and gradient norms
    by depth of the deepest models with warm-up (`depth_gradient_norms.png`). With
    `probe_images`, per group `<group>_residual_stream.png` and, beside the figures,
    `<group>_residual_stream.md`: the residual-stream RMS and consecutive-block
    similarity of each variant's finished runs on those images (mean over seeds).

    Returns:
        The paths written.
    """
    from keras_vitnorm.study import figures

    paths = []
    for group in dict.fromkeys(row["group"] for row in rows):
        group_rows = [r for r in rows if r["group"] == group]
        summary = summarize(group_rows)
        differences = factors.stem_differences(rows, group)
        if differences:
            # A factorial group compares each stem with the plain stem at its own level,
            # not every variant with the first one.
            paths.append(figures.plot_stem_differences(
                differences, f"{group}: each stem against the plain stem\n(mean, Welch 95% CI)",
                os.path.join(figure_dir, f"{group}_differences.png")))
        elif len(summary) > 1:
            paths.append(figures.plot_gains(
                summary, f"{group}: test accuracy gain", os.path.join(figure_dir, f"{group}_gains.png")))
            paths.append(figures.plot_gain_curves(
                group_rows, f"{group}: validation accuracy gain per epoch",
                os.path.join(figure_dir, f"{group}_gain_curves.png")))
        paths.append(figures.plot_loss_curves(
            group_rows, f"{group}: loss per epoch (mean over seeds)",
            os.path.join(figure_dir, f"{group}_loss.png")))
        paths.append(figures.plot_accuracy_curves(
            group_rows, f"{group}: validation accuracy per epoch",
            os.path.join(figure_dir, f"{group}_accuracy.png")))
        if probe_images is not None:
            paths.extend(_residual_stream_outputs(group, group_rows, probe_images, figure_dir))
    for group, pair in STEM_PAIRS.items():
        paths.extend(_stem_figures(rows, group, pair, figure_dir))
    if any(r["group"] == "depth_stability" for r in rows):
        paths.append(figures.plot_accuracy_by_depth(
            rows, "test accuracy by depth (mean, 95% CI over seeds)",
            os.path.join(figure_dir, "depth_stability_by_depth.png")))
    deepest = [r for r in rows if r["group"] == "depth_stability" and r["status"] == "completed"]
    grad_runs = {}
    for variant in (f"{placement}-depth_{max(DEPTHS)}" for placement in ("pre_ln", "post_ln", "deepnorm")):
        run = next((r for r in deepest if r["variant"] == variant), None)
        if run and os.path.exists(os.path.join(run["run_dir"], "grad_norms.csv")):
            grad_runs[f"{variant} (seed {run['seed']})"] = os.path.join(run["run_dir"], "grad_norms.csv")
    if len(grad_runs) > 1:
        paths.append(figures.plot_gradient_norms(
            grad_runs, f"gradient norm by depth, depth {max(DEPTHS)}",
            os.path.join(figure_dir, "depth_gradient_norms.png")))
    return paths


def _stem_figures(rows, group, pair, figure_dir):
    from keras_vitnorm.study import figures

    finished = [r for r in rows if r["group"] == group and r["status"] == "completed"]
    paths, grad_runs = [], {}
    for variant in pair:
        run = next((r for r in finished if r["variant"] == variant), None)
        if run and os.path.exists(os.path.join(run["run_dir"], "grad_norms.csv")):
            grad_runs[f"{variant} (seed {run['seed']})"] = os.path.join(run["run_dir"], "grad_norms.csv")
    if len(grad_runs) == 2:
        paths.append(figures.plot_gradient_norms(
            grad_runs, f"{group}: gradient norm by depth",
            os.path.join(figure_dir, f"{group}_gradient_norms.png")))
    dpn = next((r for r in finished if r["variant"] == pair[1]), None)
    analysis = run_analysis(dpn["run_dir"]) if dpn else None
    if analysis and analysis.get("stem_scale") is not None:
        paths.append(figures.plot_stem_scales(
            np.asarray(analysis["stem_scale"]),
            f"{group}: learned scale of DPN's first stem LayerNorm",
            os.path.join(figure_dir, f"{group}_stem_scales.png")))
    return paths


def _residual_stream_outputs(group, rows, images, figure_dir):
    from keras_vitnorm.study import figures

    streams = {}
    for run in rows:
        analysis = run_analysis(run["run_dir"], images) if run["status"] == "completed" else None
        if analysis and analysis.get("residual_stream"):
            streams.setdefault(run["variant"], []).append(analysis["residual_stream"])
    if not streams:
        return []
    table = os.path.join(figure_dir, f"{group}_residual_stream.md")
    durable.write_text(table, factors.residual_stream_table(streams))
    return [figures.plot_residual_stream(
        streams, f"{group}: residual stream of trained models, mean over seeds "
                 f"({len(images)} validation images)",
        os.path.join(figure_dir, f"{group}_residual_stream.png")), table]


def dpn_mechanism(base, output_dir, patch_sizes=DPN_PATCH_SIZES, train_count=10000):
    """Writes `dpn_mechanism.md`: what DPN's first norm removes, measured on the data.

    For each patch size: linear-probe accuracy on the pixels, on the patches after
    `LN_0`, on the same with a variance floor (near-flat patches not stretched to
    full contrast), and on the two numbers per patch that `LN_0` removes (mean and
    standard deviation); the share of the patches' energy in their means, and the
    share of low-contrast patches (`keras_vitnorm.analysis.patch_norm`). Probes
    train on the first `train_count` images of a class-stratified subset of the
    training split and are scored on the validation split.
    """
    from keras_vitnorm.analysis.patch_norm import VARIANCE_FLOOR
    from keras_vitnorm.analysis.patch_norm import patch_norm_probe
    from keras_vitnorm.training import data as data_lib

    size = base.model.get("image_size")
    size = (size, size) if isinstance(size, int) else tuple(size)
    data = data_lib.load_dataset(base.dataset, base.val_fraction, base.data_dir, base.manual_dir,
                                 train_examples=train_count,
                                 skip_bad_images=bool(base.skip_bad_images),
                                 pipeline=base.input_pipeline)
    channels = base.model.get("num_channels", data.channels)

    train_images, train_labels = data_lib.eval_arrays(data, data.train, size, channels)
    test_images, test_labels = data_lib.eval_arrays(data, data.validation, size, channels)
    lines = [
        f"Linear probes (logistic regression) trained on {len(train_images):,} training images, "
        f"scored on {len(test_images):,} validation images; chance is {1 / data.num_classes:.0%}.",
        "",
        "| patch size | dims per patch | pixels (plain stem's input) | patches after LN_0 (DPN's input) "
        f"| after LN_0 with variance floor {VARIANCE_FLOOR:g} "
        "| only the mean and std per patch (what LN_0 removes) | energy in patch means "
        "| patches with std below 0.1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for patch in patch_sizes:
        probe = patch_norm_probe(train_images, train_labels, test_images, test_labels, patch)
        lines.append(
            f"| {patch} | {probe['patch_dim']} (LN_0 removes 2) | {probe['pixels']:.1%} "
            f"| {probe['standardized_patches']:.1%} | {probe['floored_patches']:.1%} "
            f"| {probe['patch_mean_and_std']:.1%} | {probe['energy_in_means']:.1%} "
            f"| {probe['low_contrast']:.1%} |"
        )
    path = os.path.join(output_dir, "dpn_mechanism.md")
    durable.write_text(path, "\n".join(lines) + "\n")
    return path


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


def export_study(study_dir, destination):
    """Copies a study's results, without weights, into `destination`.

    Copied: `study_config.json`, `results.csv`, the markdown tables, `figures/`, and of
    every finished run (completed or diverged) the files in `RUN_RESULT_FILES`, at
    the same relative paths. Unfinished runs are left out (their checkpoints are not
    copied, so they could not resume). Each file is written atomically; files already
    in `destination` are replaced by the study's.

    Returns:
        The number of runs copied.
    """
    if not os.path.isfile(os.path.join(study_dir, "study_config.json")):
        raise ValueError(f"{study_dir!r} is not a study directory (no study_config.json).")
    if os.path.abspath(destination) == os.path.abspath(study_dir):
        raise ValueError("export_study needs a destination other than the study directory.")

    def copy(relative):
        target = os.path.join(destination, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        durable.write_file(target, lambda temporary: shutil.copyfile(
            os.path.join(study_dir, relative), temporary))

    runs = 0
    for root, directories, files in os.walk(study_dir):
        directories[:] = sorted(d for d in directories
                                if d not in ("preset", "checkpoints", "backup", "tensorboard"))
        relative_root = os.path.relpath(root, study_dir)
        if relative_root == ".":
            for name in sorted(files):
                if name in ("study_config.json", "results.csv") or name.endswith(".md"):
                    copy(name)
            continue
        if relative_root.split(os.sep)[0] == "figures":
            for name in sorted(files):
                if name.endswith((".png", ".md")):
                    copy(os.path.join(relative_root, name))
            continue
        metrics = read_metrics(root) if "metrics.json" in files else None
        if metrics and metrics.get("status") in ("completed", "diverged"):
            for name in RUN_RESULT_FILES:
                if name in files:
                    copy(os.path.join(relative_root, name))
            runs += 1
    return runs


PATCH_EMBEDDING_LAYER = "stem/projection"
_BLOCK_LAYER = re.compile(r"block_\d+/(attention/(qkv|out)|mlp/(fc1|fc2))")


def patch_embedding_gradient_ratio(grad_norms_csv):
    """How the patch embedding's gradient norm compares with the blocks' layers.

    Per record (the step-0 record left out: with the zero-initialized head every
    gradient but the head's is zero there), the patch embedding's gradient norm is
    divided by the largest and by the median gradient norm of the blocks' dense
    layers (qkv, attention output, fc1, fc2).

    Returns a dict: `ratio_to_max` and `ratio_to_median` (means over records) and
    `largest` (share of records in which the patch embedding has the largest norm
    of all those layers).
    """
    to_max, to_median, largest = [], [], []
    for layers in read_grad_norms(grad_norms_csv).values():
        blocks = [v for k, v in layers.items() if _BLOCK_LAYER.fullmatch(k)]
        if PATCH_EMBEDDING_LAYER not in layers or not blocks:
            continue
        patch = layers[PATCH_EMBEDDING_LAYER]
        to_max.append(patch / max(blocks))
        to_median.append(patch / float(np.median(blocks)))
        largest.append(patch > max(blocks))
    if not to_max:
        raise ValueError(f"{grad_norms_csv} has no record with {PATCH_EMBEDDING_LAYER!r} and block layers.")
    return {"ratio_to_max": float(np.mean(to_max)), "ratio_to_median": float(np.mean(to_median)),
            "largest": float(np.mean(largest))}


#: group -> (plain-stem variant, Dual PatchNorm variant) compared by the stem analyses
#: (gradient norms, the learned scale of the first stem norm).
STEM_PAIRS = {
    "stems": ("patch", "dual_patchnorm"),
    "converged": ("pre_ln", "dual_patchnorm"),
    "dpn_factors": ("patch-p4-n10000", "dpn-p4-n10000"),
    "dpn_schedule": ("patch-s12000", "dpn-s12000"),
}


def gradient_norm_table(rows):
    """Markdown table of `patch_embedding_gradient_ratio` per stem variant, over seeds,
    for every group of `STEM_PAIRS` that recorded gradient norms."""
    lines = ["| group | stem | runs | patch embedding / largest block layer "
             "| patch embedding / median block layer | records where the patch embedding is largest |",
             "|---|---|---|---|---|---|"]
    for group, variants in STEM_PAIRS.items():
        for variant in variants:
            runs = [r for r in rows if r["group"] == group and r["variant"] == variant
                    and r["status"] == "completed"
                    and os.path.exists(os.path.join(r["run_dir"], "grad_norms.csv"))]
            if not runs:
                continue
            stats = [patch_embedding_gradient_ratio(os.path.join(r["run_dir"], "grad_norms.csv"))
                     for r in runs]
            cells = []
            for key in ("ratio_to_max", "ratio_to_median"):
                mean, ci = confidence_interval([s[key] for s in stats])
                cells.append(f"{mean:.2f}" + ("" if math.isnan(ci) else f" ± {ci:.2f}"))
            share = np.mean([s["largest"] for s in stats])
            lines.append(f"| {group} | {variant} | {len(runs)} | {cells[0]} | {cells[1]} | {share:.0%} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def write_results(rows, output_dir):
    """Writes `results.csv`, one markdown table per group, `<group>_convergence.md`
    for groups trained four or more epochs (`factors.convergence_table`) and, where
    the groups ran: `<group>_differences.md` (for a group that varies the stem by
    factor level, `dpn_factors` and `dpn_schedule`, each stem against the plain stem at
    its level; for any other group of two or more variants, each variant against the
    group's baseline), `gradient_norms.md` (stem runs that recorded gradient norms),
    `dpn_factors_against_dpn.md` (every other stem against DPN, the paper's Table 6
    format) and
    `depth_stability_summary.md` (what trains, diverges or stalls by depth)."""
    os.makedirs(output_dir, exist_ok=True)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=RESULT_FIELDS)
    writer.writeheader()
    for row in rows:
        record = {key: row.get(key) for key in RESULT_FIELDS}
        record["run_dir"] = os.path.relpath(row["run_dir"], output_dir)
        writer.writerow(record)
    durable.write_text(os.path.join(output_dir, "results.csv"), buffer.getvalue(), stage="results")
    for group in dict.fromkeys(row["group"] for row in rows):
        group_rows = [r for r in rows if r["group"] == group]
        summary = summarize(group_rows)
        durable.write_text(os.path.join(output_dir, f"{group}.md"), markdown_table(summary))
        differences = factors.dpn_factor_table(group_rows, group) or difference_table(summary)
        for name, table in ((f"{group}_convergence.md", factors.convergence_table(group_rows)),
                            (f"{group}_differences.md", differences)):
            if table:
                durable.write_text(os.path.join(output_dir, name), table)
    for name, table in (
        ("gradient_norms.md", gradient_norm_table(rows)),
        ("dpn_factors_against_dpn.md", factors.against_dpn_table(rows)),
        ("depth_stability_summary.md", factors.depth_table(rows)),
    ):
        if table:
            durable.write_text(os.path.join(output_dir, name), table)


def summarize(rows, metric="test_accuracy"):
    """Per-variant summary of one group, baseline (first variant) first.

    Returns a list of dicts: variant, runs, diverged, mean, ci (95% half-width),
    gain (mean minus the baseline's mean), gain_ci (the half-width of the gain's Welch
    95% CI, which counts the baseline's spread too; `None` for the baseline and where
    either side has no finished run, NaN with one run on a side), p_value (Welch's
    test of the gain, two-sided; `None` and NaN as gain_ci), and the diverged
    steps. A variant whose runs all diverged has mean `None`.
    """
    summary = []
    baseline = None
    for name in dict.fromkeys(row["variant"] for row in rows):
        runs = [row for row in rows if row["variant"] == name]
        finished = [float(r[metric]) for r in runs if r["status"] == "completed"]
        diverged = [r for r in runs if r["status"] == "diverged"]
        mean, ci = confidence_interval(finished) if finished else (None, None)
        if not summary:
            baseline = finished
        compared = bool(summary) and bool(finished) and bool(baseline)
        summary.append({
            "variant": name,
            "runs": len(runs),
            "diverged": len(diverged),
            "diverged_steps": [r["diverged_at_step"] for r in diverged],
            "mean": mean,
            "ci": ci,
            "gain": None if mean is None or not baseline else mean - float(np.mean(baseline)),
            "gain_ci": difference_interval(finished, baseline)[1] if compared else None,
            "p_value": welch_p_value(finished, baseline) if compared else None,
        })
    return summary


def difference_table(summary):
    """Markdown from a `summarize` summary: each variant against the baseline (the first
    entry), its gain in points with the gain's Welch 95% CI (`*` where it excludes 0),
    the Welch test's p-value and the p-value adjusted by Holm's method over the
    table's comparisons (`*` below 0.05). Empty for a group of one variant."""
    if len(summary) < 2:
        return ""
    baseline = summary[0]
    p_values = [math.nan if e["p_value"] is None else e["p_value"] for e in summary[1:]]
    adjusted = holm_adjusted(p_values)
    tested = sum(not math.isnan(p) for p in p_values)
    lines = [
        f"| variant | runs | test accuracy (%), mean ± 95% CI | {baseline['variant']} (%) "
        f"| difference, points (Welch 95% CI) | {p_value_header(tested)} |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry, p, p_holm in zip(summary[1:], p_values, adjusted):
        gain = ("n/a" if entry["gain_ci"] is None
                else difference_text(entry["gain"], entry["gain_ci"]))
        lines.append(f"| {entry['variant']} | {entry['runs']} | {_mean_ci(entry)} "
                     f"| {_mean_ci(baseline)} | {gain} | {p_value_text(p)} "
                     f"| {p_value_text(p_holm, holm=True)} |")
    return "\n".join(lines) + "\n"


def _mean_ci(entry):
    """`mean ± 95% CI` of a `summarize` entry in percent, the mean alone without an
    interval, `n/a` without a finished run (as `stats.mean_ci_text`)."""
    if entry["mean"] is None:
        return "n/a"
    ci = "" if math.isnan(entry["ci"]) else f" ± {100 * entry['ci']:.2f}"
    return f"{100 * entry['mean']:.2f}{ci}"


def markdown_table(summary, metric_label="test accuracy (%)"):
    """The paper's format: mean ± 95% CI over seeds and the gain over the baseline."""
    lines = [
        f"| variant | runs | {metric_label}, mean ± 95% CI | gain over {summary[0]['variant']} | diverged |",
        "|---|---|---|---|---|",
    ]
    for entry in summary:
        if entry["mean"] is None:
            accuracy, gain = "diverged", "n/a"
        else:
            accuracy = _mean_ci(entry)
            gain = f"{100 * entry['gain']:+.2f}" if entry["gain"] is not None else "n/a"
        diverged = (
            f"{entry['diverged']} (at steps {', '.join(map(str, entry['diverged_steps']))})"
            if entry["diverged"] else "0"
        )
        lines.append(f"| {entry['variant']} | {entry['runs']} | {accuracy} | {gain} | {diverged} |")
    return "\n".join(lines) + "\n"
