"""Each variant at its own learning rate: a sweep of peak rates and the choice on
validation (`ablate --lr-sweep`).

Norms move with the learning rate (post-LN, DyT, BatchNorm and DeepNorm more than
pre-LN), so a comparison at the rate calibrated for one variant can measure the rate,
not the norm. With a sweep, every variant first trains at every rate of the grid with
the sweep's seeds; the rate with the highest mean final validation accuracy is its
own (the test split is not read for the choice), and the variant's runs at that rate
are the ones the study's tables compare. A rate at which any sweep run diverged is
not chosen. A choice at either end of the grid is flagged: the best rate may lie
beyond it. With `ablate --extend-sweep` such a variant then trains the next rate
beyond that end (the grid's ratio at that end), and again while its choice stays at
the end, up to `EXTEND_LIMIT` rates beyond the grid on either side; a variant's grid
is then its own.

Written per study: `lr_sweep.csv` (every sweep run, as `results.csv`),
`<group>_lr_selection.md` (validation accuracy by variant and rate, and the rate
chosen), `figures/<group>_lr_sweep.png` and, for the groups over placement, depth and
warm-up (`deep`), `<group>_lr_sweep_summary.md`: what trains or stalls at each rate.
"""

import math
import os

import numpy as np

from keras_vitnorm import durable
from keras_vitnorm.study.factors import depth_table
from keras_vitnorm.study.stats import confidence_interval
from keras_vitnorm.study.tables import write_rows


def check_rates(rates):
    """The grid as a sorted list of distinct positive floats; a `ValueError` naming a bad
    value otherwise."""
    checked = []
    for rate in rates:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0 \
                or math.isinf(rate):
            raise ValueError(f"learning rates of a sweep must be positive numbers, got {rate!r}.")
        checked.append(float(rate))
    if len(checked) < 2 or len(set(checked)) != len(checked):
        raise ValueError("a learning-rate sweep needs two or more distinct rates, "
                         f"got {list(rates)}.")
    return sorted(checked)


#: The most rates `--extend-sweep` adds beyond either end of a variant's grid.
EXTEND_LIMIT = 3


def grids_of(plan, rates):
    """`{(group, variant): rates}`: every variant of `plan` on the same grid."""
    return {(group, name): list(rates) for group, variants in plan for name, _ in variants}


def extend(grids, selection, rates, limit=EXTEND_LIMIT):
    """`grids` with the next rate beyond the end of a variant's grid where its chosen
    rate is that end, at the grid's ratio there (5e-4, 1e-3, 2e-3 chosen at 2e-3 gets
    4e-3), while fewer than `limit` rates lie beyond that end of the base grid
    `rates`. A variant with no choice yet keeps its grid."""
    wider = {}
    for key, grid in grids.items():
        grid, choice = list(grid), selection[key]
        best = {choice["rate"], *choice.get("tied", ())} - {None}  # an end tied with it too
        if grid[-1] in best and sum(r > rates[-1] for r in grid) < limit:
            grid.append(_rounded(grid[-1] * grid[-1] / grid[-2]))
        if grid[0] in best and sum(r < rates[0] for r in grid) < limit:
            grid.insert(0, _rounded(grid[0] * grid[0] / grid[1]))
        wider[key] = grid
    return wider


def _rounded(rate):
    return float(f"{rate:.6g}")


def all_rates(grids):
    """The rates of every variant's grid, sorted, each once."""
    return sorted({rate for grid in grids.values() for rate in grid})


def rate_text(rate):
    return f"{rate:g}"


def rate_folder(rate):
    """The folder of a variant's runs at `rate`: `lr_<rate>`."""
    return f"lr_{rate_text(rate)}"


def at_rates(variants, rates, group=None):
    """`[(variant, (model, settings))]` of each variant at each rate of the grid:
    `rates` a list, or `{(group, variant): rates}` (`grids_of`, `extend`)."""
    return [(name, (model, {**settings, "learning_rate": rate}))
            for name, (model, settings) in variants
            for rate in (rates[(group, name)] if isinstance(rates, dict) else rates)]


