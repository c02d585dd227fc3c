"""Each variant at its own learning rate: a sweep of peak rates and the choice on
validation (`ablate --lr-sweep`; docs/study.md, "Each variant at its own learning rate")."""

import math
import os

import numpy as np

from keras_vitnorm import durable
from keras_vitnorm.study.factors import depth_table
from keras_vitnorm.study.stats import mean_ci_text
from keras_vitnorm.study.stats import table_text
from keras_vitnorm.study.tables import write_rows
from keras_vitnorm.study.variants import get_variants
from keras_vitnorm.validation import check_distinct


def check_rates(rates):
    """The grid as a sorted list of distinct positive floats; a `ValueError` otherwise."""
    checked = []
    for rate in rates:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < math.inf:
            raise ValueError(f"learning rates of a sweep must be positive numbers, got {rate!r}.")
        checked.append(float(rate))
    if len(checked) < 2 or len(set(checked)) != len(checked):
        raise ValueError("a learning-rate sweep needs two or more distinct rates, "
                         f"got {list(rates)}.")
    return sorted(checked)


#: The most rates `--extend-sweep` adds beyond either end of a variant's grid.
EXTEND_LIMIT = 3


def sweep_of(plan, seeds, rates, own, sweep_seeds, extend, base_rate):
    """`(grids_of, sweep seeds)` of a study (`run_study`'s arguments), or `(None, None)`
    without a sweep; a `ValueError` for sweep settings without a sweep or bad seeds."""
    if rates is None and not own:
        if sweep_seeds is not None or extend:
            flag = "sweep_seeds (--sweep-seeds) are the seeds" if sweep_seeds is not None else \
                "extend_sweep (--extend-sweep) widens the grid"
            raise ValueError(f"{flag} of a learning-rate sweep: give lr_sweep (--lr-sweep) "
                             "too, or leave it out.")
        return None, None
    sweep_seeds = list(seeds[:1] if sweep_seeds is None else sweep_seeds)
    if not sweep_seeds:
        raise ValueError("sweep_seeds (--sweep-seeds) must name at least one seed.")
    check_distinct("sweep_seeds (--sweep-seeds)", sweep_seeds)
    return grids_of(plan, rates, own, base_rate), sweep_seeds


def grids_of(plan, rates=None, own=None, base_rate=None):
    """`{(group, variant): rates}` of every variant of `plan`: its own grid in `own`
    (a variants file's), else `rates`, else its one rate (its own or `base_rate`)."""
    rates = None if rates is None else check_rates(rates)
    own = {key: check_rates(grid) for key, grid in (own or {}).items()}
    defined = [(group, name) for group, _ in plan for name in get_variants(group)] if own else []
    unknown = [key for key in own if key not in defined]
    if unknown:
        raise ValueError(f"a learning-rate sweep is given for {':'.join(unknown[0])}, which is "
                         f"not a variant of the study ({', '.join(map(':'.join, defined))}).")
    return {(group, name): own.get((group, name)) or list(rates or [])
            or [definition[1].get("learning_rate", base_rate)]
            for group, variants in plan for name, definition in variants}


def extend(grids, selection, base, limit=EXTEND_LIMIT):
    """`grids` with the next rate, at the grid's ratio, beyond each end of a variant's grid
    that is its choice or tied with it (5e-4, 1e-3, 2e-3 chosen at 2e-3 gets 4e-3; all
    three tied get 2.5e-4 and 4e-3), while fewer than `limit` rates lie beyond that end of
    its `base` grid (a list, or a dict)."""
    wider = {}
    for key, grid in grids.items():
        grid, choice = list(grid), selection[key]
        rates = base[key] if isinstance(base, dict) else base
        best = {choice["rate"], *choice.get("tied", ())} - {None}
        if len(rates) >= 2 and best:
            top, bottom = grid[-1] in best, grid[0] in best
            if top and sum(r > rates[-1] for r in grid) < limit:
                grid.append(float(f"{grid[-1] * grid[-1] / grid[-2]:.6g}"))
            if bottom and sum(r < rates[0] for r in grid) < limit:
                grid.insert(0, float(f"{grid[0] * grid[0] / grid[1]:.6g}"))
        wider[key] = grid
    return wider


