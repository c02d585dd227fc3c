"""The study's time to accuracy with censored runs (keras_vitnorm.study.time_to_accuracy),
its per-group overview (keras_vitnorm.study.overview) and tools/step_times.py."""

import json
import math
import os
import re
import sys

import numpy as np
import pytest
from scipy import stats

from keras_vitnorm import durable
from keras_vitnorm.study import tables
from keras_vitnorm.study.overview import overview_table
from keras_vitnorm.study.overview import read_step_times
from keras_vitnorm.study.stats import kaplan_meier_median
from keras_vitnorm.study.time_to_accuracy import runs_to_target
from keras_vitnorm.study.time_to_accuracy import time_to_accuracy_table

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))
import step_times as step_times_tool  # noqa: E402

pytestmark = pytest.mark.one_backend  # reads and writes files; no backend computes


def km_median(reached, censored):
    """The Kaplan-Meier median by hand: the first time scipy's survival function is at
    or below 0.5, `None` where it never is."""
    survival = stats.ecdf(stats.CensoredData(uncensored=reached, right=censored)).sf
    below = [t for t, p in zip(survival.quantiles, survival.probabilities) if p <= 0.5 + 1e-12]
    return below[0] if below else None


def test_kaplan_meier_median_counts_the_runs_that_never_arrive():
    # Two runs arrive at 100 and 200, one never does in its 300 steps. Dropping it would
    # give 150 (the mean of those that arrived); censored at 300, it is still on its way
    # after 200 steps, so a third of the runs arrive by 100 and two thirds by 200.
    assert kaplan_meier_median([100, 200, 300], [True, True, False]) == 200
    assert km_median([100, 200], [300]) == 200
    # One run of three arrives: fewer than half, the median lies beyond the last step.
    assert kaplan_meier_median([100, 300, 300], [True, False, False]) is None
    # Without censoring it is the lower middle value where the curve sits at 0.5.
    assert kaplan_meier_median([6, 1, 3, 2, 5, 4], [True] * 6) == 3
    assert kaplan_meier_median([1, 2, 3], [True] * 3) == 2
    # A run censored at the step another arrives at is still at risk there.
    assert kaplan_meier_median([350, 350], [True, False]) == 350
    assert kaplan_meier_median([], []) is None


def fake_run(run_dir, curve, steps=400, seconds=80.0, losses=None, train_clean=None):
    """A finished run directory as training and the stem analysis leave it: an evaluation
    every 100 steps in `log.csv`, its metrics and, with `train_clean`, the accuracy on
    its own training images in `analysis.json`."""
    os.makedirs(run_dir)
    durable.write_json(os.path.join(run_dir, "train_config.json"), {"steps_per_epoch": 100})
    durable.write_json(os.path.join(run_dir, "metrics.json"),
                       {"status": "completed", "steps": steps, "train_seconds": seconds,
                        "val_accuracy": curve[-1]})
    losses = losses or [1.0] * len(curve)
    log = "".join(f"{e},0.9,0.5,{a},{v}\n" for e, (a, v) in enumerate(zip(curve, losses)))
    durable.write_text(os.path.join(run_dir, "log.csv"),
                       "epoch,accuracy,loss,val_accuracy,val_loss\n" + log)
    if train_clean is not None:
        durable.write_json(os.path.join(run_dir, "analysis.json"),
                           {"stem_scale": None, "patch_statistics": {
                               "requested": 2000, "train": {"clean": train_clean},
                               "test": {"clean": 0.5}}})
    return run_dir


def result_row(tmp_path, variant, seed, test, curve=None, rate=1e-3, seconds=80.0, **run):
    run_dir = str(tmp_path / variant / f"seed_{seed}")
    if curve is None:  # a diverged run
        return {"group": "g", "variant": variant, "seed": seed, "learning_rate": rate,
                "status": "diverged", "test_accuracy": None, "val_accuracy": None,
                "diverged_at_step": 50, "steps": 50, "train_seconds": 9.0, "run_dir": run_dir}
    fake_run(run_dir, curve, seconds=seconds, **run)
    return {"group": "g", "variant": variant, "seed": seed, "learning_rate": rate,
            "status": "completed", "test_accuracy": test, "val_accuracy": curve[-1],
            "diverged_at_step": None, "steps": 400, "train_seconds": seconds, "run_dir": run_dir}


