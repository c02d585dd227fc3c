"""Recomputes the numbers of the normalization guide's answer from the committed result
files, and checks that the guide states each of them and no other.

    python tools/check_guide.py            # exit 0: every number checked is in the text

Each check computes one number (or a few, as they are written in the guide) from the
raw files of a study folder under docs/study-results/ (results.csv, lr_sweep.csv, each
run's own files, the benchmark JSON files of efficiency/) with the study's statistics
and the functions that write its tables, never from a committed table, and looks for
the formatted text in the guide's findings in detail, with line breaks and repeated
spaces ignored. A number that moved in the results, or a sentence rewritten without
its number, fails the check, which names both. The one-minute answer and the short
answer after it are held tighter: every decimal figure they state must lie inside a
computed text that they state, or inside one of the phrases of `NOT_RESULTS` (the
paper's figures, the model's size). The project README's summary table ("Which
normalization?") is held to the same rule.
"""

import csv
import json
import math
import os
import re
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "study-results")
GUIDE = os.path.join(ROOT, "docs", "normalization-guide.md")
README = os.path.join(ROOT, "README.md")
sys.path.insert(0, ROOT)

from efficiency_table import benchmark_rows  # noqa: E402
from efficiency_table import study_runs  # noqa: E402
from efficiency_table import time_to_accuracy_rows  # noqa: E402
from keras_vitnorm.study.factors import depth_table  # noqa: E402
from keras_vitnorm.study.factors import dpn_factor_table  # noqa: E402
from keras_vitnorm.study.one_run import run_analysis  # noqa: E402
from keras_vitnorm.study.overview import overview_table  # noqa: E402
from keras_vitnorm.study.overview import read_step_times  # noqa: E402
from keras_vitnorm.study.overview import validation_loss_trend  # noqa: E402
from keras_vitnorm.study.stats import difference_interval  # noqa: E402
from keras_vitnorm.study.stats import holm_adjusted  # noqa: E402
from keras_vitnorm.study.stats import p_value_text  # noqa: E402
from keras_vitnorm.study.stats import welch_p_value  # noqa: E402
from keras_vitnorm.study.tables import gradient_norm_table  # noqa: E402
from keras_vitnorm.study.tables import summarize  # noqa: E402


def rows(folder, name="results.csv"):
    """The rows of a study folder's `name`, each `run_dir` the run's committed folder."""
    with open(os.path.join(RESULTS, folder, name), newline="") as f:
        return [dict(r, run_dir=os.path.join(RESULTS, folder, r["run_dir"]))
                for r in csv.DictReader(f)]


def completed(folder, group, variant):
    """The rows of the completed runs of a variant."""
    return [r for r in rows(folder)
            if r["group"] == group and r["variant"] == variant and r["status"] == "completed"]


def accuracies(folder, group, variant, column="test_accuracy"):
    """`{seed: value}` of the completed runs of a variant."""
    return {int(r["seed"]): float(r[column]) for r in completed(folder, group, variant)}


def rate_text(rate):
    """A learning rate as the guide writes it: 5e-4, 2.5e-4."""
    return np.format_float_scientific(rate, trim="-", exp_digits=1)


def points(value, signed=True, digits=1):
    return f"{100 * value:+.{digits}f}" if signed else f"{100 * value:.{digits}f}"


def difference(folder, group, variant, baseline, digits=1, signed=True):
    """`+d ± ci` in points, the Welch interval of `variant` minus `baseline`."""
    treated, control = accuracies(folder, group, variant), accuracies(folder, group, baseline)
    value, ci = difference_interval(list(treated.values()), list(control.values()))
    return f"{points(value, signed, digits)} ± {points(ci, False, digits)}"


def seed_differences(folder, group, variant, baseline):
    """`(+a, +b, +c`: each seed's difference in points, as the guide opens its brackets."""
    treated, control = accuracies(folder, group, variant), accuracies(folder, group, baseline)
    return "(" + ", ".join(points(treated[s] - control[s]) for s in sorted(treated))