def select(rows, plan, rates, seeds):
    """The choice of each variant of `plan` from the sweep's result `rows`, over
    `rates` (a list, or each variant's own grid as `{(group, variant): rates}`).

    Returns:
        `{(group, variant): {"rate": the chosen rate or None, "reason": why none,
        "scores": {rate: {"values": final validation accuracies of the completed
        runs, "diverged": count, "missing": count of the sweep seeds not finished}}}}`.
        No rate is chosen while a sweep run of the variant has not finished, nor
        where every rate has a diverged run.
    """
    grids = rates if isinstance(rates, dict) else grids_of(plan, rates)
    selection = {}
    for group, variants in plan:
        for name, _ in variants:
            scores = {}
            for rate in grids[(group, name)]:
                runs = [r for r in rows if (r["group"], r["variant"]) == (group, name)
                        and math.isclose(float(r["learning_rate"]), rate)]
                completed = [r for r in runs if r["status"] == "completed"]
                scores[rate] = {
                    "values": [float(r["val_accuracy"]) for r in completed],
                    "examples": [int(r["val_examples"]) for r in completed
                                 if r.get("val_examples") not in (None, "")],
                    "diverged": sum(r["status"] == "diverged" for r in runs),
                    "missing": len(seeds) - len(runs),
                }
            pending = sum(score["missing"] for score in scores.values())
            eligible = {rate: float(np.mean(s["values"])) for rate, s in scores.items()
                        if not s["diverged"] and not s["missing"]}
            rate, reason, tied = None, None, []
            if pending:
                reason = f"{pending} sweep run(s) not finished"
            elif not eligible:
                reason = "a run diverged at every rate"
            else:
                rate = max(eligible, key=lambda r: (eligible[r], -r))  # a tie: the lower rate
                tied = sorted(r for r in eligible if eligible[rate] - eligible[r]
                              <= noise_margin(scores[rate], scores[r]))
                tied = tied if len(tied) > 1 else []
            selection[(group, name)] = {"rate": rate, "reason": reason, "scores": scores,
                                        "tied": tied}
    return selection


def noise_margin(first, second, z=1.96):
    """The 95% margin of the difference of two rates' mean validation accuracies from the
    validation images' sampling alone (`z` standard errors of a difference of
    proportions); 0 where either score has no `examples`."""
    variance = 0.0
    for score in (first, second):
        examples = score.get("examples") or []
        images = min(examples, default=0)  # the sweep's seeds score the same images
        if not images or len(examples) != len(score["values"]):
            return 0.0
        accuracy = float(np.mean(score["values"]))
        variance += accuracy * (1 - accuracy) / images
    return z * math.sqrt(variance)


def at_chosen_rates(plan, selection, say=None):
    """`plan` with each variant at its chosen rate; a variant without one is left out
    (and named through `say`)."""
    chosen = []
    for group, variants in plan:
        kept = []
        for name, (model, settings) in variants:
            choice = selection[(group, name)]
            if choice["rate"] is None:
                if say:
                    say(f"[{group}] {name}: no learning rate chosen yet ({choice['reason']})")
                continue
            kept.append((name, (model, {**settings, "learning_rate": choice["rate"]})))
        chosen.append((group, kept))
    return chosen


def tie_margin(values, level=0.95):
    """How far apart two runs' final validation accuracies fall by seed alone: the
    half-width of the `level` interval of the difference of two runs,
    `t(n - 1) * s * sqrt(2)`, with `s` the standard deviation of `values` (the final
    runs of one variant at one rate, n of them). `None` with fewer than two."""
    if len(values) < 2:
        return None
    from scipy import stats

    t = stats.t.ppf(0.5 + level / 2, len(values) - 1)
    return float(t * np.std(values, ddof=1) * math.sqrt(2))