def test_time_to_accuracy_censors_the_runs_that_never_reach_the_target(tmp_path):
    rows = [result_row(tmp_path, "base", seed, 0.7, curve) for seed, curve in enumerate(
        [[0.5, 0.6, 0.7, 0.72], [0.5, 0.6, 0.68, 0.68], [0.5, 0.6, 0.7, 0.73]])]  # target 0.71
    rows += [result_row(tmp_path, "flaky", seed, 0.7, curve, seconds=s) for seed, (curve, s) in
             enumerate([([0.72] * 4, 40.0), ([0.6, 0.72, 0.72, 0.72], 40.0), ([0.6] * 4, 80.0)])]
    rows += [result_row(tmp_path, "rarely", seed, 0.7, curve) for seed, curve in
             enumerate([[0.72] * 4, [0.6] * 4, [0.6] * 4])]
    target, runs = runs_to_target(rows)
    assert target == pytest.approx(0.71)
    assert [(a.steps, a.reached) for a in runs["flaky"]] == [(100, True), (200, True), (400, False)]
    assert runs["flaky"][2].seconds == 80.0  # its own rate over the steps it trained
    lines = time_to_accuracy_table(rows).splitlines()
    assert lines[0] == ("| variant | runs reaching 71.00% | steps to it per run (>: never, at its "
                        "last step) | median steps (Kaplan-Meier) | median against base's "
                        "| median seconds (each run's own rate) |")
    # base: 400, >400, 400: two of three arrive by 400
    assert lines[2] == "| base | 2 of 3 | 400, >400, 400 | 400 | 1.00x | 80 |"
    # Dropping flaky's third run would make it 150 steps; counted as censored it is 200,
    # the hand computation with scipy. Seconds: each run at its own rate (0.1 s, 0.1 s,
    # 0.2 s a step): 10, 20 and >80 s, median 20.
    assert km_median([100, 200], [400]) == 200
    assert lines[3] == "| flaky | 2 of 3 | 100, 200, >400 | 200 | 0.50x | 20 |"
    # One run of three arrives: no median, no ratio.
    assert lines[4] == "| rarely | 1 of 3 | 100, >400, >400 | >400 | n/a | >80 |"
    # A step time measured alone replaces the runs' own rates.
    lines = time_to_accuracy_table(rows, {"base": 0.5, "flaky": 1.0, "rarely": 0.25}).splitlines()
    assert lines[0].endswith("| median seconds (steps times step_times.json) |")
    assert [line.rsplit(" | ", 1)[1] for line in lines[2:]] == ["200 |", "200 |", ">100 |"]
    # A baseline whose median is not reached gives no ratio.
    # (rarely as the baseline: target 0.64, which flaky's third run does not reach either)
    lines = time_to_accuracy_table([r for r in rows if r["variant"] == "rarely"]
                                   + [r for r in rows if r["variant"] == "flaky"]).splitlines()
    assert lines[2] == "| rarely | 1 of 3 | 100, >400, >400 | >400 | n/a | >80 |"
    assert lines[3] == "| flaky | 2 of 3 | 100, 200, >400 | 200 | n/a | 20 |"


