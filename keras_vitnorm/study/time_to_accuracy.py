"""Time to accuracy: the training steps and seconds each variant takes to reach the
validation accuracy its group's baseline ends on (docs/study.md, "Output"). A run that
never arrives is right-censored at its last step, not dropped, which would credit a
variant with the pace of its lucky runs."""

import math
import os
from typing import NamedTuple

import numpy as np

from keras_vitnorm import durable
from keras_vitnorm.study.one_run import read_metrics
from keras_vitnorm.study.one_run import whole_train_seconds
from keras_vitnorm.study.stats import kaplan_meier_median
from keras_vitnorm.study.stats import table_text
from keras_vitnorm.training.run_layout import SETTINGS_FILE
from keras_vitnorm.training.run_layout import read_log


class Arrival(NamedTuple):
    """One run's `steps` to the target, or where not `reached` the steps it trained
    (censored); `rate`: its seconds per training step (`None` where unknown)."""

    steps: int
    reached: bool
    rate: float | None = None

    @property
    def seconds(self):
        """`steps` at the run's own rate; `None` where the rate is unknown."""
        return None if self.rate is None else self.steps * self.rate


def evaluation_steps(run_dir):
    """`(steps, validation accuracies)` of a finished run's evaluations, or `None`."""
    settings = durable.read_json(os.path.join(run_dir, SETTINGS_FILE))
    metrics = read_metrics(run_dir)
    if settings is None or metrics is None:
        return None
    log = read_log(os.path.join(run_dir, "log.csv"))
    accuracies = [r["val_accuracy"] for r in log if "val_accuracy" in r]
    if not accuracies:
        return None
    total = int(metrics["steps"])
    per_epoch = settings.get("steps_per_epoch") or math.ceil(total / len(accuracies))
    steps = [min((epoch + 1) * per_epoch, total) for epoch in range(len(accuracies))]
    return steps, accuracies


def steps_to_reach(run_dir, target):
    """The run's `Arrival` at `target`: the step of its first evaluation at or above it,
    or its last step (censored) where it never gets there; `None` without a log."""
    found = evaluation_steps(run_dir)
    if found is None:
        return None
    metrics = read_metrics(run_dir)
    seconds = whole_train_seconds(metrics)
    rate = seconds / metrics["steps"] if seconds and metrics.get("steps") else None
    for step, accuracy in zip(*found):
        if accuracy >= target:
            return Arrival(step, True, rate)
    return Arrival(int(metrics["steps"]), False, rate)


def runs_to_target(rows):
    """`(target, {variant: [Arrival per completed run with a log]})`, the target the baseline's
    mean final validation accuracy; `(None, {})` without one or without a log."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    completed = {v: [r for r in rows if r["variant"] == v and r["status"] == "completed"]
                 for v in variants}
    baseline = [float(r["val_accuracy"]) for r in completed[variants[0]]
                if r.get("val_accuracy") not in (None, "")]
    if not baseline or not any(evaluation_steps(r["run_dir"]) for r in completed[variants[0]]):
        return None, {}
    target = float(np.mean(baseline))
    arrivals = {v: [steps_to_reach(r["run_dir"], target) for r in completed[v]] for v in variants}
    return target, {v: [a for a in found if a is not None] for v, found in arrivals.items()}


def median_to_target(arrivals, seconds_per_step=1.0):
    """`(median, True)`: the Kaplan-Meier median of the arrivals' steps times `seconds_per_step`;
    `(longest, False)` where it is not reached; `(None, False)` without arrivals."""
    times = np.multiply([a.steps for a in arrivals], seconds_per_step, dtype="float64")
    if len(times) == 0:
        return None, False
    median = kaplan_meier_median(times, [a.reached for a in arrivals])
    return (median, True) if median is not None else (float(times.max()), False)


def time_text(value, reached):
    """A time as table text: `1,400`, `>1,400` where not reached, `n/a` for `None`."""
    return "n/a" if value is None else ("" if reached else ">") + f"{value:,.0f}"


def median_seconds(arrivals, step_time=None):
    """`median_to_target` in seconds at `step_time`, else at each run's own rate."""
    per_step = [a.rate for a in arrivals] if step_time is None else step_time
    if step_time is None and None in per_step:
        return None, False
    return median_to_target(arrivals, per_step)


def time_to_accuracy_table(rows, step_times=None):
    """Markdown: per variant, its runs' steps and seconds to the baseline's final accuracy."""
    target, runs = runs_to_target(rows)
    if target is None:
        return ""
    baseline = next(iter(runs))
    base, base_reached = median_to_target(runs[baseline])
    rate = "steps times step_times.json" if step_times else "each run's own rate"
    header = ["variant", f"runs reaching {100 * target:.2f}%",
              "steps to it per run (>: never, at its last step)", "median steps (Kaplan-Meier)",
              f"median against {baseline}'s", f"median seconds ({rate})"]
    table = []
    for variant, arrivals in runs.items():
        steps, reached = median_to_target(arrivals)
        ratio = f"{steps / base:.2f}x" if reached and base_reached else "n/a"
        seconds = median_seconds(arrivals, step_times[variant] if step_times else None)
        per_run = ", ".join(time_text(a.steps, a.reached) for a in arrivals) or "n/a"
        table.append([variant, f"{sum(a.reached for a in arrivals)} of {len(arrivals)}", per_run,
                      time_text(steps, reached), ratio, time_text(*seconds)])
    return table_text(header, table)
