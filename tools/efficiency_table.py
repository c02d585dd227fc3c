"""The efficiency table: each variant against pre-LN per setting, and the most efficient.

    python tools/efficiency_table.py docs/study-results/efficiency/variants_*.json \\
        --study docs/study-results/cifar10-converged --group converged \\
        --step-time docs/study-results/efficiency/gpu_variants_study_b256.json:jax \\
        --output docs/study-results/efficiency/efficiency_table.md

Reads the JSON files of `benchmarks/bench_variants.py --json` (one model, batch,
device and precision each, for one or more backends; the baseline `pre_ln`) and,
with `--study`, a study folder's `results.csv` and run logs. Every row of the table
is one setting: training or inference throughput of a model on a backend and device,
its peak training memory, or the study's steps and seconds to the baseline's final
validation accuracy (`keras_vitnorm.study.time_to_accuracy`). The baseline's column
gives its own figure; every other column the variant's against it:

- throughput: images per second as a ratio to the baseline's in the same round (above
  1 is faster), median and range over rounds;
- peak memory: the median over processes as a ratio to the baseline's;
- steps and seconds to the target: the mean over the runs that reach it as a ratio to
  the baseline's, with how many runs reach it.

The last column names the most efficient choice only where the spread resolves it:
a variant on the better side of the baseline in every round (throughput), every
process (memory) or every run (time to accuracy: each of its runs reaches the target
before any run of the baseline does), and significantly so after Holm's adjustment
over the row's variants: a one-sample t-test of the per-round log ratios for
throughput, Welch's t-test for memory and for the runs that reach the target. Of
several, the best median or mean. Otherwise it says "no resolved difference", and it
names the variants on the better side that the test does not resolve and those
resolved worse. With one process per variant, memory has no spread to test, and the
sides alone decide (the row says so). With `--step-time FILE:BACKEND` the seconds are
each run's steps times the variant's median training-step time in that benchmark
(measured alone; the sides then also hold at the variant's slowest and the
baseline's fastest round); without it, each run's own training time, which counts
what shared its device.
"""

import argparse
import csv
import json
import math
import os
import statistics
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from keras_vitnorm import durable  # noqa: E402
from keras_vitnorm.study.stats import holm_adjusted  # noqa: E402
from keras_vitnorm.study.stats import kaplan_meier_median  # noqa: E402
from keras_vitnorm.study.stats import p_value_text  # noqa: E402
from keras_vitnorm.study.stats import welch_p_value  # noqa: E402

MODEL_NAMES = {"s16": "S/16", "b16": "B/16", "study": "study ViT",
               "imagenette_cpu": "Ti/16 at 112 px"}
#: The variant every benchmark measures against (bench_variants.py's first).
BASELINE = "pre_ln"
#: Variant names of benchmark files that name each variant by its change, as the study's.
BENCHMARK_NAMES = {"layernorm (baseline)": "pre_ln", "dual_patchnorm stem": "dual_patchnorm",
                   "conv stem": "conv_stem"}


def _renamed(by_variant):
    """`{variant: figures}` under the study's names, the baseline first; `None` without it."""
    renamed = {BENCHMARK_NAMES.get(name, name): value for name, value in by_variant.items()}
    if BASELINE not in renamed:
        return None
    return {BASELINE: renamed.pop(BASELINE), **renamed}


def _ratio_text(values):
    return f"{statistics.median(values):.2f}x ({min(values):.2f} to {max(values):.2f})"


def paired_p_value(ratios):
    """Two-sided p-value of the one-sample t-test that the mean log ratio (per round, to
    the baseline of the same round) is 0; NaN with fewer than two rounds."""
    from scipy import stats

    logs = np.log(np.asarray(ratios, "float64"))
    if len(logs) < 2:
        return math.nan
    if np.ptp(logs) == 0:
        return 0.0 if logs[0] != 0 else 1.0
    return float(stats.ttest_1samp(logs, 0.0).pvalue)