def overview_rows(tmp_path):
    """Three variants over seeds 0-2, listed out of seed order; slow also has a diverged
    run. The target is base's mean final validation accuracy, (0.70 + 0.73 + 0.75) / 3."""
    spec = {  # variant: rate, [(seed, test accuracy, curve, val losses, train accuracy, s)]
        "base": (1e-3, [(2, 0.74, [0.5, 0.75, 0.74, 0.75], [1.0, 0.8, 0.7, 0.75], 0.84, 72.0),
                        (0, 0.70, [0.5, 0.6, 0.65, 0.70], [1.0, 0.9, 0.8, 0.7], 0.80, 80.0),
                        (1, 0.72, [0.5, 0.6, 0.73, 0.73], [1.0, 0.6, 0.7, 0.9], 0.82, 88.0)]),
        "fast": (2e-3, [(0, 0.76, [0.73, 0.74, 0.75, 0.76], [0.9, 0.8, 0.85, 0.9], 0.90, 120.0),
                        (1, 0.77, [0.6, 0.73, 0.75, 0.76], [0.9, 0.7, 0.8, 0.9], None, 120.0),
                        (2, 0.78, [0.73, 0.74, 0.75, 0.76], [0.9, 0.8, 0.7, 0.7], 0.86, 120.0)]),
        "slow": (5e-4, [(0, 0.60, [0.5, 0.6, 0.7, 0.73], [1.2, 1.1, 1.0, 0.9], None, 100.0),
                        (1, 0.62, [0.5, 0.6, 0.7, 0.71], [1.2, 1.1, 1.0, 1.0], None, 100.0),
                        (2, 0.61, [0.5, 0.6, 0.7, 0.71], [1.2, 1.0, 1.1, 1.2], None, 100.0),
                        (3, None, None, None, None, None)]),
    }
    return [result_row(tmp_path, variant, seed, test, curve, rate, seconds, losses=losses,
                       train_clean=train) if curve
            else result_row(tmp_path, variant, seed, None, rate=rate)
            for variant, (rate, runs) in spec.items()
            for seed, test, curve, losses, train, seconds in runs]