def p_values(folder, group, variant):
    """Welch and Holm-adjusted p of a variant against its group's baseline (the first), over
    the comparisons of `<group>_differences.md`, as `tables.summarize` gives them."""
    summary = summarize([r for r in rows(folder) if r["group"] == group])[1:]
    p = [entry["p_value"] for entry in summary]
    index = [entry["variant"] for entry in summary].index(variant)
    return p[index], holm_adjusted(p)[index]


def markdown_cells(table, row_start):
    """The cells of the one row of a markdown table's text that starts with `row_start`."""
    lines = [line for line in table.splitlines() if line.startswith(row_start)]
    if len(lines) != 1:
        raise ValueError(f"{len(lines)} rows of the table start with {row_start!r}")
    return [cell.strip() for cell in lines[0].strip().strip("|").split("|")]


def step_time_ratio(name, backend, variant):
    """A variant's training-step time over the baseline's, the median over rounds of the
    ratio within each round, from a step-time benchmark's raw file in efficiency/."""
    with open(os.path.join(RESULTS, "efficiency", name)) as f:
        seconds = json.load(f)["results"][backend]["seconds"]
    baseline = next(times for key, times in seconds.items() if key.endswith("(baseline)"))
    return float(np.median([a / b for a, b in zip(seconds[variant], baseline)]))


def depth_mean(variant):
    return points(np.mean(list(accuracies("cifar10-depth", "depth_stability", variant).values())),
                  signed=False)


#: The Imagenette study: its folder and group, and how the guide names its variants.
IMAGENETTE = ("imagenette-cpu", "core")
NAMES = {"pre_ln": "pre-LN", "dual_patchnorm": "DPN", "post_ln": "post-LN",
         "peri_ln": "Peri-LN", "deepnorm": "DeepNorm", "conv_stem": "the conv stem",
         "rmsnorm": "RMSNorm", "dyt": "DyT", "batchnorm": "BatchNorm"}


def imagenette_fewshot():
    """`{shots: {variant: [each run's mean over its draws]}}` from the Imagenette study's
    fewshot.csv (the per-draw accuracies), baseline first, as core_fewshot.md is written."""
    draws = {}
    with open(os.path.join(RESULTS, IMAGENETTE[0], "fewshot.csv"), newline="") as f:
        for r in csv.DictReader(f):
            if r["group"] == IMAGENETTE[1]:
                draws.setdefault(int(r["shots"]), {}).setdefault(r["variant"], {}).setdefault(
                    r["run_dir"], []).append(float(r["accuracy"]))
    return {shots: {v: [float(np.mean(d)) for d in by_variant[v].values()]
                    for v in NAMES if v in by_variant}
            for shots, by_variant in sorted(draws.items())}


def p_text(p):
    """A Holm-adjusted p as the guide writes it: the tables' text (`p_value_text`), so
    "p 0.030" or "p < 0.001"."""
    return "p " + p_value_text(p).replace("<", "< ")


