"""Time to accuracy: the training steps and seconds each variant takes to reach the
validation accuracy its group's baseline ends on.

This is the efficiency half of the study's question: a norm that ends level with
pre-LN but gets there in half the steps is the cheaper one to train, and one that
costs 10% more per step must get there in 10% fewer steps to break even. Read from
each run's per-epoch `log.csv`, so a step count is resolved to the evaluation
interval (the first evaluation at or above the target). Seconds are each run's own
training time up to that step at its average rate; where several runs shared a
device (the GPU studies train 8 at once), multiply the steps by a step time measured
alone instead (`tools/efficiency_table.py --step-time` does, from a
`benchmarks/bench_variants.py` file).
"""

import csv
import math
import os

import numpy as np

from keras_vitnorm import durable
from keras_vitnorm.study.runs import read_metrics


def evaluation_steps(run_dir):
    """`(steps, validation accuracies)` at each evaluation of a finished run: the
    training step each `log.csv` row was logged at, and its `val_accuracy`. `None`
    without a log or settings."""
    log = os.path.join(run_dir, "log.csv")
    settings = durable.read_json(os.path.join(run_dir, "train_config.json"))
    metrics = read_metrics(run_dir)
    if not os.path.exists(log) or settings is None or metrics is None:
        return None
    with open(log, newline="") as f:
        accuracies = [float(r["val_accuracy"]) for r in csv.DictReader(f) if r.get("val_accuracy")]
    if not accuracies:
        return None
    total = int(metrics["steps"])
    per_epoch = settings.get("steps_per_epoch") or math.ceil(total / len(accuracies))
    steps = [min((epoch + 1) * per_epoch, total) for epoch in range(len(accuracies))]
    return steps, accuracies


def steps_to_reach(run_dir, target):
    """`(steps, seconds)` until the run's validation accuracy first reaches `target`:
    `(None, None)` if it never does, or without a log. Seconds follow the run's
    average rate (`train_seconds` over its steps); `None` where it is unknown."""
    found = evaluation_steps(run_dir)
    if found is None:
        return None, None
    for step, accuracy in zip(*found):
        if accuracy >= target:
            metrics = read_metrics(run_dir)
            seconds = metrics.get("train_seconds")
            rate = seconds / metrics["steps"] if seconds and metrics.get("steps") else None
            return step, None if rate is None else step * rate
    return None, None


def runs_to_target(rows):
    """The baseline's target and each completed run's way to it, for one group's rows.

    The target is the baseline's (first variant's) final validation accuracy, mean
    over its completed runs.

    Returns:
        `(target, {variant: [(steps, seconds) per completed run]})`, with
        `(None, None)` for a run that never reaches the target (`steps_to_reach`);
        `(None, {})` when the baseline has no final accuracy or none of its runs a log.
    """
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    completed = {v: [r for r in rows if r["variant"] == v and r["status"] == "completed"]
                 for v in variants}
    baseline = [float(r["val_accuracy"]) for r in completed[variants[0]]
                if r.get("val_accuracy") not in (None, "")]
    if not baseline or not any(evaluation_steps(r["run_dir"]) for r in completed[variants[0]]):
        return None, {}
    target = float(np.mean(baseline))
    return target, {v: [steps_to_reach(r["run_dir"], target) for r in completed[v]]
                    for v in variants}


def time_to_accuracy_table(rows):
    """Markdown for one group's result rows: the baseline's (first variant's) final
    validation accuracy, mean over its completed runs, is the target; per variant, how
    many completed runs reached it, their steps to it (mean and range), the mean as a
    fraction of the baseline's, and the mean seconds. `""` when the runs have no logs."""
    target, runs = runs_to_target(rows)
    if target is None:
        return ""
    variants = list(runs)
    lines = [f"| variant | runs | runs reaching {100 * target:.2f}% | steps to it, mean (range) "
             f"| steps against {variants[0]}'s | seconds to it, mean |",
             "|---|---|---|---|---|---|"]
    reached = {v: [found for found in results if found[0] is not None]
               for v, results in runs.items()}
    base_steps = np.mean([s for s, _ in reached[variants[0]]]) if reached[variants[0]] else None
    for variant in variants:
        found = reached[variant]
        steps = [s for s, _ in found]
        seconds = [t for _, t in found if t is not None]
        cells = ["n/a", "n/a", "n/a"]
        if steps:
            cells[0] = f"{np.mean(steps):,.0f} ({min(steps):,} to {max(steps):,})"
            cells[1] = f"{np.mean(steps) / base_steps:.2f}x" if base_steps else "n/a"
            cells[2] = f"{np.mean(seconds):,.0f}" if seconds else "n/a"
        lines.append(f"| {variant} | {len(runs[variant])} | {len(found)} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