def selection_table(selection, rates, group, final_rows=()):
    """Markdown: per variant of `group`, the mean final validation accuracy (%) at each
    rate of its grid (± its 95% CI over two or more seeds; blank where the rate is not
    in its grid), the rate chosen, and the rates tied with it: those whose accuracy
    lies within `tie_margin` of the chosen rate's, the margin taken from the variant's
    `final_rows` at its chosen rate (its seeds; n/a with fewer than two)."""
    lines = ["| variant | " + " | ".join(f"lr {rate_text(r)}" for r in rates)
             + " | chosen rate | tied within the seed noise |",
             "|---|" + "---|" * (len(rates) + 2)]
    for (row_group, name), choice in selection.items():
        if row_group != group:
            continue
        scores = choice["scores"]
        cells = [_score_text(scores[rate]) if rate in scores else "" for rate in rates]
        ties = "n/a"
        if choice["rate"] is None:
            chosen = f"none ({choice['reason']})"
        else:
            chosen = rate_text(choice["rate"])
            notes = ["edge of the grid"] if choice["rate"] in (min(scores), max(scores)) else []
            if choice.get("tied"):
                notes.append("tied within the validation noise: "
                             + ", ".join(map(rate_text, choice["tied"])))
            chosen += f" ({'; '.join(notes)})" if notes else ""
            ties = _ties(choice, [float(r["val_accuracy"]) for r in final_rows
                                  if (r["group"], r["variant"]) == (group, name)
                                  and r["status"] == "completed"
                                  and math.isclose(float(r["learning_rate"]), choice["rate"])])
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {chosen} | {ties} |")
    return "\n".join(lines) + "\n"


def _ties(choice, finals):
    margin = tie_margin(finals)
    if margin is None:
        return "n/a (fewer than 2 seeds at the chosen rate)"
    best = float(np.mean(choice["scores"][choice["rate"]]["values"]))
    tied = [rate for rate, score in sorted(choice["scores"].items())
            if rate != choice["rate"] and score["values"] and not score["diverged"]
            and best - float(np.mean(score["values"])) <= margin]
    names = ", ".join(rate_text(rate) for rate in tied) or "none"
    return f"{names} (margin {100 * margin:.2f} points)"


def _score_text(score):
    parts = []
    if score["values"]:
        mean, ci = confidence_interval(score["values"])
        parts.append(f"{100 * mean:.2f}" + ("" if math.isnan(ci) else f" ± {100 * ci:.2f}"))
    if score["diverged"]:
        parts.append(f"{score['diverged']} diverged")
    if score["missing"]:
        parts.append(f"{score['missing']} not finished")
    return ", ".join(parts)


def write_selection(rows, selection, rates, output_dir):
    """Writes `lr_sweep.csv`, and per group `<group>_lr_selection.md`,
    `figures/<group>_lr_sweep.png` and, where the group is over placement, depth and
    warm-up, `<group>_lr_sweep_summary.md` (`factors.depth_table` of its sweep runs by
    rate). Returns the paths written."""
    from keras_vitnorm.study import figures

    paths = [write_rows(rows, output_dir, "lr_sweep.csv")]
    paths += write_selection_tables(selection, rates, output_dir)
    for group in dict.fromkeys(group for group, _ in selection):
        stability = depth_table(rows, group)
        if stability:
            path = os.path.join(output_dir, f"{group}_lr_sweep_summary.md")
            durable.write_text(path, stability)
            paths.append(path)
        curves = {name: choice for (g, name), choice in selection.items() if g == group}
        paths.append(figures.plot_lr_sweep(
            curves, rates, f"{group}: final validation accuracy by peak learning rate",
            os.path.join(output_dir, "figures", f"{group}_lr_sweep.png")))
    return paths


def write_selection_tables(selection, rates, output_dir, final_rows=()):
    """Writes `<group>_lr_selection.md` per group of `selection` (`selection_table`,
    with the seed noise of `final_rows`); returns the paths written."""
    paths = []
    for group in dict.fromkeys(group for group, _ in selection):
        path = os.path.join(output_dir, f"{group}_lr_selection.md")
        durable.write_text(path, selection_table(selection, rates, group, final_rows))
        paths.append(path)
    return paths