def imagenette_checks():
    """The Imagenette study's figures, each as the guide writes it: one row per variant
    of the guide's table (the columns of core_overview.md and core_fewshot.md), then the
    ranges its findings state."""
    found = []
    group = [r for r in rows(IMAGENETTE[0]) if r["group"] == IMAGENETTE[1]]
    assert list(dict.fromkeys(r["variant"] for r in group)) == list(NAMES), \
        f"imagenette-cpu: the variants are no longer {list(NAMES)}"
    summary = summarize(group)
    step_times = read_step_times(os.path.join(RESULTS, IMAGENETTE[0]), NAMES)
    overview = overview_table(group, summary, step_times)  # core_overview.md
    holm = dict(zip(NAMES, [None] + holm_adjusted([e["p_value"] for e in summary[1:]])))
    fewshot = imagenette_fewshot()
    fewshot_holm = {shots: dict(zip(NAMES, [None] + holm_adjusted(
        [welch_p_value(values[v], values["pre_ln"]) for v in NAMES if v != "pre_ln"])))
        for shots, values in fewshot.items()}
    for variant, name in NAMES.items():
        runs = sorted(completed(*IMAGENETTE, variant), key=lambda r: int(r["seed"]))
        rates = {rate_text(float(r["learning_rate"])) for r in runs}
        assert len(rates) == 1, f"imagenette-cpu: {variant} ran at {rates}"
        test = [float(r["test_accuracy"]) for r in runs]
        accuracy = (points(np.mean(test), signed=False) + " ("
                    + ", ".join(points(a, signed=False) for a in test) + ")")
        reach = markdown_cells(overview, f"| {variant} |")[8]
        ratio = step_times[variant] / step_times["pre_ln"]
        if variant == "pre_ln":
            against, time = "—", f"{1000 * step_times[variant]:.0f} ms"
            shots = [f"{points(np.mean(v['pre_ln']), signed=False)}%" for v in fewshot.values()]
        else:
            against = f"{difference(*IMAGENETTE, variant, 'pre_ln')}, {p_text(holm[variant])}"
            time = f"{ratio:.2f}x pre-LN's"
            shots = []
            for count, values in fewshot.items():
                gain, ci = difference_interval(values[variant], values["pre_ln"])
                shots.append(f"{points(gain)} ± {points(ci, False)}, "
                             + p_text(fewshot_holm[count][variant]))
            found.append((f"Imagenette {name} against pre-LN, with its Holm-adjusted p", against))
            found.append((f"Imagenette {name}'s step time over pre-LN's", time))
        found.append((f"Imagenette {name}: the guide's table row",
                      f"| {name} | {rates.pop()} | {accuracy} | {against} | {reach} | {time} | "
                      + " | ".join(shots) + " |"))
    target = markdown_cells(overview, "| variant |")[8].split("'s ")[1].split(":")[0]
    found.append(("Imagenette: pre-LN's final validation accuracy, the time-to-accuracy target",
                  f"pre-LN's final validation accuracy, {target}"))
    base = np.mean(list(accuracies(*IMAGENETTE, "pre_ln").values()))
    found.append(("Imagenette pre-LN's test accuracy", f"pre-LN ends at {points(base, False)}%"))
    gaps = [float(markdown_cells(overview, f"| {v} |")[6].split(" ")[0]) for v in NAMES]
    found.append(("Imagenette train minus validation accuracy over the variants",
                  f"{min(gaps):+.1f} to {max(gaps):+.1f} points"))
    trends = [validation_loss_trend(r["run_dir"]) for r in group if r["status"] == "completed"]
    found.append(("Imagenette: where validation loss is lowest, over every run",
                  f"lowest at pass {min(t[0] for t in trends)} to {max(t[0] for t in trends)} "
                  f"of {trends[0][1]}, and the last at most "
                  f"{100 * max(t[2] for t in trends):.1f}% above it"))
    # each patch's mean and standard deviation swapped for another image's (analysis.json)
    def swap_cost(variant):
        tests = [run_analysis(r["run_dir"])["patch_statistics"]["test"]
                 for r in completed(*IMAGENETTE, variant)]
        return np.mean([t["clean"] - t["statistics_swapped"] for t in tests])

    found.append(("Imagenette: the test accuracy that swapping patch statistics costs",
                  f"pre-LN's test accuracy falls {points(swap_cost('pre_ln'), False)} points "
                  f"and DPN's {points(swap_cost('dual_patchnorm'), False)}"))
    # DPN's interval against the paper's own gain for the same model (Table 1, Ti/16)
    gain, ci = difference_interval(list(accuracies(*IMAGENETTE, "dual_patchnorm").values()),
                                   list(accuracies(*IMAGENETTE, "pre_ln").values()))
    paper = 0.014
    relation = ("ends below" if gain + ci < paper else
                "starts above" if gain - ci > paper else "includes")
    found.append(("Imagenette DPN's interval against the paper's gain for Ti/16",
                  f"its interval {relation} the paper's +1.4 for Ti/16"))
    for count, values in fewshot.items():
        differences = [np.mean(values[v]) - np.mean(values["pre_ln"]) for v in NAMES
                       if v != "pre_ln"]
        significant = [NAMES[v] for v, p in fewshot_holm[count].items() if p and p < 0.05]
        found.append((f"Imagenette {count}-shot transfer: the differences from pre-LN",
                      f"{count}-shot: {points(min(differences))} to {points(max(differences))} "
                      "points, " + ("significant for " + ", ".join(significant) if significant
                                    else "none significant")))
    return found


