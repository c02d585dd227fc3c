"""tools/efficiency_table.py: the efficiency table from benchmark files and a study folder,
and the most efficient choice only where the spread resolves one."""

import csv
import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))
import efficiency_table  # noqa: E402

from keras_vitnorm import durable  # noqa: E402

pytestmark = pytest.mark.one_backend  # reads files; no backend computes


def write_benchmark(path, results, model="s16", batch_size=8, device="cpu"):
    arguments = {"model": model, "batch_size": batch_size, "mixed_precision": "float32"}
    if device is not None:  # files of CPU runs may lack the device
        arguments["device"] = device
    path.write_text(json.dumps({"arguments": arguments, "results": results}))
    return str(path)


MIB = 2 ** 20


@pytest.mark.parametrize("kind, values, verdict, baseline, cells", [
    ("throughput", {"pre_ln": [2.0, 2.0, 2.0, 2.0],
                    "rmsnorm": [1.6, 1.62, 1.58, 1.6],  # 1.25x in every round
                    "dyt": [1.9, 2.1, 1.95, 2.05],  # either side
                    "conv_stem": [2.5, 2.4, 2.6, 2.5]},  # 0.8x in every round
     "**rmsnorm**: 1.25x (1.23 to 1.27), faster in every round, p < 0.001 (Holm over 3); "
     "slower in every round: conv_stem",
     "4.00 img/s", {"rmsnorm": "1.25x (1.23 to 1.27)", "dyt": "1.00x (0.95 to 1.05)",
                    "conv_stem": "0.80x (0.77 to 0.83)"}),
    ("throughput", {"pre_ln": [2.0, 2.0, 2.0], "rmsnorm": [1.9, 2.1, 2.0], "dyt": [2.1, 1.95, 2.0]},
     "no resolved difference", None, None),
    # Faster in both of two rounds, but so spread that the t-test does not resolve it.
    ("throughput", {"pre_ln": [2.0, 2.0], "rmsnorm": [1.9, 1.5], "dyt": [2.1, 1.9]},
     "no resolved difference; faster in every round but not significant after Holm: rmsnorm",
     None, None),
    ("memory", {"pre_ln": [100 * MIB], "rmsnorm": [90 * MIB], "batchnorm": [120 * MIB]},
     "**rmsnorm**: 0.90x, less memory (one process each: spread not measured); more memory: "
     "batchnorm", "100 MiB", {"rmsnorm": "0.90x", "batchnorm": "1.20x"}),
    # Two processes each: overlapping ones are not resolved.
    ("memory", {"pre_ln": [100 * MIB, 104 * MIB], "rmsnorm": [99 * MIB, 103 * MIB]},
     "no resolved difference", None, None),
])
def test_the_most_efficient_is_named_only_where_every_round_and_the_test_resolve_it(
        kind, values, verdict, baseline, cells):
    if kind == "throughput":
        row = efficiency_table.throughput_row("S/16 training", values, batch_size=8)
    else:
        row = efficiency_table.memory_row("S/16 memory", values)
    assert row["verdict"] == verdict
    if baseline is not None:
        assert (row["baseline"], row["cells"]) == (baseline, cells)