def test_overview_gives_each_column_as_computed_by_hand(tmp_path):
    rows = overview_rows(tmp_path)
    lines = overview_table(rows, tables.summarize(rows)).splitlines()
    assert lines[0] == (
        "| variant | peak learning rate | runs (completed/total) "
        "| test accuracy (%), mean ± 95% CI (per seed) "
        "| difference from base, points (Welch 95% CI) | p, Holm-adjusted over 2 comparisons "
        "| train − validation accuracy, points | validation loss: lowest at pass, "
        "final above it | reaching base's 72.67%: runs, median steps (Kaplan-Meier) "
        "| seconds to it | step time (ms) |")
    cells = {line.split(" | ")[0][2:]: line[2:-2].split(" | ") for line in lines[2:5]}
    assert list(cells) == ["base", "fast", "slow"]
    accuracy = {"base": [0.70, 0.72, 0.74], "fast": [0.76, 0.77, 0.78], "slow": [0.60, 0.62, 0.61]}

    def mean_ci(values):
        half = stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(len(values))
        return f"{100 * np.mean(values):.2f} ± {100 * half:.2f}"

    welch = {v: stats.ttest_ind(accuracy[v], accuracy["base"], equal_var=False)
             for v in ("fast", "slow")}
    p_low, p_high = sorted(w.pvalue for w in welch.values())
    holm = {v: min(1, 2 * p_low) if w.pvalue == p_low else max(min(1, 2 * p_low), p_high)
            for v, w in welch.items()}
    for variant, rate, runs in (("base", "0.001", "3/3"), ("fast", "0.002", "3/3"),
                                ("slow", "0.0005", "3/4")):
        row = cells[variant]
        assert row[1:3] == [rate, runs]
        # in seed order, whatever the rows' order
        assert row[3] == mean_ci(accuracy[variant]) + " (" + ", ".join(
            f"{100 * a:.1f}" for a in accuracy[variant]) + ")"
        if variant == "base":
            assert row[4:6] == ["—", "—"]
            continue
        low, high = welch[variant].confidence_interval(0.95)
        difference = np.mean(accuracy[variant]) - np.mean(accuracy["base"])
        assert row[4] == f"{100 * difference:+.2f} ± {50 * (high - low):.2f}" + (
            " *" if low > 0 or high < 0 else "")
        assert row[5] == f"{holm[variant]:.3f}" + (" *" if holm[variant] < 0.05 else "")
    # the same differences and p-values as the group's differences table
    differences = tables.difference_table(tables.summarize(rows)).splitlines()
    for line, variant in zip(differences[2:], ("fast", "slow")):
        assert line.split(" | ")[4] == cells[variant][4]
        assert line[:-2].split(" | ")[-1] == cells[variant][5]
    # training minus final validation accuracy on the runs with patch statistics
    assert cells["base"][6] == f"{100 * np.mean([0.84 - 0.75, 0.80 - 0.70, 0.82 - 0.73]):+.1f}"
    assert cells["fast"][6] == f"{100 * np.mean([0.90 - 0.76, 0.86 - 0.76]):+.1f} (2 of 3 runs)"
    assert cells["slow"][6] == "n/a"
    # lowest validation loss: base at passes 3, 4 and 2 of 4, the finals 0.75/0.7, 0.7/0.7
    # and 0.9/0.6 of it
    rise = np.mean([0.75 / 0.7 - 1, 0, 0.9 / 0.6 - 1])
    assert cells["base"][7] == f"min at 3/4, final {100 * rise:+.1f}%"
    rise = np.mean([0.9 / 0.8 - 1, 0.9 / 0.7 - 1, 0])  # passes 2, 2 and 3
    assert cells["fast"][7] == f"min at 2.3/4, final {100 * rise:+.1f}%"
    # time to 72.67%: base 200, 300 and >400 (censored), the Kaplan-Meier median 300
    # (250 if the run that never arrives were dropped); slow 400, >400, >400: not reached
    assert km_median([200, 300], [400]) == 300
    assert km_median([100, 200, 100], []) == 100
    assert km_median([400], [400, 400]) is None
    assert [cells[v][8] for v in cells] == ["2 of 3, 300", "3 of 3, 100", "1 of 3, >400"]
    # seconds: the median times the step time, each variant's mean rate over its runs
    base_rate = np.mean([72 / 400, 80 / 400, 88 / 400])
    assert [cells[v][9:] for v in cells] == [[f"{300 * base_rate:,.0f}", f"{1000 * base_rate:.1f}"],
                                             ["30", "300.0"], [">100", "250.0"]]
    assert lines[-1].startswith("Step time: each variant's mean training seconds per step over "
                                "its runs, as the study has no `step_times.json`")
    # a step time measured alone
    lines = overview_table(rows, tables.summarize(rows),
                           {"base": 0.1, "fast": 0.05, "slow": 0.2}).splitlines()
    assert [line[2:-2].split(" | ")[9:] for line in lines[2:5]] == [
        ["30", "100.0"], ["5", "50.0"], [">80", "200.0"]]
    assert lines[-1].startswith("Step time: from `step_times.json`, measured alone.")


def test_overview_without_logs_or_analysis_says_n_a(tmp_path):
    rows = [dict(r, run_dir=str(tmp_path / "none"), learning_rate=None)
            for r in overview_rows(tmp_path)]
    cells = overview_table(rows, tables.summarize(rows)).splitlines()[3][2:-2].split(" | ")
    assert "reaching base's n/a (no logs)" in overview_table(rows, tables.summarize(rows))
    assert cells[1] == "n/a" and cells[6:10] == ["n/a"] * 4
    assert cells[10] == "300.0"  # the rows' own training time


def test_write_results_writes_the_overview_with_the_studys_step_times(tmp_path):
    rows = overview_rows(tmp_path)
    study = tmp_path / "study"
    tables.write_results(rows, str(study))
    summary = tables.summarize(rows)
    assert (study / "g_overview.md").read_text() == overview_table(rows, summary)
    step_times = {"base": 0.1, "fast": 0.05, "slow": 0.2, "other_groups": 1.0}
    (study / "step_times.json").write_text(json.dumps(step_times))
    tables.write_results(rows, str(study))
    assert (study / "g_overview.md").read_text() == overview_table(rows, summary, step_times)
    assert "steps times step_times.json" in (study / "g_time_to_accuracy.md").read_text()
    # a group of one variant has no overview
    tables.write_results([r for r in rows if r["variant"] == "base"], str(tmp_path / "one"))
    assert not (tmp_path / "one" / "g_overview.md").exists()


