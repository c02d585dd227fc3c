"""Tables of the factor groups: Dual PatchNorm against the plain stem per factor level,
training stability by depth, and how flat each variant's validation curve is at the end."""

import math
import os
import re

import numpy as np

from keras_vitnorm import durable
from keras_vitnorm.study.one_run import grad_norms_file
from keras_vitnorm.study.one_run import read_grad_norms
from keras_vitnorm.study.one_run import read_metrics
from keras_vitnorm.study.stats import difference_interval
from keras_vitnorm.study.stats import difference_row
from keras_vitnorm.study.stats import mean_ci_text
from keras_vitnorm.study.stats import p_value_table
from keras_vitnorm.study.stats import table_text
from keras_vitnorm.study.variants import DPN_ABLATIONS
from keras_vitnorm.study.variants import LEVEL_COLUMNS
from keras_vitnorm.study.variants import variant_factors
from keras_vitnorm.training.run_layout import SETTINGS_FILE

#: A completed run whose test accuracy stays below this has stalled (chance: 0.1 on CIFAR-10).
STALL_ACCURACY = 0.2


def _accuracies(rows, group, **levels):
    """Test accuracies of the completed runs of `group` whose factors match `levels`."""
    return [float(row["test_accuracy"]) for row in rows
            if row["group"] == group and row["status"] == "completed"
            and levels.items() <= variant_factors(group, row["variant"]).items()]


def _stem_levels(rows, group):
    """The levels (every factor but the stem) of `group`'s variants with a row, sorted."""
    levels = {
        tuple((key, f[key]) for key, *_ in LEVEL_COLUMNS if key in f)
        for f in (variant_factors(group, r["variant"]) for r in rows if r["group"] == group)
        if f and "stem" in f
    }
    return [dict(level) for level in sorted(levels)]


def _level_cells(level):
    """The table cells of a level, in `LEVEL_COLUMNS` order."""
    return [cell.format(level[key]) for key, _, cell, _ in LEVEL_COLUMNS if key in level]


def _level_header(levels):
    """The header cells of the factors `levels` vary (those of the first level)."""
    return [column for key, column, *_ in LEVEL_COLUMNS if levels and key in levels[0]]


def _against_plain(rows, group):
    """`(level, stem, treated, plain)` of every stem variant with a completed run."""
    for level in _stem_levels(rows, group):
        plain = _accuracies(rows, group, stem="patch", **level)
        for stem in ("dpn", *DPN_ABLATIONS):
            treated = _accuracies(rows, group, stem=stem, **level)
            if treated:
                yield level, stem, treated, plain


def stem_differences(rows, group="dpn_factors"):
    """Per factor level, each stem variant against the plain stem: dicts of the level's
    factors, `stem`, the test-accuracy `difference`, its Welch 95% CI half-width `ci` (NaN
    with one run on a side), `runs` and `plain_runs`; levels missing a side are left out."""
    found = []
    for level, stem, treated, plain in _against_plain(rows, group):
        if plain:
            difference, ci = difference_interval(treated, plain)
            found.append({**level, "stem": stem, "difference": difference, "ci": ci,
                          "runs": len(treated), "plain_runs": len(plain)})
    return found


def dpn_factor_table(rows, group="dpn_factors"):
    """Markdown: per factor level, each stem variant against the plain stem, with p-values."""
    header = _level_header(_stem_levels(rows, group)) + [
        "stem", "runs", "test accuracy (%), mean ± 95% CI", "plain stem (%)",
        "difference, points (Welch 95% CI)"]
    cells = [difference_row(_level_cells(level) + [stem, str(len(treated)),
                                                   mean_ci_text(treated), mean_ci_text(plain)],
                            treated, plain)
             for level, stem, treated, plain in _against_plain(rows, group)]
    return p_value_table(header, cells)


def against_dpn_table(rows, group="dpn_factors"):
    """Markdown in the paper's Table 6 format: every other stem against DPN, per level."""
    levels = _stem_levels(rows, group)
    header = _level_header(levels) + ["stem", "runs", "change against DPN, points (Welch 95% CI)"]
    cells = []
    for level in levels:
        dpn = _accuracies(rows, group, stem="dpn", **level)
        if not dpn:
            continue
        for stem in (*DPN_ABLATIONS, "patch"):
            other = _accuracies(rows, group, stem=stem, **level)
            if other:
                cells.append(difference_row(_level_cells(level) + [stem, str(len(other))],
                                            other, dpn))
    return p_value_table(header, cells)


_BLOCK = re.compile(r"block_(\d+)/")


def first_to_last_block_gradient(grad_norms_csv):
    """Median over a run's `grad_norms.csv` records of the first block's gradient norm over
    the last block's (far below 1: it vanishes on the way to the input); `nan` without."""
    ratios = []
    for layers in read_grad_norms(grad_norms_csv).values():
        blocks = {}
        for layer, norm in layers.items():
            match = _BLOCK.match(layer)
            if match:
                blocks[int(match[1])] = blocks.get(int(match[1]), 0.0) + norm**2
        if len(blocks) > 1 and 0 in blocks and blocks[max(blocks)] > 0:
            ratios.append(math.sqrt(blocks[0] / blocks[max(blocks)]))
    return float(np.median(ratios)) if ratios else math.nan


