"""One table per group that puts each variant's accuracy, fit and cost side by side:
`<study>/<group>_overview.md` (docs/study.md, "Output", lists its columns)."""

import math
import numbers
import os

import numpy as np

from keras_vitnorm import durable
from keras_vitnorm.study import patch_statistics
from keras_vitnorm.study.one_run import ANALYSIS_FILE
from keras_vitnorm.study.stats import difference_text
from keras_vitnorm.study.stats import holm_adjusted
from keras_vitnorm.study.stats import mean_ci_text
from keras_vitnorm.study.stats import p_value_text
from keras_vitnorm.study.stats import table_text
from keras_vitnorm.study.time_to_accuracy import median_to_target
from keras_vitnorm.study.time_to_accuracy import runs_to_target
from keras_vitnorm.study.time_to_accuracy import time_text
from keras_vitnorm.training.run_layout import read_log

STEP_TIMES_FILE = "step_times.json"


def read_step_times(output_dir, variants):
    """The `{variant: seconds per training step}` of `<output_dir>/step_times.json`;
    `None` without it, a `ValueError` for an entry malformed or missing of `variants`."""
    path = os.path.join(output_dir, STEP_TIMES_FILE)
    step_times = durable.read_json(path)
    if step_times is None:
        return None
    if not isinstance(step_times, dict):
        raise ValueError(f"{path} holds {type(step_times).__name__} {step_times!r:.80}; it should "
                         'be an object, {"variant": seconds per training step, ...}')
    for name, value in step_times.items():
        if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                or not math.isfinite(value) or value <= 0):
            raise ValueError(f"{path}: the step time of {name!r} is {value!r}; it should be "
                             "a positive number of seconds per training step")
    missing = [v for v in variants if v not in step_times]
    if missing:
        raise ValueError(f"{path} has no step time for {', '.join(map(repr, missing))}; it has "
                         f"{', '.join(map(repr, step_times)) or 'none'} (tools/step_times.py "
                         "writes it from a benchmarks/bench_variants.py file)")
    return {name: float(value) for name, value in step_times.items()}


def _seed_accuracies(completed):
    """`mean ± 95% CI (per seed, in seed order)` of the runs' test accuracies, percent."""
    accuracies = [float(r["test_accuracy"]) for r in completed]
    if not accuracies:
        return "n/a"
    return mean_ci_text(accuracies) + " (" + ", ".join(f"{100 * a:.1f}" for a in accuracies) + ")"


def train_validation_gap(row):
    """The run's accuracy on its own training images (`patch_statistics`) minus its
    final validation accuracy; `None` where either is unknown."""
    analysis = durable.read_json(os.path.join(row["run_dir"], ANALYSIS_FILE)) or {}
    result = analysis.get(patch_statistics.KEY)
    train = (result or {}).get("train", {}).get("clean")
    if train is None or row.get("val_accuracy") in (None, ""):
        return None
    return float(train) - float(row["val_accuracy"])


def validation_loss_trend(run_dir):
    """`(pass, passes, rise)`: the evaluation (1-based) of the lowest `val_loss`, their
    count, and the final one's rise above the lowest, as a fraction; `None` without."""
    losses = [r["val_loss"] for r in read_log(os.path.join(run_dir, "log.csv")) if "val_loss" in r]
    if not losses or min(losses) <= 0:
        return None
    lowest = int(np.argmin(losses))
    return lowest + 1, len(losses), losses[-1] / losses[lowest] - 1


def _gap_text(completed):
    gaps = [g for g in map(train_validation_gap, completed) if g is not None]
    if not gaps:
        return "n/a"
    return f"{100 * np.mean(gaps):+.1f}" + (
        f" ({len(gaps)} of {len(completed)} runs)" if len(gaps) < len(completed) else "")


def _trend_text(completed):
    trends = [t for t in (validation_loss_trend(r["run_dir"]) for r in completed) if t]
    if not trends:
        return "n/a"
    lowest, passes, rise = np.mean(trends, axis=0)  # means of whole numbers: 27 or 26.7
    return f"min at {round(lowest, 1):g}/{round(passes, 1):g}, final {100 * rise:+.1f}%"


def _measured_step_time(runs):
    """Mean `train_seconds / steps` over the runs that recorded both; `None` without."""
    rates = [float(r["train_seconds"]) / float(r["steps"]) for r in runs
             if r.get("train_seconds") not in (None, "") and float(r.get("steps") or 0) > 0]
    return float(np.mean(rates)) if rates else None


def overview_table(rows, summary, step_times=None):
    """Markdown: the overview of one group's `rows`, with `summary` (`tables.summarize(rows)`)
    and `step_times` (`read_step_times`; `None`: each variant's measured step time)."""
    base = summary[0]["variant"]
    p_values = [math.nan if e["p_value"] is None else e["p_value"] for e in summary[1:]]
    adjusted = dict(zip((e["variant"] for e in summary[1:]), holm_adjusted(p_values)))
    tested = sum(not math.isnan(p) for p in p_values)
    target, arrivals = runs_to_target(rows)
    reaching = "n/a (no logs)" if target is None else f"{100 * target:.2f}%"
    header = ["variant", "peak learning rate", "runs (completed/total)",
              "test accuracy (%), mean ± 95% CI (per seed)",
              f"difference from {base}, points (Welch 95% CI)",
              f"p, Holm-adjusted over {tested} comparison{'s' if tested != 1 else ''}",
              "train − validation accuracy, points",
              "validation loss: lowest at pass, final above it",
              f"reaching {base}'s {reaching}: runs, median steps (Kaplan-Meier)",
              "seconds to it", "step time (ms)"]
    table = []
    for entry in summary:
        variant = entry["variant"]
        runs = sorted((r for r in rows if r["variant"] == variant), key=lambda r: int(r["seed"]))
        completed = [r for r in runs if r["status"] == "completed"]
        rates = dict.fromkeys(f"{float(r['learning_rate']):g}" for r in runs
                              if r.get("learning_rate") not in (None, ""))
        if variant == base:
            difference = p_holm = "—"
        else:
            difference = ("n/a" if entry["gain_ci"] is None
                          else difference_text(entry["gain"], entry["gain_ci"]))
            p_holm = p_value_text(adjusted[variant], holm=True)
        step_time = step_times[variant] if step_times else _measured_step_time(completed)
        time, seconds = "n/a", "n/a"
        if target is not None and arrivals[variant]:
            steps, reached = median_to_target(arrivals[variant])
            time = (f"{sum(a.reached for a in arrivals[variant])} of {len(arrivals[variant])}, "
                    + time_text(steps, reached))
            seconds = time_text(None if step_time is None else steps * step_time, reached)
        table.append([variant, ", ".join(rates) or "n/a", f"{len(completed)}/{len(runs)}",
                      _seed_accuracies(completed), difference, p_holm, _gap_text(completed),
                      _trend_text(completed), time, seconds,
                      "n/a" if step_time is None else f"{1000 * step_time:.1f}"])
    source = (f"Step time: from `{STEP_TIMES_FILE}`, measured alone." if step_times else
              "Step time: each variant's mean training seconds per step over its runs, as "
              f"the study has no `{STEP_TIMES_FILE}`; runs that trained at the same time "
              "shared the device, so a step time measured alone (`tools/step_times.py`) is "
              "the better one.")
    source += " Seconds to it: the median steps times the step time."
    return table_text(header, table) + "\n" + source + "\n"