@pytest.mark.parametrize("content, message", [
    ('{"base": 0.1, "fast": 0.05}', r"step_times.json has no step time for 'slow'; it has 'base', "
                                    r"'fast'"),
    ('{"base": 0.1, "fast": 0.05, "slow": 0}', r"step_times.json: the step time of 'slow' is 0"),
    ('{"base": 0.1, "fast": "50 ms", "slow": 1}', r"the step time of 'fast' is '50 ms'"),
    ('[0.1, 0.05]', r"step_times.json holds list \[0.1, 0.05\]; it should be an object"),
    ('{"base": 0.1,', r"step_times.json"),
])
def test_a_bad_step_times_file_is_named_with_its_bad_value(tmp_path, content, message):
    (tmp_path / "step_times.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        read_step_times(str(tmp_path), ["base", "fast", "slow"])
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "step_times.json"))):
        tables.write_results(overview_rows(tmp_path / "runs"), str(tmp_path))
    assert read_step_times(str(tmp_path / "elsewhere"), ["base"]) is None


def bench_file(path, seconds, batch_size=32):
    """A `benchmarks/bench_variants.py --json` file measured on torch."""
    path.write_text(json.dumps({
        "arguments": {"model": "study", "batch_size": batch_size, "device": "cpu",
                      "mixed_precision": "float32"},
        "results": {"torch": {"seconds": seconds}}}))
    return str(path)


def test_step_times_tool_writes_the_groups_median_step_times(tmp_path, capsys):
    rows = overview_rows(tmp_path / "runs")
    study = tmp_path / "study"
    tables.write_rows(rows, str(study), "results.csv")
    durable.write_json(str(study / "study_config.json"), {"batch_size": 32})
    durable.write_json(str(study / "step_times.json"), {"other": 2.0, "base": 9.0})
    bench = bench_file(tmp_path / "bench.json", {"pre_ln": [0.1, 0.3, 0.2],
                                                 "fast": [0.05, 0.05, 0.05],
                                                 "post_ln": [0.4, 0.2, 0.2]})
    assert step_times_tool.main([f"{bench}:torch", "--study", str(study), "--group", "g",
                                 "--name", "base=pre_ln", "--name", "slow=post_ln"]) == 0
    # the baseline's median over rounds, 0.2, times each variant's median ratio to it
    # within a round (fast: 0.5, 1/6, 1/4; slow: 4, 2/3, 1); another group's entry kept,
    # this group's replaced
    assert durable.read_json(str(study / "step_times.json")) == {
        "other": 2.0, "base": 0.2, "fast": 0.05, "slow": 0.2}
    assert "base: 200.0 ms per step" in capsys.readouterr().out
    # a variant the benchmark lacks is named
    with pytest.raises(ValueError, match=r"has no training-step time of 'slow' of group 'g'; "
                                         r"it measured pre_ln, fast, post_ln"):
        step_times_tool.step_times([f"{bench}:torch"], str(study), "g", ["base=pre_ln"])
    with pytest.raises(ValueError, match=r"'base' \(as 'layernorm'\)"):
        step_times_tool.step_times([f"{bench}:torch"], str(study), "g",
                                   ["base=layernorm", "slow=post_ln"])
    with pytest.raises(ValueError, match="--name maps nope, not variants of 'g'"):
        step_times_tool.step_times([f"{bench}:torch"], str(study), "g", ["nope=pre_ln"])
    with pytest.raises(ValueError, match="has no training times for 'jax'"):
        step_times_tool.step_times([f"{bench}:jax"], str(study), "g", ["base=pre_ln"])
    other_batch = bench_file(tmp_path / "b64.json", {"pre_ln": [0.1]}, batch_size=64)
    with pytest.raises(ValueError, match="measured batch 64, the study .* trains batch 32"):
        step_times_tool.step_times([f"{other_batch}:torch"], str(study), "g", [])
    (tmp_path / "bad.json").write_text('{"results": []}')
    with pytest.raises(ValueError, match="bad.json is not a bench_variants.py --json file"):
        step_times_tool.step_times([f"{tmp_path / 'bad.json'}:torch"], str(study), "g", [])
    with pytest.raises(SystemExit):
        step_times_tool.main([f"{bench}:torch", "--study", str(study), "--group", "h"])
    assert "group 'h' is not in" in capsys.readouterr().err