def checks():
    """`(what, text the guide must state)` pairs, computed from the result files."""
    found = imagenette_checks()
    c = ("cifar10-converged", "converged")
    for variant, label, signed in (("deepnorm", "DeepNorm", True), ("post_ln", "post-LN", False),
                                   ("conv_stem", "conv stem", True),
                                   ("batchnorm", "BatchNorm", True),
                                   ("dual_patchnorm", "DPN", False), ("rmsnorm", "RMSNorm", True)):
        found.append((f"converged {label} against pre-LN",
                      difference(*c, variant, "pre_ln", signed=signed)))
        found.append((f"converged {label} against pre-LN by seed",
                      seed_differences(*c, variant, "pre_ln")))
    found.append(("converged post-LN against pre-LN, signed",
                  difference(*c, "post_ln", "pre_ln")))
    significant = [p_values(*c, v)[1] for v in ("deepnorm", "conv_stem", "post_ln", "batchnorm")]
    found.append(("range of their Holm-adjusted p",
                  f"Holm-adjusted p {min(significant):.3f} to {max(significant):.3f}"))
    dpn_p, dpn_holm = p_values(*c, "dual_patchnorm")
    found.append(("converged DPN's p, alone and after Holm",
                  f"p-value is {dpn_p:.3f} alone and {dpn_holm:.3f} after Holm's correction"))
    dyt_p, dyt_holm = p_values(*c, "dyt")
    found.append(("converged DyT below pre-LN", difference(*c, "pre_ln", "dyt", signed=False)))
    found.append(("converged DyT by seed", seed_differences(*c, "dyt", "pre_ln")))
    found.append(("converged DyT's p", f"p {dyt_p:.3f} alone, {dyt_holm:.3f} after correction"))
    # depth: test accuracy at 6 / 12 / 24 blocks with warm-up
    found.append(("DeepNorm by depth", " / ".join(
        depth_mean(f"deepnorm-depth_{d}") + "%" for d in (6, 12, 24))))
    found.append(("pre-LN by depth", " / ".join(
        depth_mean(f"pre_ln-depth_{d}") for d in (6, 12, 24))))
    # the residual stream's RMS after the last block, the mean over seeds (analysis.json)
    rms = np.mean([run_analysis(r["run_dir"])["residual_stream"]["rms"][-1]
                   for r in completed("cifar10-depth", "depth_stability", "pre_ln-depth_24")])
    found.append(("pre-LN's residual-stream RMS after 24 blocks", f"(RMS {rms:.0f} after 24"))
    stalled = [float(r["test_accuracy"]) for r in rows("cifar10-depth")
               if r["group"] == "depth_stability" and r["variant"].startswith("post_ln-depth_")
               and not r["variant"].startswith("post_ln-depth_6")]
    at_chance = sum(a < 0.11 for a in stalled)
    above = sorted(100 * a for a in stalled if a >= 0.11)
    found.append(("post-LN from 12 blocks: at chance and above",
                  f"in all {len(stalled)} runs ({at_chance} at chance, {len(above)} at "
                  f"{above[0]:.1f} to {above[-1]:.1f}%)"))
    # as depth_stability_summary.md, from post-LN's runs at 24 blocks (grad_norms.csv)
    deepest = depth_table([r for r in rows("cifar10-depth")
                           if r["variant"].startswith("post_ln-depth_24")], "depth_stability")
    for warmup, key in (("yes", "with"), ("no", "without")):
        cell = markdown_cells(deepest, f"| post_ln | 24 | {warmup} |")[8].split(" ")[0]
        exponent = math.floor(math.log10(float(cell)))
        rounded = f"{round(float(cell) / 10**exponent):d}e{exponent:d}".replace("e-0", "e-")
        found.append((f"post-LN's first-to-last gradient at depth 24 {key} warm-up", rounded))
    behind = [np.mean(list(accuracies("cifar10-depth", "depth_stability", "pre_ln-depth_6" + s)
                           .values()))
              - np.mean(list(accuracies("cifar10-depth", "depth_stability", "post_ln-depth_6" + s)
                             .values())) for s in ("", "-no_warmup")]
    found.append(("post-LN behind pre-LN at 6 blocks",
                  f"{100 * behind[0]:.0f} points behind pre-LN with warm-up and "
                  f"{100 * behind[1]:.0f} without"))
    # deep post-LN on the CPU: what trains at each rate of the sweep (seed 0)
    summary = depth_table(rows("cifar10-deep-cpu", "lr_sweep.csv"), "deep")  # its _summary.md
    sweep = ("0.000125", "0.00025", "0.0005", "0.001")
    post = {rate: markdown_cells(summary, f"| post_ln | 12 | yes | {rate} |") for rate in sweep}
    trained = [post[r] for r in ("0.000125", "0.00025")]
    stalled = [post[r] for r in ("0.0005", "0.001")]
    assert all(c[5] == "1" for c in trained) and all(c[5] == "0" for c in stalled), \
        "deep_cpu: post-LN no longer trains at the two lowest rates and stalls at the others"
    found.append(("deep post-LN's test accuracy at the two lowest rates",
                  f"({trained[0][8]}% and {trained[1][8]}% test accuracy)"))
    found.append(("deep post-LN's first-to-last gradient at those rates",
                  f"{float(trained[0][9]):.1f}x and {float(trained[1][9]):.1f}x"))
    stalled_test = {float(r["learning_rate"]): 100 * float(r["test_accuracy"])
                    for r in rows("cifar10-deep-cpu", "lr_sweep.csv")
                    if r["variant"] == "post_ln" and float(r["learning_rate"]) >= 5e-4}
    found.append(("deep post-LN's test accuracy where it stalls",
                  f"({stalled_test[5e-4]:.2f}% and {stalled_test[1e-3]:.2f}%)"))
    # each at its own rate, 3 seeds: the Welch interval and the seeds, and significance
    # after Holm's correction over the table's 2 comparisons
    for variant, label in (("post_ln", "post-LN"), ("deepnorm", "DeepNorm")):
        p = p_values("cifar10-deep-cpu", "deep", variant)[1]
        verdict = "significant" if p < 0.05 else "not significant"
        gain = difference("cifar10-deep-cpu", "deep", variant, "pre_ln")
        found.append((f"deep {variant} against pre-LN at each one's rate, the difference", gain))
        found.append((f"deep {variant} against pre-LN at each one's rate", f"{label} against "
                      f"pre-LN: {gain} points "
                      f"{seed_differences('cifar10-deep-cpu', 'deep', variant, 'pre_ln')}; "
                      f"{verdict})"))
    deepnorm = [markdown_cells(summary, f"| deepnorm | 12 | yes | {rate} |") for rate in sweep]
    assert all(c[5] == "1" for c in deepnorm), "deep_cpu: DeepNorm no longer trains at every rate"
    test = sorted(float(c[8]) for c in deepnorm)
    found.append(("deep DeepNorm's test accuracy over the sweep",
                  f"every rate of the sweep ({test[0]:.2f}% to {test[-1]:.2f}%, seed 0)"))
    # DPN in the 3,000-step factor runs
    f = ("cifar10-factors", "dpn_factors")
    levels = ("p4-n2500", "p4-n10000", "p4-n40000", "p8-n10000")
    gaps = [np.mean(list(accuracies(*f, f"patch-{lv}").values()))
            - np.mean(list(accuracies(*f, f"dpn-{lv}").values())) for lv in levels]
    found.append(("DPN's 3,000-step deficit range",
                  f"{100 * min(gaps):.1f} to {100 * max(gaps):.1f} points below"))
    differences = dpn_factor_table(rows("cifar10-factors"))  # dpn_factors_differences.md
    found.append(("DPN at 40,000 images, Holm-adjusted p",
                  "p " + markdown_cells(differences, "| 4 | 40,000 | dpn |")[8]))
    schedule = [difference("cifar10-factors", "dpn_schedule", f"dpn-s{n}", f"patch-s{n}",
                           digits=2) for n in (3000, 12000)]
    found.append(("DPN by schedule length", f"from {schedule[0]} points to {schedule[1]}"))
    # gradient norms
    for folder, group, stems, label in (
            ("cifar10-factors", "dpn_factors", ("patch-p4-n10000", "dpn-p4-n10000"), "3,000 steps"),
            ("cifar10-factors", "dpn_schedule", ("patch-s12000", "dpn-s12000"), "12,000 steps"),
            ("cifar10-converged", "converged", ("pre_ln", "dual_patchnorm"), "converged")):
        table = gradient_norm_table(rows(folder))  # <folder>/gradient_norms.md
        means = [[cell.split(" ± ")[0] for cell in markdown_cells(table, f"| {group} | {stem} |")]
                 for stem in stems]
        found.append((f"patch embedding's gradient norm, {label}",
                      f"{means[0][6]} to {means[1][6]}"))
        found.append((f"its ratio to the largest block layer, {label}",
                      f"{means[0][3]}x and {means[1][3]}x"))
    # Imagenette in 16-px patches, the seed-0 sweep: the rates at which a variant learns
    # (validation and test accuracy at 20% or more, chance being 10%) and those where not
    def listed(rates):
        return ", ".join(rates[:-1]) + " and " + rates[-1] if len(rates) > 1 else rates[0]

    def where_it_learns(variant, name):
        sweep = sorted((r for r in rows("imagenette-cpu", "lr_sweep.csv")
                        if r["variant"] == variant and r["seed"] == "0"),
                       key=lambda r: float(r["learning_rate"]))
        assert all(r["status"] == "completed" for r in sweep), f"imagenette-cpu: {variant}"
        learns, stalls = [], []
        for r in sweep:
            learned = min(float(r["val_accuracy"]), float(r["test_accuracy"])) >= 0.2
            (learns if learned else stalls).append(rate_text(float(r["learning_rate"])))
        if not learns:
            return f"{name} learns at none of the rates {listed(stalls)}"
        if not stalls:
            return f"{name} learns at every rate of its sweep, {listed(learns)}"
        return f"{name} learns at {listed(learns)} and stalls at {listed(stalls)}"

    for variant, name in (("post_ln", "post-LN"), ("deepnorm", "DeepNorm")):
        found.append((f"Imagenette {name}'s sweep: where it learns and where it stalls",
                      where_it_learns(variant, name)))
    # stems in the early studies
    for folder, label in (("digits", "*digits*"), ("cifar10", "*early*")):
        stems = summarize([r for r in rows(folder) if r["group"] == "stems"])
        gain = next(entry["gain"] for entry in stems if entry["variant"] == "conv")
        found.append((f"{label} conv stem", f"{label} {points(gain)}"))
    # efficiency: the rows of efficiency_table_cpu.md, from its benchmark files (the CPU
    # training throughput) and the converged study's runs (the steps to accuracy)
    training = {row["setting"].split(" (")[0]: row["cells"] for model in ("s16", "b16")
                for row in benchmark_rows(os.path.join(RESULTS, "efficiency",
                                                       f"variants_{model}_cpu.json"))}
    found.append(("DyT's training throughput on JAX at S/16, withdrawn as it does not replicate",
                  "DyT on JAX at S/16 was "
                  + training["S/16 training, CPU jax"]["dyt"].split(" ")[0]
                  + " pre-LN's throughput in the efficiency table's benchmark, and its "
                  + f"training step took {step_time_ratio('variants_s16_float32.json', 'jax', 'dyt'):.3f}x"
                  + " pre-LN's"))
    conv = [float(training[f"{model} training, CPU {backend}"]["conv_stem"].split("x")[0])
            for model in ("S/16", "B/16") for backend in ("jax", "tensorflow", "torch")]
    found.append(("the conv stem's training throughput, CPU",
                  f"setting ({min(conv):.2f}x to {max(conv):.2f}x)"))
    found.append(("the conv stem's training throughput, CPU, as the answer states it",
                  f"{min(conv):.2f}x to {max(conv):.2f}x"))
    _, runs = study_runs(os.path.join(RESULTS, "cifar10-converged"), "converged")
    steps_row = time_to_accuracy_rows("pre-LN's final validation accuracy", runs)[0]
    steps = {v: cell.split(" ")[0] for v, cell in steps_row["cells"].items()}
    found.append(("steps to pre-LN's final validation accuracy",
                  f"DeepNorm and the convolutional stem reach pre-LN's final validation accuracy "
                  f"in {steps['deepnorm']} its steps, post-LN in {steps['post_ln']}, BatchNorm "
                  f"in {steps['batchnorm']} and DPN in {steps['dual_patchnorm']}"))
    if steps["deepnorm"] != steps["conv_stem"]:
        found.append(("the conv stem's steps, stated with DeepNorm's", steps["conv_stem"]
                      + " (the guide states one figure for both)"))
    return found


