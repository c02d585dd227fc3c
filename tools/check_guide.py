"""Recomputes the numbers of the normalization guide's answer from the committed result
files, and checks that the guide states each of them and no other.

    python tools/check_guide.py            # exit 0: every number checked is in the text

Each check computes one number (or a few, as they are written in the guide) from a
study folder under docs/study-results/ with the study's own statistics
(`keras_vitnorm.study.stats`) and looks for the formatted text in the guide's findings
in detail, with line breaks and repeated spaces ignored. A number that moved in the
results, or a sentence rewritten without its number, fails the check, which names
both. The one-minute answer and the short answer above it are held tighter: every
decimal figure they state must lie inside a computed text that they state, or be one
of `NOT_RESULTS` (the paper's figures, the model's size).
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
sys.path.insert(0, ROOT)

from keras_vitnorm.study.stats import difference_interval  # noqa: E402
from keras_vitnorm.study.stats import holm_adjusted  # noqa: E402
from keras_vitnorm.study.stats import welch_p_value  # noqa: E402


def rows(folder, name="results.csv"):
    with open(os.path.join(RESULTS, folder, name), newline="") as f:
        return list(csv.DictReader(f))


def accuracies(folder, group, variant, column="test_accuracy"):
    """`{seed: value}` of the completed runs of a variant."""
    return {int(r["seed"]): float(r[column]) for r in rows(folder)
            if r["group"] == group and r["variant"] == variant and r["status"] == "completed"}


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


def converged_p_values(variant):
    """Welch and Holm-adjusted p of a converged variant against pre-LN, over the
    comparisons of `converged_differences.md`."""
    names = list(dict.fromkeys(r["variant"] for r in rows("cifar10-converged")))[1:]
    control = list(accuracies("cifar10-converged", "converged", "pre_ln").values())
    p = [welch_p_value(list(accuracies("cifar10-converged", "converged", n).values()), control)
         for n in names]
    adjusted = holm_adjusted(p)
    return p[names.index(variant)], adjusted[names.index(variant)]


def table_row(path, row_start):
    """The one row of a committed markdown table whose text starts with `row_start`."""
    with open(os.path.join(RESULTS, path)) as f:
        lines = [line for line in f if line.startswith(row_start)]
    if len(lines) != 1:
        raise ValueError(f"{path}: {len(lines)} rows start with {row_start!r}")
    return lines[0]


def row_cells(row):
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def table_cell(path, row_start, column):
    """A cell of a committed markdown table: the row whose text starts with `row_start`."""
    return row_cells(table_row(path, row_start))[column]


def mean_of_table(path, row_start, column):
    return float(table_cell(path, row_start, column).split(" ± ")[0])


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


def checks():
    """`(what, text the guide must state)` pairs, computed from the result files."""
    found = []
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
    significant = [converged_p_values(v)[1] for v in ("deepnorm", "conv_stem", "post_ln",
                                                       "batchnorm")]
    found.append(("range of their Holm-adjusted p",
                  f"Holm-adjusted p {min(significant):.3f} to {max(significant):.3f}"))
    dpn_p, dpn_holm = converged_p_values("dual_patchnorm")
    found.append(("converged DPN's p, alone and after Holm",
                  f"p-value is {dpn_p:.3f} alone and {dpn_holm:.3f} after Holm's correction"))
    dyt_p, dyt_holm = converged_p_values("dyt")
    found.append(("converged DyT below pre-LN", difference(*c, "pre_ln", "dyt", signed=False)))
    found.append(("converged DyT by seed", seed_differences(*c, "dyt", "pre_ln")))
    found.append(("converged DyT's p", f"p {dyt_p:.3f} alone, {dyt_holm:.3f} after correction"))
    # depth: test accuracy at 6 / 12 / 24 blocks with warm-up
    found.append(("DeepNorm by depth", " / ".join(
        depth_mean(f"deepnorm-depth_{d}") + "%" for d in (6, 12, 24))))
    found.append(("pre-LN by depth", " / ".join(
        depth_mean(f"pre_ln-depth_{d}") for d in (6, 12, 24))))
    rms = mean_of_table("cifar10-depth/figures/depth_stability_residual_stream.md",
                        "| pre_ln-depth_24 |", 4)
    found.append(("pre-LN's residual-stream RMS after 24 blocks", f"(RMS {rms:.0f} after 24"))
    stalled = [float(r["test_accuracy"]) for r in rows("cifar10-depth")
               if r["group"] == "depth_stability" and r["variant"].startswith("post_ln-depth_")
               and not r["variant"].startswith("post_ln-depth_6")]
    at_chance = sum(a < 0.11 for a in stalled)
    above = sorted(100 * a for a in stalled if a >= 0.11)
    found.append(("post-LN from 12 blocks: at chance and above",
                  f"in all {len(stalled)} runs ({at_chance} at chance, {len(above)} at "
                  f"{above[0]:.1f} to {above[-1]:.1f}%)"))
    for warmup, key in (("yes", "with"), ("no", "without")):
        cell = table_cell("cifar10-depth/depth_stability_summary.md",
                          f"| post_ln | 24 | {warmup} |", 8).split(" ")[0]
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
    summary = "cifar10-deep-cpu/deep_lr_sweep_summary.md"
    sweep = ("0.000125", "0.00025", "0.0005", "0.001")
    post = {rate: table_row(summary, f"| post_ln | 12 | yes | {rate} |") for rate in sweep}
    trained = [row_cells(post[r]) for r in ("0.000125", "0.00025")]
    stalled = [row_cells(post[r]) for r in ("0.0005", "0.001")]
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
        p = float(table_cell("cifar10-deep-cpu/deep_differences.md", f"| {variant} |", 6)
                  .rstrip(" *").lstrip("<"))
        verdict = "significant" if p < 0.05 else "not significant"
        found.append((f"deep {variant} against pre-LN at each one's rate, the difference",
                      difference('cifar10-deep-cpu', 'deep', variant, 'pre_ln')))
        found.append((f"deep {variant} against pre-LN at each one's rate", f"{label} against "
                      f"pre-LN: {difference('cifar10-deep-cpu', 'deep', variant, 'pre_ln')} "
                      f"points {seed_differences('cifar10-deep-cpu', 'deep', variant, 'pre_ln')}; "
                      f"{verdict})"))
    deepnorm = [row_cells(table_row(summary, f"| deepnorm | 12 | yes | {rate} |"))
                for rate in sweep]
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
    found.append(("DPN at 40,000 images, Holm-adjusted p", "p " + table_cell(
        "cifar10-factors/dpn_factors_differences.md", "| 4 | 40,000 | dpn |", 8)))
    schedule = [difference("cifar10-factors", "dpn_schedule", f"dpn-s{n}", f"patch-s{n}",
                           digits=2) for n in (3000, 12000)]
    found.append(("DPN by schedule length", f"from {schedule[0]} points to {schedule[1]}"))
    # gradient norms
    for folder, group, stems, label in (
            ("cifar10-factors", "dpn_factors", ("patch-p4-n10000", "dpn-p4-n10000"), "3,000 steps"),
            ("cifar10-factors", "dpn_schedule", ("patch-s12000", "dpn-s12000"), "12,000 steps"),
            ("cifar10-converged", "converged", ("pre_ln", "dual_patchnorm"), "converged")):
        cells = [table_cell(f"{folder}/gradient_norms.md", f"| {group} | {stem} |", 6)
                 .split(" ± ")[0] for stem in stems]
        ratios = [table_cell(f"{folder}/gradient_norms.md", f"| {group} | {stem} |", 3)
                  .split(" ± ")[0] for stem in stems]
        found.append((f"patch embedding's gradient norm, {label}", f"{cells[0]} to {cells[1]}"))
        found.append((f"its ratio to the largest block layer, {label}",
                      f"{ratios[0]}x and {ratios[1]}x"))
    early = [table_cell("cifar10/gradient_norms.md", f"| {stem} |", 2).split(" ± ")[0]
             for stem in ("patch", "dual_patchnorm")]
    found.append(("early gradient-norm ratios", f"{early[0]}x without DPN and {early[1]}x"))
    digits = [table_cell("digits/gradient_norms.md", f"| {stem} |", 2).split(" ± ")[0]
              for stem in ("patch", "dual_patchnorm")]
    found.append(("digits gradient-norm ratios", f"ratio is {digits[0]} without DPN, {digits[1]}"))
    # stems in the early studies
    for folder, label in (("digits", "*digits*"), ("cifar10", "*early*")):
        gain = float(table_cell(f"{folder}/stems_differences.md", "| conv |", 4).split(" ± ")[0])
        found.append((f"{label} conv stem", f"{label} {gain:+.1f}"))
    # efficiency: the CPU half of the efficiency table and the converged steps to accuracy
    table = "efficiency/efficiency_table_cpu.md"
    header = row_cells(table_row(table, "| setting |"))
    columns = {v: header.index(v) for v in ("dual_patchnorm", "post_ln", "deepnorm", "conv_stem",
                                             "dyt", "batchnorm")}
    found.append(("DyT's training throughput on JAX at S/16, withdrawn as it does not replicate",
                  "DyT on JAX at S/16 was "
                  + table_cell(table, "| S/16 training, CPU jax ", columns["dyt"]).split(" ")[0]
                  + " pre-LN's throughput in the efficiency table's benchmark and "
                  + f"{step_time_ratio('variants_s16_float32.json', 'jax', 'dyt'):.3f}x"))
    conv = [float(table_cell(table, f"| {model} training, CPU {backend} ", columns["conv_stem"])
                  .split("x")[0])
            for model in ("S/16", "B/16") for backend in ("jax", "tensorflow", "torch")]
    found.append(("the conv stem's training throughput, CPU",
                  f"setting ({min(conv):.2f}x to {max(conv):.2f}x)"))
    found.append(("the conv stem's training throughput, CPU, as the answer states it",
                  f"{min(conv):.2f}x to {max(conv):.2f}x"))
    steps = {v: table_cell(table, "| steps to ", c).split(" ")[0] for v, c in columns.items()}
    found.append(("steps to pre-LN's final validation accuracy",
                  f"DeepNorm and the convolutional stem reach pre-LN's final validation accuracy "
                  f"in {steps['deepnorm']} its steps, post-LN in {steps['post_ln']}, BatchNorm "
                  f"in {steps['batchnorm']} and DPN in {steps['dual_patchnorm']}"))
    if steps["deepnorm"] != steps["conv_stem"]:
        found.append(("the conv stem's steps, stated with DeepNorm's", steps["conv_stem"]
                      + " (the guide states one figure for both)"))
    return found


#: Decimal figures the answer may state that are no result of this project's studies.
NOT_RESULTS = {
    "+0.2": "the paper's smallest DPN gain on ImageNet-1k (Table 1)",
    "+1.9": "the paper's largest DPN gain on ImageNet-1k (Table 1)",
    "+1.4": "the paper's DPN gain for Ti/16 on ImageNet-1k (Table 1)",
    "1.2M": "the CIFAR-10 study's model size",
    "0.05": "the significance level",
}
TOP, DETAIL, END = ("## The answer in one minute", "## The CIFAR-10 and digits findings in detail",
                    "## What the paper reports")
#: A decimal figure: 0.38x, +7.4, -6.6, 0.010, 12.5%, 1.2M (not 3,000 or 1e-3).
DECIMAL = re.compile(r"[+-]?\d+\.\d+[xM%]?")


def sections():
    """`(answer, detail)`: the guide's one-minute and short answers, then its findings in
    detail, each with line breaks and repeated spaces as one space."""
    with open(GUIDE) as f:
        text = f.read()
    for heading in (TOP, DETAIL, END):
        if heading not in text:
            raise SystemExit(f"{GUIDE} has no section {heading!r}")
    answer = text.split(TOP, 1)[1].split(DETAIL, 1)[0]
    detail = text.split(DETAIL, 1)[1].split(END, 1)[0]
    return re.sub(r"\s+", " ", answer), re.sub(r"\s+", " ", detail)


def unchecked_figures(answer, computed):
    """The decimal figures of `answer` found inside no `computed` text it states and not in
    `NOT_RESULTS`, in order, each once."""
    spans = []
    for expected in computed:
        start = answer.find(expected)
        while start != -1:
            spans.append((start, start + len(expected)))
            start = answer.find(expected, start + 1)
    loose = [m.group() for m in DECIMAL.finditer(answer)
             if not any(a <= m.start() and m.end() <= b for a, b in spans)]
    return list(dict.fromkeys(f for f in loose if f not in NOT_RESULTS))


def main():
    answer, detail = sections()
    found = checks()
    missing = [(what, expected) for what, expected in found if expected not in detail]
    for what, expected in missing:
        print(f"not in the findings in detail: {what}: {expected!r}")
    loose = unchecked_figures(answer, [expected for _, expected in found])
    for figure in loose:
        print(f"in the answer but recomputed by no check: {figure!r}")
    print(f"{len(found) - len(missing)} of {len(found)} numbers found as computed; "
          f"{len(loose)} figure(s) of the answer unchecked")
    return 1 if missing or loose else 0


if __name__ == "__main__":
    sys.exit(main())