def test_step_times_tool_pools_benchmarks_by_the_ratio_within_each_round(tmp_path):
    """Several benchmark files: the baseline gets its median over every round of all of
    them, each other variant the baseline's times the median of its ratio to the
    baseline within each round, so that a host's load drifting between rounds, or
    between the benchmarks, cancels."""
    rows = overview_rows(tmp_path / "runs")
    study = tmp_path / "study"
    tables.write_rows(rows, str(study), "results.csv")
    durable.write_json(str(study / "study_config.json"), {"batch_size": 32})
    # the host twice as slow in the second file; within a round 'fast' is always 0.5x
    first = bench_file(tmp_path / "a.json", {"pre_ln": [0.1, 0.2, 0.1],
                                             "fast": [0.05, 0.1, 0.05], "slow": [0.3, 0.3, 0.15]})
    second = bench_file(tmp_path / "b.json", {"pre_ln": [0.2, 0.4], "fast": [0.1, 0.2],
                                              "slow": [0.24, 0.48]})
    found = step_times_tool.step_times([f"{first}:torch", f"{second}:torch"], str(study), "g",
                                       ["base=pre_ln"])
    assert found["base"] == pytest.approx(0.2)  # median of 0.1, 0.2, 0.1, 0.2, 0.4
    assert found["fast"] == pytest.approx(0.1)  # 0.2 times the ratio 0.5 of every round
    assert found["slow"] == pytest.approx(0.3)  # ratios 3, 1.5, 1.5, 1.2, 1.2: median 1.5
    # one file by the same rule: 'slow' is 0.1 times 1.5, not its own median 0.3 (the
    # 0.3 s rounds are the rounds where the baseline was slow too)
    alone = step_times_tool.step_times([f"{first}:torch"], str(study), "g", ["base=pre_ln"])
    assert alone["base"] == pytest.approx(0.1) and alone["slow"] == pytest.approx(0.15)
    # rounds are paired within a file: a variant measured in fewer rounds is named
    uneven = bench_file(tmp_path / "c.json", {"pre_ln": [0.1, 0.2], "fast": [0.05],
                                              "slow": [0.2, 0.2]})
    with pytest.raises(ValueError, match=r"c.json measured 'fast' in 1 round\(s\) and the "
                                         r"baseline 'pre_ln' in 2"):
        step_times_tool.step_times([f"{uneven}:torch"], str(study), "g", ["base=pre_ln"])
    assert step_times_tool.main([f"{first}:torch", f"{second}:torch", "--study", str(study),
                                 "--group", "g", "--name", "base=pre_ln"]) == 0
    assert durable.read_json(str(study / "step_times.json")) == pytest.approx(found)


def test_an_exported_study_keeps_its_step_times_and_redraws_the_same_overview(tmp_path):
    """The overview's step-time column comes from step_times.json: export_study copies it
    with results.csv, so the overview drawn from the copy is the study's own."""
    from keras_vitnorm.study import export_study

    rows = overview_rows(tmp_path)
    study = tmp_path / "study"
    study.mkdir()
    (study / "study_config.json").write_text("{}")
    step_times = {"base": 0.1, "fast": 0.05, "slow": 0.2}
    (study / "step_times.json").write_text(json.dumps(step_times))
    tables.write_results(rows, str(study))
    exported = tmp_path / "exported"
    export_study(str(study), str(exported))
    copied = read_step_times(str(exported), step_times)
    assert copied == step_times
    redrawn = overview_table(rows, tables.summarize(rows), copied)
    assert redrawn == (study / "g_overview.md").read_text()
    assert "Step time: from `step_times.json`, measured alone." in redrawn