#: The phrases, as the answer states them, whose decimal figures are no result of this
#: project's studies: each figure is exempt only inside its phrase.
NOT_RESULTS = {
    "the paper's ImageNet-1k gains (+0.2 to +1.9)": "the paper's DPN gains (Table 1)",
    "91.6% after 20 epochs": "fastai's Imagenette leaderboard, 128 px",
    "the paper's +1.4 for Ti/16": "the paper's DPN gain for Ti/16 (Table 1)",
    "1.2M parameters": "the CIFAR-10 study's model size",
    "a 5.5M-parameter ViT": "the Imagenette study's model size (5,498,122 parameters)",
    "significant below 0.05": "the significance level",
}
TOP, DETAIL, END = ("## The answer in one minute", "## The findings in detail",
                    "## What the paper reports")
#: A decimal figure: 0.38x, +7.4, -6.6, 0.010, 12.5%, 1.2M (not 3,000 or 1e-3).
DECIMAL = re.compile(r"[+-]?\d+\.\d+[xM%]?")


def _section(path, start, end):
    """The text of `path` from `start` to the first `end` after it, with line breaks and
    repeated spaces as one space."""
    with open(path) as f:
        text = f.read()
    for heading in (start, end):
        if heading not in text:
            raise SystemExit(f"{path} has no section {heading.strip()!r}")
    return re.sub(r"\s+", " ", text.split(start, 1)[1].split(end, 1)[0])