def resolved_row(setting, baseline, baseline_text, cells, rank, better, worse, p_values, words):
    """A table row and its verdict.

    `better`/`worse`: the variants whose every round, process or run lies on one side
    of the baseline's; `p_values`: `{variant: p}` of the test of each against the
    baseline, Holm-adjusted here over the row's variants, or `None` where the row has
    no spread to test (then the sides alone decide, and `words[2]` says so); `rank`:
    sort key of the resolved ones, best first; `words`: (better, worse, note).
    """
    adjusted = {}
    if p_values is not None:
        compared = list(cells)
        adjusted = dict(zip(compared, holm_adjusted([p_values[n] for n in compared])))

    def passes(n):
        return p_values is None or adjusted[n] < 0.05

    better_words, worse_words, note = words
    resolved = sorted((n for n in better if passes(n)), key=rank)
    if resolved:
        line = f"**{resolved[0]}**: {cells[resolved[0]]}, {better_words}{note}"
        if p_values is not None:
            p = p_value_text(adjusted[resolved[0]])
            line += f", p {'< 0.001' if p == '<0.001' else '= ' + p} (Holm over {len(adjusted)})"
        if len(resolved) > 1:
            line += "; also " + ", ".join(resolved[1:])
    else:
        line = f"no resolved difference{note}"
    resolved_worse = [n for n in worse if passes(n)]
    if resolved_worse:
        line += f"; {worse_words}: " + ", ".join(resolved_worse)
    for side, names in ((better_words, better), (worse_words, worse)):
        failed = [n for n in names if not passes(n)]
        untested = [n for n in failed if math.isnan(adjusted[n])]
        if len(failed) > len(untested):
            line += (f"; {side} but not significant after Holm: "
                     + ", ".join(n for n in failed if n not in untested))
        if untested:
            line += f"; {side}, too few values to test: " + ", ".join(untested)
    return {"setting": setting, "baseline_name": baseline, "baseline": baseline_text,
            "cells": cells, "verdict": line}


def throughput_row(setting, seconds, batch_size):
    """A row from per-round seconds per step (`{variant: [seconds]}`, baseline first)."""
    names = list(seconds)
    base = seconds[names[0]]
    ratios = {n: [b / t for b, t in zip(base, seconds[n])] for n in names[1:]}
    rate = batch_size / statistics.median(base)
    return resolved_row(
        setting, names[0], f"{rate:,.0f} img/s" if rate >= 100 else f"{rate:.2f} img/s",
        {n: _ratio_text(r) for n, r in ratios.items()},
        lambda n: -statistics.median(ratios[n]),
        [n for n in ratios if min(ratios[n]) > 1], [n for n in ratios if max(ratios[n]) < 1],
        {n: paired_p_value(r) for n, r in ratios.items()},
        ("faster in every round", "slower in every round", ""))


def memory_row(setting, peaks):
    """A row from peak bytes per process (`{variant: [bytes]}`, baseline first)."""
    names = list(peaks)
    base = peaks[names[0]]
    ratio = {n: statistics.median(peaks[n]) / statistics.median(base) for n in names[1:]}
    single = any(len(p) == 1 for p in peaks.values())
    return resolved_row(
        setting, names[0], f"{statistics.median(base) / 2 ** 20:,.0f} MiB",
        {n: f"{r:.2f}x" for n, r in ratio.items()}, ratio.get,
        [n for n in ratio if max(peaks[n]) < min(base)],
        [n for n in ratio if min(peaks[n]) > max(base)],
        None if single else {n: welch_p_value(peaks[n], base) for n in ratio},
        ("less memory", "more memory", " (one process each: spread not measured)") if single
        else ("less memory in every process", "more memory in every process", ""))


def benchmark_rows(path):
    """The rows of one `bench_variants.py --json` file: per backend, training and inference
    throughput and peak memory, where measured."""
    with open(path) as f:
        data = json.load(f)
    arguments = data["arguments"]
    model = MODEL_NAMES.get(arguments["model"], arguments["model"])
    where = arguments.get("device", "cpu").upper()
    detail = f"batch {arguments['batch_size']}, {arguments['mixed_precision']}"
    rows = []

    def left_out(backend, what, why):
        print(f"{path}: {backend}'s {what} left out: {why[:200]}", file=sys.stderr)

    for backend, result in data["results"].items():
        if "error" in result:
            left_out(backend, "time", result["error"])
        for name, error in result.get("memory_errors", {}).items():
            left_out(backend, f"memory of {name}", error)
        for key, mode in (("seconds", "training"), ("inference_seconds", "inference")):
            figures = _renamed(result.get(key, {}))
            if figures:
                rows.append(throughput_row(
                    f"{model} {mode}, {where} {backend} ({detail}, "
                    f"{len(figures[BASELINE])} rounds)", figures, arguments["batch_size"]))
        peaks = _renamed(result.get("peak_bytes", {}))
        if peaks:
            rows.append(memory_row(f"{model} peak training memory, {where} {backend} "
                                   f"({detail}; {result['memory']})", peaks))
        elif result.get("peak_bytes"):
            left_out(backend, "memory", f"no measurement of {BASELINE}")
    return rows


