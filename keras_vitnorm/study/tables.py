"""The study's tables from the result rows `run_study` returns (one per run): `results.csv`
and the tables of docs/study.md, "Output" (the factor groups' are in `factors`)."""

import math
import os
import re

import numpy as np

from keras_vitnorm import durable
from keras_vitnorm.study import factors
from keras_vitnorm.study.overview import overview_table
from keras_vitnorm.study.overview import read_step_times
from keras_vitnorm.study.one_run import grad_norms_file
from keras_vitnorm.study.one_run import read_grad_norms
from keras_vitnorm.study.stats import confidence_interval
from keras_vitnorm.study.stats import difference_interval
from keras_vitnorm.study.stats import difference_text
from keras_vitnorm.study.stats import mean_ci_text
from keras_vitnorm.study.stats import p_value_table
from keras_vitnorm.study.stats import table_text
from keras_vitnorm.study.stats import welch_p_value
from keras_vitnorm.study.time_to_accuracy import time_to_accuracy_table
from keras_vitnorm.study.variants import STEM_PAIRS

RESULT_FIELDS = ("group", "variant", "seed", "learning_rate", "status", "test_accuracy",
                 "val_accuracy", "val_examples", "diverged_at_step", "steps", "train_seconds",
                 "run_dir")

PATCH_EMBEDDING_LAYER = "stem/projection"
_BLOCK_LAYER = re.compile(r"block_\d+/(attention/(qkv|out)|mlp/(fc1|fc2))")


def patch_embedding_gradient_ratio(grad_norms_csv):
    """Means over records of the patch embedding's gradient norm against the blocks' dense
    layers: `ratio_to_max`, `ratio_to_median`, `largest`, `patch_norm`, `largest_block_norm`."""
    records = []
    for layers in read_grad_norms(grad_norms_csv).values():
        blocks = [v for k, v in layers.items() if _BLOCK_LAYER.fullmatch(k)]
        if PATCH_EMBEDDING_LAYER in layers and blocks:
            patch, largest = layers[PATCH_EMBEDDING_LAYER], max(blocks)
            records.append({"ratio_to_max": patch / largest,
                            "ratio_to_median": patch / float(np.median(blocks)),
                            "largest": patch > largest, "patch_norm": patch,
                            "largest_block_norm": largest})
    if not records:
        raise ValueError(f"{grad_norms_csv} has no record with {PATCH_EMBEDDING_LAYER!r} and "
                         "block layers.")
    return {key: float(np.mean([record[key] for record in records])) for key in records[0]}


def gradient_norm_table(rows):
    """Markdown: `patch_embedding_gradient_ratio` per stem variant of `STEM_PAIRS`' groups."""
    header = ["group", "stem", "runs", "patch embedding / largest block layer",
              "patch embedding / median block layer",
              "records where the patch embedding is largest", "patch embedding's gradient norm",
              "largest block layer's"]
    table = []
    for group, variants in STEM_PAIRS.items():
        for variant in variants:
            runs = [r for r in rows if r["group"] == group and r["variant"] == variant
                    and r["status"] == "completed"
                    and grad_norms_file(r["run_dir"])]
            if not runs:
                continue
            stats = [patch_embedding_gradient_ratio(grad_norms_file(r["run_dir"])) for r in runs]
            ratio_to_max, ratio_to_median, patch, block = (
                mean_ci_text([s[key] for s in stats], 1) for key in
                ("ratio_to_max", "ratio_to_median", "patch_norm", "largest_block_norm"))
            share = np.mean([s["largest"] for s in stats])
            table.append([group, variant, str(len(runs)), ratio_to_max, ratio_to_median,
                          f"{share:.0%}", patch, block])
    return table_text(header, table)


def write_rows(rows, output_dir, name):
    """Writes `rows` as the CSV `<output_dir>/<name>`; returns its path."""
    os.makedirs(output_dir, exist_ok=True)
    records = [{**{key: row.get(key) for key in RESULT_FIELDS},
                "run_dir": os.path.relpath(row["run_dir"], output_dir)} for row in rows]
    path = os.path.join(output_dir, name)
    durable.write_csv(path, RESULT_FIELDS, records, stage="results")
    return path