def sections():
    """`(answer, detail)`: the guide's one-minute and short answers, then its findings in
    detail."""
    return _section(GUIDE, TOP, DETAIL), _section(GUIDE, DETAIL, END)


def readme_summary():
    """The project README's "Which normalization?" section, up to its next heading."""
    return _section(README, "## Which normalization?", "\n## ")


def unchecked_figures(answer, computed):
    """The decimal figures of `answer` found inside no `computed` text it states (nor a
    phrase of `NOT_RESULTS`, which `main` passes with them), in order, each once."""
    spans = []
    for expected in computed:
        start = answer.find(expected)
        while start != -1:
            spans.append((start, start + len(expected)))
            start = answer.find(expected, start + 1)
    loose = [m.group() for m in DECIMAL.finditer(answer)
             if not any(a <= m.start() and m.end() <= b for a, b in spans)]
    return list(dict.fromkeys(loose))


def main():
    answer, detail = sections()
    found = checks()
    missing = [(what, expected) for what, expected in found if expected not in detail]
    for what, expected in missing:
        print(f"not in the findings in detail: {what}: {expected!r}")
    computed = [expected for _, expected in found] + list(NOT_RESULTS)
    loose = unchecked_figures(answer, computed)
    for figure in loose:
        print(f"in the answer but recomputed by no check: {figure!r}")
    readme = unchecked_figures(readme_summary(), computed)
    for figure in readme:
        print(f"in README.md's summary but recomputed by no check: {figure!r}")
    print(f"{len(found) - len(missing)} of {len(found)} numbers found as computed; "
          f"{len(loose)} figure(s) of the answer and {len(readme)} of README.md's summary "
          "unchecked")
    return 1 if missing or loose or readme else 0


if __name__ == "__main__":
    sys.exit(main())