def study_runs(study_dir, group):
    """`(target, {variant: [Arrival per completed run]})` of a study folder's group
    (`keras_vitnorm.study.time_to_accuracy.runs_to_target`), run directories read relative to
    the folder."""
    from keras_vitnorm.study.time_to_accuracy import runs_to_target

    with open(os.path.join(study_dir, "results.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    groups = list(dict.fromkeys(r["group"] for r in rows))
    if group not in groups:
        raise ValueError(f"group {group!r} is not in {study_dir}/results.csv; it has "
                         + ", ".join(groups))
    target, runs = runs_to_target([dict(r, run_dir=os.path.join(study_dir, r["run_dir"]))
                                   for r in rows if r["group"] == group])
    if target is None:
        raise ValueError(f"the runs of {group!r} in {study_dir} have no validation logs")
    return target, runs


def _time_row(label, times, runs, unit, words, upper, lower):
    """A steps or seconds row from `{variant: [figure per completed run]}`, baseline
    first: the time to the target, or where a run never reached it its whole length,
    at which it is right-censored (`runs`' `Arrival.reached` says which). A variant's
    figure is the Kaplan-Meier median of its runs (`stats.kaplan_meier_median`), its
    cell that median over the baseline's; `upper(n)`: the most a run of `n` takes,
    `math.inf` unless every run reached the target; `lower(n)`: the least a run that
    reached it took, `math.inf` where none did. Tested with the log-rank test, which
    counts the censored runs."""
    names = list(times)
    base = names[0]
    arrived = {n: [a.reached for a in runs[n]] for n in names}
    median = {n: kaplan_meier_median(times[n], arrived[n]) for n in names}
    counts = {n: sum(arrived[n]) for n in names}
    reached = {n: f"{counts[n]} of {len(runs[n])} runs" for n in names}

    def text(n):
        return "never" if not counts[n] else "n/a"

    cells = {n: (f"{median[n] / median[base]:.2f}x ({reached[n]})"
                 if median[n] is not None and median[base] is not None
                 else f"{text(n)} ({reached[n]})") for n in names[1:]}
    return resolved_row(
        label, base, (f"{median[base]:,.0f} {unit} ({reached[base]})" if median[base] is not None
                      else f"{text(base)} ({reached[base]})"),
        cells, lambda n: median[n] if median[n] is not None else math.inf,
        [n for n in names[1:] if upper(n) < lower(base)],
        [n for n in names[1:] if counts[base] and lower(n) > upper(base)],
        {n: _log_rank_p(times[n], arrived[n], times[base], arrived[base]) for n in names[1:]},
        (f"fewer {words} in every run", f"more {words} in every run", ""))


def _log_rank_p(times, arrived, base_times, base_arrived):
    """The log-rank test's p-value of two sets of right-censored times; NaN with fewer
    than two runs on a side or no run reaching the target on either."""
    from scipy import stats

    if min(len(times), len(base_times)) < 2 or not (any(arrived) or any(base_arrived)):
        return math.nan

    def data(values, events):
        values, events = np.asarray(values, "float64"), np.asarray(events, bool)
        return stats.CensoredData(uncensored=values[events], right=values[~events])

    return float(stats.logrank(data(times, arrived), data(base_times, base_arrived)).pvalue)


def time_to_accuracy_rows(setting, runs, step_seconds=None, step_setting=None):
    """The steps row and the seconds row of `runs` (`{variant: [Arrival per completed
    run]}`, `keras_vitnorm.study.time_to_accuracy`): a run that never reaches the
    target counts, censored at its last step (`_time_row`).

    With `step_seconds` (`{variant: [per-round training-step seconds]}`, measured alone),
    a run's seconds are its steps times its variant's median step time; a variant is
    resolved faster when its slowest run at its slowest round's step-time ratio to the
    baseline still beats the baseline's fastest run. Without it, each run's own seconds.
    """
    names = list(runs)
    steps = {n: [a.steps for a in runs[n]] for n in names}

    def bounds(values):
        def upper(n):
            return max(values[n]) if all(a.reached for a in runs[n]) and values[n] else math.inf

        def lower(n):
            return min((v for v, a in zip(values[n], runs[n]) if a.reached), default=math.inf)

        return upper, lower

    rows = [_time_row(f"steps to {setting}", steps, runs, "steps", "steps", *bounds(steps))]
    if step_seconds is None:
        if any(a.seconds is None for n in names for a in runs[n]):
            raise ValueError(f"a run of {setting} has no training time: give a step-time benchmark")
        seconds = {n: [a.seconds for a in runs[n]] for n in names}
        rows.append(_time_row(f"seconds to {setting}; each run's own training time",
                              seconds, runs, "s", "seconds", *bounds(seconds)))
        return rows
    missing = [n for n in names if n not in step_seconds]
    if missing:
        raise ValueError(f"the step-time benchmark ({step_setting}) has no {', '.join(missing)}")
    base_step = step_seconds[names[0]]
    ratio = {n: [t / b for t, b in zip(step_seconds[n], base_step)] for n in names}
    median = {n: statistics.median(step_seconds[n]) for n in names}
    seconds = {n: [s * median[n] for s in steps[n]] for n in names}
    upper, lower = bounds(steps)
    rows.append(_time_row(
        f"seconds to {setting}; steps times the training-step time on {step_setting}",
        seconds, runs, "s", "seconds", lambda n: upper(n) * max(ratio[n]) * median[names[0]],
        lambda n: lower(n) * min(ratio[n]) * median[names[0]]))
    return rows


def step_time(spec):
    """`(setting, {variant: per-round training seconds})` from `FILE:BACKEND`."""
    path, _, backend = spec.rpartition(":")
    if not path:
        raise ValueError(f"--step-time {spec!r}: give FILE:BACKEND, e.g. study.json:jax")
    with open(path) as f:
        data = json.load(f)
    result = data["results"].get(backend, {})
    if "seconds" not in result:
        raise ValueError(f"--step-time {spec!r}: {path} has no training times for {backend!r}; "
                         f"it has {', '.join(data['results'])}")
    arguments = data["arguments"]
    setting = (f"{MODEL_NAMES.get(arguments['model'], arguments['model'])}, "
               f"{arguments.get('device', 'cpu').upper()} {backend}, batch "
               f"{arguments['batch_size']}, {arguments['mixed_precision']}")
    return setting, _renamed(result["seconds"])


def markdown(rows, variants):
    """The table: one row per setting, the baseline's figure, each variant's, the verdict."""
    lines = ["| setting | " + " | ".join(variants) + " | most efficient |",
             "|---|" + "---|" * (len(variants) + 1)]
    for row in rows:
        cells = [row["baseline"]] + [row["cells"].get(n, "n/a") for n in variants[1:]]
        lines.append(f"| {row['setting']} | " + " | ".join(cells) + f" | {row['verdict']} |")
    return "\n".join(lines) + "\n"


def efficiency_table(benchmarks, study=None, group="converged", step_time_spec=None):
    """The markdown table of the benchmark files and the study folder's group."""
    if step_time_spec and not study:
        raise ValueError("--step-time needs --study: it turns the study's steps into seconds")
    study_rows = []
    if study:
        target, runs = study_runs(study, group)
        setting = (f"{100 * target:.2f}% validation accuracy, "
                   f"{os.path.basename(os.path.normpath(study))} {group}")
        step_setting, step_seconds = step_time(step_time_spec) if step_time_spec else (None, None)
        study_rows = time_to_accuracy_rows(setting, runs, step_seconds, step_setting)
    rows = [row for path in benchmarks for row in benchmark_rows(path)] + study_rows
    baselines = sorted({row["baseline_name"] for row in rows})
    if len(baselines) > 1:
        raise ValueError(f"the inputs measure against different baselines: {baselines}")
    # the study's order of variants first, then any only the benchmarks measured
    variants = baselines + [n for row in study_rows + rows for n in row["cells"]]
    return markdown(rows, list(dict.fromkeys(variants)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("benchmarks", nargs="*", help="bench_variants.py --json files")
    parser.add_argument("--study", help="a study folder (results.csv and its runs' logs)")
    parser.add_argument("--group", default="converged", help="the study's variant group")
    parser.add_argument("--step-time", help="FILE:BACKEND, a bench_variants.py --json file of "
                                            "the study's model whose training-step times turn "
                                            "steps into seconds")
    parser.add_argument("--output", help="write the table here instead of printing it")
    args = parser.parse_args(argv)
    if not args.benchmarks and not args.study:
        parser.error("give benchmark files, --study or both")
    try:
        table = efficiency_table(args.benchmarks, args.study, args.group, args.step_time)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    if args.output:
        durable.write_text(args.output, table)
    else:
        print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