def write_results(rows, output_dir):
    """Writes `results.csv` and every table the rows allow (docs/study.md, "Output")."""
    write_rows(rows, output_dir, "results.csv")
    for group in dict.fromkeys(row["group"] for row in rows):
        group_rows = [r for r in rows if r["group"] == group]
        summary = summarize(group_rows)
        durable.write_text(os.path.join(output_dir, f"{group}.md"), markdown_table(summary))
        stem_levels = factors.dpn_factor_table(group_rows, group)
        speed = overview = ""
        # at other factor levels the baseline's accuracy is no target for a variant
        if len(summary) > 1 and not stem_levels:
            step_times = read_step_times(output_dir, [entry["variant"] for entry in summary])
            speed = time_to_accuracy_table(group_rows, step_times)
            overview = overview_table(group_rows, summary, step_times)
        for name, table in ((f"{group}_convergence.md", factors.convergence_table(group_rows)),
                            (f"{group}_differences.md", stem_levels or difference_table(summary)),
                            (f"{group}_time_to_accuracy.md", speed),
                            (f"{group}_overview.md", overview),
                            (f"{group}_summary.md", factors.depth_table(group_rows, group))):
            if table:
                durable.write_text(os.path.join(output_dir, name), table)
    for name, table in (("gradient_norms.md", gradient_norm_table(rows)),
                        ("dpn_factors_against_dpn.md", factors.against_dpn_table(rows))):
        if table:
            durable.write_text(os.path.join(output_dir, name), table)


def summarize(rows, metric="test_accuracy"):
    """Per-variant summary of one group, baseline (first variant) first.

    Returns a list of dicts: variant, runs, diverged, diverged_steps, mean (`None` where
    all runs diverged), ci (95% half-width), gain over the baseline's mean, gain_ci (its
    Welch 95% CI half-width) and p_value (Welch's test); the last two `None` for the
    baseline and where either side has no finished run, NaN with one run on a side.
    """
    summary = []
    for name in dict.fromkeys(row["variant"] for row in rows):
        runs = [row for row in rows if row["variant"] == name]
        finished = [float(r[metric]) for r in runs if r["status"] == "completed"]
        diverged = [r for r in runs if r["status"] == "diverged"]
        mean, ci = confidence_interval(finished) if finished else (None, None)
        if not summary:
            baseline = finished
        compared = bool(summary) and bool(finished) and bool(baseline)
        summary.append({
            "variant": name, "runs": len(runs), "diverged": len(diverged),
            "diverged_steps": [r["diverged_at_step"] for r in diverged], "mean": mean, "ci": ci,
            "gain": None if mean is None or not baseline else mean - float(np.mean(baseline)),
            "gain_ci": difference_interval(finished, baseline)[1] if compared else None,
            "p_value": welch_p_value(finished, baseline) if compared else None,
        })
    return summary


def difference_table(summary):
    """Markdown: each variant of a `summarize` summary against the baseline, with p-values."""
    if len(summary) < 2:
        return ""
    baseline = summary[0]
    header = ["variant", "runs", "test accuracy (%), mean ± 95% CI", f"{baseline['variant']} (%)",
              "difference, points (Welch 95% CI)"]
    rows = [([entry["variant"], str(entry["runs"]), _mean_ci(entry), _mean_ci(baseline),
              "n/a" if entry["gain_ci"] is None
              else difference_text(entry["gain"], entry["gain_ci"])],
             math.nan if entry["p_value"] is None else entry["p_value"])
            for entry in summary[1:]]
    return p_value_table(header, rows)


def _mean_ci(entry):
    """`mean ± 95% CI` of a `summarize` entry, as `stats.mean_ci_text` writes it."""
    if entry["mean"] is None:
        return "n/a"
    ci = "" if math.isnan(entry["ci"]) else f" ± {100 * entry['ci']:.2f}"
    return f"{100 * entry['mean']:.2f}{ci}"


def markdown_table(summary, metric_label="test accuracy (%)"):
    """The paper's format: mean ± 95% CI over seeds and the gain over the baseline."""
    header = ["variant", "runs", f"{metric_label}, mean ± 95% CI",
              f"gain over {summary[0]['variant']}", "diverged"]
    table = []
    for entry in summary:
        if entry["mean"] is None:
            accuracy, gain = "diverged", "n/a"
        else:
            accuracy = _mean_ci(entry)
            gain = f"{100 * entry['gain']:+.2f}" if entry["gain"] is not None else "n/a"
        steps = ", ".join(map(str, entry["diverged_steps"]))
        diverged = f"{entry['diverged']} (at steps {steps})" if entry["diverged"] else "0"
        table.append([entry["variant"], str(entry["runs"]), accuracy, gain, diverged])
    return table_text(header, table)