def _gradient_ratio_cell(runs):
    """Geometric mean and range over `runs` of `first_to_last_block_gradient`."""
    paths = [grad_norms_file(r["run_dir"]) for r in runs
             if r["status"] == "completed" and r.get("run_dir")]
    ratios = [first_to_last_block_gradient(path) for path in paths if path]
    ratios = [r for r in ratios if not math.isnan(r)]
    if not ratios:
        return "n/a"
    # a first block whose gradient underflowed to 0 makes the geometric mean 0
    mean = 0.0 if min(ratios) == 0 else math.exp(float(np.mean(np.log(ratios))))
    if len(ratios) == 1:
        return f"{mean:.3g}"
    return f"{mean:.3g} ({min(ratios):.3g} to {max(ratios):.3g})"


def peak_step(run_dir):
    """The step ending the epoch of a run's best validation accuracy, or `None`."""
    metrics = read_metrics(run_dir) or {}
    config = durable.read_json(os.path.join(run_dir, SETTINGS_FILE)) or {}
    if not metrics.get("best_epoch") or not config.get("steps_per_epoch"):
        return None
    return metrics["best_epoch"] * config["steps_per_epoch"]


def _stalled_cell(stalled):
    """How many runs stalled and, where known, each one's `peak_step`."""
    steps = [peak_step(r["run_dir"]) for r in stalled if r.get("run_dir")]
    steps = [str(s) for s in steps if s is not None]
    return f"{len(stalled)} ({', '.join(steps)})" if steps else str(len(stalled))


def depth_table(rows, group="depth_stability"):
    """Markdown: per placement, depth and warm-up (and rate), the runs that trained, diverged
    or stalled (docs/study.md, "Output"); `""` for a group without these factors."""
    group_rows = [r for r in rows if r["group"] == group
                  and {"placement", "depth", "warmup"} <= variant_factors(group, r["variant"]).keys()]
    rates = {float(r["learning_rate"]) for r in group_rows if r.get("learning_rate") not in (None, "")}
    by_rate = len(rates) > 1
    cells = {}  # (placement, depth, warm-up, rate or None) -> runs
    for row in group_rows:
        factors = variant_factors(group, row["variant"])
        rate = float(row["learning_rate"]) if by_rate else None
        cells.setdefault((factors["placement"], factors["depth"], factors["warmup"], rate),
                         []).append(row)
    header = ["placement", "depth", "warm-up", *(["peak learning rate"] if by_rate else []),
              "runs", "trained", "diverged (steps)", "stalled (steps of best val. accuracy)",
              "test accuracy of trained runs (%)", "first / last block gradient norm"]
    table = []
    order = list(dict.fromkeys(key[:3] for key in cells))  # factors in the rows' order
    for key in sorted(cells, key=lambda k: (order.index(k[:3]), k[3:])):  # then by rate
        placement, depth, warmup, rate = key
        runs = cells[key]
        diverged = [r for r in runs if r["status"] == "diverged"]
        completed = [r for r in runs if r["status"] == "completed"]
        stalled = [r for r in completed if float(r["test_accuracy"]) < STALL_ACCURACY]
        trained = [float(r["test_accuracy"]) for r in completed if r not in stalled]
        steps = ", ".join(str(r["diverged_at_step"]) for r in diverged)
        table.append([placement, str(depth), "yes" if warmup else "no",
                      *([f"{rate:g}"] if by_rate else []), str(len(runs)), str(len(trained)),
                      f"{len(diverged)}" + (f" ({steps})" if steps else ""), _stalled_cell(stalled),
                      mean_ci_text(trained), _gradient_ratio_cell(runs)])
    return table_text(header, table)


def residual_stream_table(streams):
    """Markdown: per model of `streams` (`{label: [residual_stream result per run]}`), the
    residual stream's RMS and consecutive-block similarity (near 1: collapse)."""
    header = ["model", "runs", "RMS after stem", "RMS at middle block", "RMS after last block",
              "consecutive-block similarity, mean", "last 3 blocks, mean"]
    table = []
    for label, runs in streams.items():
        if not runs:
            continue
        rms = [stream["rms"] for stream in runs]
        similarity = [stream["similarity"] for stream in runs]
        cells = [[r[0] for r in rms], [r[len(r) // 2] for r in rms], [r[-1] for r in rms],
                 [float(np.mean(s)) for s in similarity],
                 [float(np.mean(s[-3:])) for s in similarity]]
        table.append([label, str(len(runs)), *(
            mean_ci_text(c, 1, digits) for c, digits in zip(cells, (2, 2, 2, 3, 3)))])
    return table_text(header, table)


def convergence_table(rows):
    """Markdown: how flat each variant's curve is when training stops; `""` under 4 epochs."""
    from keras_vitnorm.study.figures import validation_curves

    header = ["variant", "runs", "epochs", "half and late mark (epoch)",
              "val. accuracy at the half mark (%)", "at the late mark (%)", "at the end (%)",
              "added after the late mark (points, mean ± 95% CI)",
              "training accuracy, last epoch (%)"]
    table = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        curves = 100 * validation_curves(rows, variant)
        if curves.shape[1] < 4:
            continue
        epochs = curves.shape[1]
        half_mark, late_mark = epochs // 2, (3 * epochs) // 4
        half, late = curves[:, half_mark - 1], curves[:, late_mark - 1]
        added = mean_ci_text(list((curves[:, -1] - late) / 100))
        training = 100 * validation_curves(rows, variant, column="accuracy")[:, epochs - 1]
        table.append([variant, str(len(curves)), str(epochs), f"{half_mark}, {late_mark}",
                      f"{half.mean():.2f}", f"{late.mean():.2f}", f"{curves[:, -1].mean():.2f}",
                      added, f"{training.mean():.2f}"])
    return table_text(header, table)