def all_rates(grids):
    """The rates of every variant's grid, sorted, each once."""
    return sorted({rate for grid in grids.values() for rate in grid})


def rate_text(rate):
    return f"{rate:g}"


def rate_folder(rate):
    """The folder of a variant's runs at `rate`: `lr_<rate>`."""
    return f"lr_{rate_text(rate)}"


def at_rates(variants, grids, group):
    """`[(variant, (model, settings))]` of each variant of `group` at each of its rates."""
    return [(name, (model, {**settings, "learning_rate": rate}))
            for name, (model, settings) in variants for rate in grids[(group, name)]]


def select(rows, plan, rates, seeds):
    """The choice of each variant of `plan` from the sweep's `rows` over `rates` (a list,
    or a `{(group, variant): rates}` dict).

    Returns:
        `{(group, variant): {"rate": chosen or None, "reason": why none, "tied": the chosen
        rate and those within `noise_margin` of it (empty where none is), "scores": {rate:
        {"values": final validation accuracies, "examples": their validation images,
        "diverged": count, "missing": count}}}}`. The choice is the best mean; the rates
        tied with it say where else the peak may lie (`extend` widens the grid there).
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
    sampling of the validation images alone: `z` standard errors of a difference of two
    proportions, each over the images one run scores (`scores` entries with `examples`;
    the sweep's seeds score the same images); 0 where a run did not record its count.

    The seeds' own spread is not in it (one sweep seed has none to measure): two rates
    closer than this are not told apart by the validation set.
    """
    variance = 0.0
    for score in (first, second):
        examples = score.get("examples") or []
        images = min(examples, default=0)
        if not images or len(examples) != len(score["values"]):
            return 0.0
        accuracy = float(np.mean(score["values"]))
        variance += accuracy * (1 - accuracy) / images
    return z * math.sqrt(variance)


def at_chosen_rates(plan, selection, say=None):
    """`plan` with each variant at its chosen rate; one without is left out (and named)."""
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
    """How far apart two runs' final accuracies fall by seed alone (`None` under two values)."""
    if len(values) < 2:
        return None
    from scipy import stats

    t = stats.t.ppf(0.5 + level / 2, len(values) - 1)
    return float(t * np.std(values, ddof=1) * math.sqrt(2))


def selection_table(selection, rates, group, final_rows=()):
    """Markdown: per variant of `group`, its accuracy at each rate, the rate chosen and
    the rates within `tie_margin` of it (from `final_rows` at the chosen rate)."""
    header = ["variant", *(f"lr {rate_text(r)}" for r in rates), "chosen rate",
              "tied within the seed noise"]
    table = []
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
            notes = []
            if len(scores) == 1:
                notes.append("its only rate")
            elif choice["rate"] in (min(scores), max(scores)):
                notes.append("edge of the grid")
            if choice.get("tied"):
                notes.append("tied within the validation noise: "
                             + ", ".join(map(rate_text, choice["tied"])))
            chosen += f" ({'; '.join(notes)})" if notes else ""
            ties = _ties(choice, [float(r["val_accuracy"]) for r in final_rows
                                  if (r["group"], r["variant"]) == (group, name)
                                  and r["status"] == "completed"
                                  and math.isclose(float(r["learning_rate"]), choice["rate"])])
        table.append([name, *cells, chosen, ties])
    return table_text(header, table)


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
        parts.append(mean_ci_text(score["values"]))
    if score["diverged"]:
        parts.append(f"{score['diverged']} diverged")
    if score["missing"]:
        parts.append(f"{score['missing']} not finished")
    return ", ".join(parts)


def write_selection(rows, selection, rates, output_dir):
    """Writes `lr_sweep.csv` and each group's selection table, figure and summary; returns paths."""
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
    """Writes `<group>_lr_selection.md` per group of `selection`; returns the paths."""
    paths = []
    for group in dict.fromkeys(group for group, _ in selection):
        path = os.path.join(output_dir, f"{group}_lr_selection.md")
        durable.write_text(path, selection_table(selection, rates, group, final_rows))
        paths.append(path)
    return paths