def fake_study(tmp_path, curves):
    """A study folder as export_study writes it: results.csv with relative run
    directories; each run 4 evaluations, one every 100 steps, 0.2 s per step."""
    study = tmp_path / "study"
    rows = []
    for variant, runs in curves.items():
        for seed, curve in enumerate(runs):
            relative = os.path.join("g", variant, f"seed_{seed}")
            run_dir = str(study / relative)
            os.makedirs(run_dir)
            durable.write_json(os.path.join(run_dir, "train_config.json"),
                               {"steps_per_epoch": 100})
            durable.write_json(os.path.join(run_dir, "metrics.json"),
                               {"status": "completed", "steps": 400, "train_seconds": 80.0})
            durable.write_text(os.path.join(run_dir, "log.csv"), "epoch,val_accuracy\n" + "".join(
                f"{epoch},{accuracy}\n" for epoch, accuracy in enumerate(curve)))
            rows.append({"group": "g", "variant": variant, "seed": seed, "status": "completed",
                         "val_accuracy": 0.72, "run_dir": relative})
    with open(study / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return str(study)


# The baseline's final accuracy is 0.72 in every run: the target. Its runs reach it at
# steps 300, 300, 300 and 400; "fast" at 100 in every run; "never" never does; "lucky"
# at 100 in one run of four and never in the others.
CURVES = {
    "pre_ln": [[0.5, 0.6, 0.73, 0.73]] * 3 + [[0.5, 0.6, 0.7, 0.73]],
    "fast": [[0.73, 0.73, 0.73, 0.73]] * 4,
    "never": [[0.5, 0.6, 0.7, 0.71]] * 4,
}


def test_time_to_accuracy_rows_from_a_study_folder(tmp_path):
    lucky = {**CURVES, "lucky": [[0.73, 0.6, 0.7, 0.71]] + [[0.5, 0.6, 0.7, 0.71]] * 3}
    target, runs = efficiency_table.study_runs(fake_study(tmp_path, lucky), "g")
    assert target == pytest.approx(0.72)
    steps, seconds = efficiency_table.time_to_accuracy_rows("72% validation accuracy", runs)
    # Kaplan-Meier medians: the baseline's 300 (three of four runs by then)
    assert steps["baseline"] == "300 steps (4 of 4 runs)"
    # the runs that never arrive count, censored at their 400 steps: lucky's one early
    # run does not make it fast (without them its mean would be 100 steps, 0.33x)
    assert steps["cells"] == {"fast": "0.33x (4 of 4 runs)", "never": "never (0 of 4 runs)",
                              "lucky": "n/a (1 of 4 runs)"}
    assert steps["verdict"].startswith("**fast**: 0.33x (4 of 4 runs), fewer steps in every run, p")
    assert "lucky" not in steps["verdict"].split(";")[0]  # the log-rank test reads them too
    # the runs' own time: 0.2 s a step
    assert seconds["baseline"] == "60 s (4 of 4 runs)"
    assert seconds["verdict"].startswith("**fast**: 0.33x (4 of 4 runs), fewer seconds")


def test_time_to_accuracy_in_seconds_counts_each_variants_measured_step_time(tmp_path):
    _, runs = efficiency_table.study_runs(fake_study(tmp_path, CURVES), "g")
    # fast takes 3.5 times as long per step as the baseline: 100 steps cost 350, more
    # than the baseline's median 300 steps at its own step time, so it is slower in seconds.
    step_seconds = {"pre_ln": [0.01, 0.01], "fast": [0.035, 0.035], "never": [0.01, 0.01]}
    _, seconds = efficiency_table.time_to_accuracy_rows(
        "72%", runs, step_seconds, "study ViT, GPU jax")
    assert "steps times the training-step time on study ViT, GPU jax" in seconds["setting"]
    assert seconds["baseline"] == "3 s (4 of 4 runs)"  # 300 steps at 0.01 s
    assert seconds["cells"]["fast"] == "1.17x (4 of 4 runs)"
    # never reaching it in 4 runs against the baseline's 4 arrivals: the log-rank test
    # counts the censored runs, so it is resolved as slower
    assert seconds["verdict"] == "no resolved difference; more seconds in every run: never"
    with pytest.raises(ValueError, match="has no never"):
        efficiency_table.time_to_accuracy_rows("72%", runs, {"pre_ln": [1.0], "fast": [1.0]},
                                               "study ViT")


def test_table_combines_benchmark_files_and_the_study_in_the_studys_order(tmp_path, capsys):
    # Variant names as a benchmark file that names each variant by its change gives them.
    cpu = write_benchmark(tmp_path / "cpu.json", {"jax": {
        "seconds": {"layernorm (baseline)": [2.0, 2.0], "conv stem": [2.5, 2.4]}}}, device=None)
    gpu = write_benchmark(tmp_path / "gpu.json", {
        "torch": {"seconds": {"pre_ln": [0.1, 0.1], "fast": [0.05, 0.05]},
                  "inference_seconds": {"pre_ln": [0.02, 0.02], "fast": [0.02, 0.02]},
                  "peak_bytes": {"pre_ln": [10 * MIB], "fast": [12 * MIB]},
                  "memory": "GPU max_memory_allocated (PyTorch)"},
        "jax": {"error": "no GPU", "peak_bytes": {"fast": [MIB]},
                "memory_errors": {"pre_ln": "out of memory"}}},
        model="b16", batch_size=128, device="gpu")
    output = tmp_path / "table.md"
    assert efficiency_table.main([cpu, gpu, "--study", fake_study(tmp_path, CURVES),
                                  "--group", "g", "--output", str(output)]) == 0
    err = capsys.readouterr().err
    assert "jax's time left out: no GPU" in err
    assert "jax's memory of pre_ln left out: out of memory" in err
    assert "jax's memory left out: no measurement of pre_ln" in err
    lines = output.read_text().splitlines()
    assert lines[0] == "| setting | pre_ln | fast | never | conv_stem | most efficient |"
    rows = {line.split(" | ")[0][2:]: line for line in lines[2:]}
    assert list(rows) == [
        "S/16 training, CPU jax (batch 8, float32, 2 rounds)",
        "B/16 training, GPU torch (batch 128, float32, 2 rounds)",
        "B/16 inference, GPU torch (batch 128, float32, 2 rounds)",
        "B/16 peak training memory, GPU torch (batch 128, float32; GPU max_memory_allocated "
        "(PyTorch))",
        "steps to 72.00% validation accuracy, study g",
        "seconds to 72.00% validation accuracy, study g; each run's own training time"]
    # slower in both rounds, but two rounds do not resolve it
    assert rows["S/16 training, CPU jax (batch 8, float32, 2 rounds)"].endswith(
        "| 4.00 img/s | n/a | n/a | 0.82x (0.80 to 0.83) | no resolved difference; "
        "slower in every round but not significant after Holm: conv_stem |")
    assert "| 1,280 img/s | 2.00x (2.00 to 2.00) | n/a | n/a | **fast**" in rows[
        "B/16 training, GPU torch (batch 128, float32, 2 rounds)"]
    assert "| 10 MiB | 1.20x | n/a | n/a | no resolved difference (one process each" in rows[
        "B/16 peak training memory, GPU torch (batch 128, float32; GPU max_memory_allocated "
        "(PyTorch))"]


@pytest.mark.parametrize("argv, message", [
    ([], "give benchmark files, --study or both"),
    (["--study", "STUDY", "--group", "h"], "group 'h' is not in .*; it has g"),
    (["--study", "STUDY", "--group", "g", "--step-time", "study.json"], "give FILE:BACKEND"),
    (["BENCH", "--step-time", "BENCH:jax"], "--step-time needs --study"),
])
def test_bad_arguments_exit_with_a_message(argv, message, tmp_path, capsys):
    study = fake_study(tmp_path, CURVES)
    bench = write_benchmark(tmp_path / "b.json", {"jax": {"seconds": {"pre_ln": [1.0]}}})
    argv = [a.replace("STUDY", study).replace("BENCH", bench) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        efficiency_table.main(argv)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
