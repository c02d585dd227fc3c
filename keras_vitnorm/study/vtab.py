"""The VTAB-1k transfer protocol: few-shot fine-tuning over a list of datasets, the rate
chosen on validation per task and preset, as the Dual PatchNorm paper does. Writes
`vtab_results.csv` and `vtab.md` (docs/transfer.md, "VTAB-1k")."""

import dataclasses
import itertools
import math
import os

import numpy as np

from keras_vitnorm import durable
from keras_vitnorm.study.stats import confidence_interval
from keras_vitnorm.study.stats import table_text
from keras_vitnorm.study.one_run import is_finished
from keras_vitnorm.study.one_run import recorded_differences
from keras_vitnorm.study.one_run import run_one
from keras_vitnorm.training import run_files

TRAIN_EXAMPLES = 800
VAL_EXAMPLES = 200
LEARNING_RATES = (0.001, 0.003, 0.01)
RESULT_FIELDS = ("preset", "dataset", "learning_rate", "seed", "status", "val_accuracy", "test_accuracy", "run_dir")


def preset_label(preset):
    """A short name for a preset or a path to one (`runs/b16_dpn/preset` -> `b16_dpn`)."""
    path = os.path.normpath(os.fspath(preset))
    name = os.path.basename(path)
    if name in ("preset", "checkpoints", "best", "last") and os.path.dirname(path):
        name = os.path.basename(os.path.dirname(path))
    return name


def _slug(text):
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def run_vtab(base, presets, datasets, output_dir, learning_rates=LEARNING_RATES, seeds=(0, 1, 2),
             verbose=1, take_over_lock=False):
    """Fine-tunes every preset on every dataset at every rate and seed; returns the rows.

    Args:
        base: a `TrainConfig` with the schedule (the `vtab_1k` recipe's, or overrides);
            its preset, dataset, learning rate, seed and example counts are set here.
        presets: preset directories or checkpoints (built-in names train from scratch,
            which is allowed but is not transfer).
        datasets: dataset specs (`tfds:<name>`, `folder:<path>`, `digits`).
        output_dir: the sweep's directory (locked while this runs).
        learning_rates, seeds: the sweep.
    """
    labels = [preset_label(p) for p in presets]
    if len(set(labels)) != len(labels):
        raise ValueError(f"Two presets share the name {sorted(labels)}: give them directories with distinct names.")
    for name, values in (("presets", presets), ("datasets", datasets), ("learning_rates", learning_rates),
                         ("seeds", seeds)):
        if not values:
            raise ValueError(f"{name} must name at least one value.")
        repeated = sorted({value for value in values if list(values).count(value) > 1}, key=str)
        if repeated:
            raise ValueError(f"{name} name {', '.join(map(repr, repeated))} more than once: "
                             "its runs would count twice in the table. Give each once.")
    with run_files.RunLock(output_dir, "vtab.lock", take_over=take_over_lock, what="VTAB directory"):
        rows = []
        for (preset, label), dataset, rate, seed in itertools.product(
                zip(presets, labels), datasets, learning_rates, seeds):
            run_dir = os.path.join(output_dir, _slug(label), _slug(dataset), f"lr_{rate:g}",
                                   f"seed_{seed}")
            config = dataclasses.replace(
                base, preset=preset, dataset=dataset, learning_rate=rate, seed=seed,
                train_examples=TRAIN_EXAMPLES, val_examples=VAL_EXAMPLES, output_dir=run_dir)
            _check_finished_run(config, run_dir)
            row = run_one(config, "vtab", f"{label} {dataset} lr {rate:g}", run_dir, verbose,
                          take_over_lock, analyze=False)
            rows.append({"preset": label, "dataset": dataset, "learning_rate": rate, "seed": seed,
                         "status": row["status"], "val_accuracy": row["val_accuracy"],
                         "test_accuracy": row["test_accuracy"],
                         "run_dir": os.path.relpath(run_dir, output_dir)})
            durable.write_csv(os.path.join(output_dir, "vtab_results.csv"), RESULT_FIELDS, rows)
            durable.write_text(os.path.join(output_dir, "vtab.md"), vtab_table(rows))
        return rows


def _check_finished_run(config, run_dir):
    """Refuses a finished run in `run_dir` of other settings than `config`: tables would mix."""
    if not is_finished(run_dir):
        return  # an unfinished run of other settings is refused when it resumes
    differences = recorded_differences(config, run_dir)
    if differences:
        raise ValueError(f"{run_dir} holds a finished run of other settings than this sweep's "
                         f"({differences}): its table would mix two sweeps. Use another "
                         "--output-dir for a different sweep, or move the run aside.")


def select(rows):
    """`{(dataset, preset): (rate, [test accuracies at it])}`, by mean validation accuracy."""
    completed = {}  # (dataset, preset) -> {rate: runs}
    for r in rows:
        if r["status"] == "completed":
            completed.setdefault((r["dataset"], r["preset"]), {}).setdefault(
                float(r["learning_rate"]), []).append(r)
    chosen = {}
    for key in sorted(completed):
        by_rate = completed[key]
        rate = max(by_rate, key=lambda lr: (np.mean([float(r["val_accuracy"]) for r in by_rate[lr]]), -lr))
        chosen[key] = (rate, [float(r["test_accuracy"]) for r in by_rate[rate]])
    return chosen


def vtab_table(rows):
    """Markdown: a row per task, a column per preset: test accuracy at the chosen rate."""
    chosen = select(rows)
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    table, means = [], {p: [] for p in presets}
    for dataset in datasets:
        cells = []
        for preset in presets:
            if (dataset, preset) not in chosen:
                cells.append("-")
                continue
            rate, scores = chosen[(dataset, preset)]
            mean, half = confidence_interval([100 * s for s in scores])
            means[preset].append(mean)
            ci = "" if math.isnan(half) else f" +- {half:.1f}"
            cells.append(f"{mean:.1f}{ci} (lr {rate:g}, n={len(scores)})")
        table.append([dataset, *cells])
    if len(datasets) > 1:
        table.append(["mean over tasks", *(f"{np.mean(means[p]):.1f}"
                                           if len(means[p]) == len(datasets) else "-"
                                           for p in presets)])
    return ("Test accuracy (%) after VTAB-1k fine-tuning (800 train + 200 validation examples), "
            "mean +- 95% CI over seeds at the learning rate chosen on validation (in brackets)."
            "\n\n" + table_text(["task", *presets], table))
