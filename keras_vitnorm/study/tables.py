"""The study's tables: `results.csv`, one table per group in the paper's format, each
variant against the group's baseline with its Welch interval and Holm-adjusted
p-value, and the gradient-norm table of the stem groups.

The tables read the result rows `run_study` returns (one per run: group, variant,
seed, status, accuracies, run directory); the factor groups' own tables are in
`keras_vitnorm.study.factors`.
"""

import csv
import io
import math
import os
import re

import numpy as np

from keras_vitnorm import durable
from keras_vitnorm.study import factors
from keras_vitnorm.study.runs import read_grad_norms
from keras_vitnorm.study.stats import confidence_interval
from keras_vitnorm.study.stats import difference_interval
from keras_vitnorm.study.stats import difference_text
from keras_vitnorm.study.stats import holm_adjusted
from keras_vitnorm.study.stats import p_value_header
from keras_vitnorm.study.stats import p_value_text
from keras_vitnorm.study.stats import welch_p_value
from keras_vitnorm.study.time_to_accuracy import time_to_accuracy_table
from keras_vitnorm.study.variants import STEM_PAIRS

RESULT_FIELDS = (
    "group", "variant", "seed", "learning_rate", "status", "test_accuracy", "val_accuracy",
    "val_examples", "diverged_at_step", "steps", "train_seconds", "run_dir",
)


PATCH_EMBEDDING_LAYER = "stem/projection"
_BLOCK_LAYER = re.compile(r"block_\d+/(attention/(qkv|out)|mlp/(fc1|fc2))")


def patch_embedding_gradient_ratio(grad_norms_csv):
    """How the patch embedding's gradient norm compares with the blocks' layers.

    Per record (the step-0 record left out: with the zero-initialized head every
    gradient but the head's is zero there), the patch embedding's gradient norm is
    divided by the largest and by the median gradient norm of the blocks' dense
    layers (qkv, attention output, fc1, fc2).

    Returns a dict: `ratio_to_max` and `ratio_to_median` (means over records),
    `largest` (share of records in which the patch embedding has the largest norm
    of all those layers), and the norms the ratios divide: `patch_norm` and
    `largest_block_norm` (means over records). A stem can lower the patch
    embedding's norm and raise its ratio, by lowering the blocks' more.
    """
    to_max, to_median, largest, patch_norms, block_norms = [], [], [], [], []
    for layers in read_grad_norms(grad_norms_csv).values():
        blocks = [v for k, v in layers.items() if _BLOCK_LAYER.fullmatch(k)]
        if PATCH_EMBEDDING_LAYER not in layers or not blocks:
            continue
        patch = layers[PATCH_EMBEDDING_LAYER]
        to_max.append(patch / max(blocks))
        to_median.append(patch / float(np.median(blocks)))
        largest.append(patch > max(blocks))
        patch_norms.append(patch)
        block_norms.append(max(blocks))
    if not to_max:
        raise ValueError(f"{grad_norms_csv} has no record with {PATCH_EMBEDDING_LAYER!r} and block layers.")
    return {"ratio_to_max": float(np.mean(to_max)), "ratio_to_median": float(np.mean(to_median)),
            "largest": float(np.mean(largest)), "patch_norm": float(np.mean(patch_norms)),
            "largest_block_norm": float(np.mean(block_norms))}


def gradient_norm_table(rows):
    """Markdown table of `patch_embedding_gradient_ratio` per stem variant, over seeds
    (mean ± 95% CI), for every group of `STEM_PAIRS` that recorded gradient norms: the
    ratios, the share of records in which the patch embedding is largest, and the
    norms themselves (in absolute terms and relative to the blocks, as a reader of
    the paper's Figure 2 asks)."""
    lines = ["| group | stem | runs | patch embedding / largest block layer "
             "| patch embedding / median block layer | records where the patch embedding is largest "
             "| patch embedding's gradient norm | largest block layer's |",
             "|---|---|---|---|---|---|---|---|"]
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
            for key in ("ratio_to_max", "ratio_to_median", "patch_norm", "largest_block_norm"):
                mean, ci = confidence_interval([s[key] for s in stats])
                cells.append(f"{mean:.2f}" + ("" if math.isnan(ci) else f" ± {ci:.2f}"))
            share = np.mean([s["largest"] for s in stats])
            lines.append(f"| {group} | {variant} | {len(runs)} | {cells[0]} | {cells[1]} "
                         f"| {share:.0%} | {cells[2]} | {cells[3]} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def write_rows(rows, output_dir, name):
    """Writes result rows as `<output_dir>/<name>`, a CSV of `RESULT_FIELDS` with run
    directories relative to `output_dir`; returns its path."""
    os.makedirs(output_dir, exist_ok=True)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=RESULT_FIELDS)
    writer.writeheader()
    for row in rows:
        record = {key: row.get(key) for key in RESULT_FIELDS}
        record["run_dir"] = os.path.relpath(row["run_dir"], output_dir)
        writer.writerow(record)
    path = os.path.join(output_dir, name)
    durable.write_text(path, buffer.getvalue(), stage="results")
    return path


def write_results(rows, output_dir):
    """Writes `results.csv`, one markdown table per group, `<group>_convergence.md`
    for groups trained four or more epochs (`factors.convergence_table`) and, where
    the groups ran: `<group>_differences.md` (for a group that varies the stem by
    factor level, `dpn_factors` and `dpn_schedule`, each stem against the plain stem at
    its level; for any other group of two or more variants, each variant against the
    group's baseline), `<group>_time_to_accuracy.md` (groups of two or more variants
    other than those, whose runs logged their epochs:
    `keras_vitnorm.study.time_to_accuracy`), `gradient_norms.md` (stem runs that
    recorded gradient norms),
    `dpn_factors_against_dpn.md` (every other stem against DPN, the paper's Table 6
    format) and `<group>_summary.md` for the groups over placement, depth and warm-up,
    `depth_stability` and `deep` (what trains, diverges or stalls by depth:
    `factors.depth_table`)."""
    write_rows(rows, output_dir, "results.csv")
    for group in dict.fromkeys(row["group"] for row in rows):
        group_rows = [r for r in rows if r["group"] == group]
        summary = summarize(group_rows)
        durable.write_text(os.path.join(output_dir, f"{group}.md"), markdown_table(summary))
        stem_levels = factors.dpn_factor_table(group_rows, group)
        # at other factor levels the baseline's accuracy is no target for a variant
        speed = time_to_accuracy_table(group_rows) if len(summary) > 1 and not stem_levels else ""
        for name, table in ((f"{group}_convergence.md", factors.convergence_table(group_rows)),
                            (f"{group}_differences.md", stem_levels or difference_table(summary)),
                            (f"{group}_time_to_accuracy.md", speed),
                            (f"{group}_summary.md", factors.depth_table(group_rows, group))):
            if table:
                durable.write_text(os.path.join(output_dir, name), table)
    for name, table in (
        ("gradient_norms.md", gradient_norm_table(rows)),
        ("dpn_factors_against_dpn.md", factors.against_dpn_table(rows)),
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
