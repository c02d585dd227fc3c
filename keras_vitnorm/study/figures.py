"""Matplotlib figures of a study's results, saved as PNG: gains over the baseline,
loss and accuracy curves, the learning-rate sweep (docs/study.md, "Output")."""

import os

import numpy as np

from keras_vitnorm import durable
from keras_vitnorm.study.stats import confidence_interval
from keras_vitnorm.study.variants import level_text
from keras_vitnorm.training.run_layout import read_log


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(figure, path):
    """Saves `figure` as a PNG at `path`, atomically, closes it and returns `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.tight_layout()
    durable.write_file(path, lambda temporary: figure.savefig(temporary, dpi=120))
    pyplot().close(figure)
    return path


def _signed_bars(names, values, errors, width=7):
    """Horizontal bars, green at or above 0 and red below, the first name on top:
    `(figure, axes)`. A NaN error (one run) draws no error bar, where 0 would draw one."""
    figure, axes = pyplot().subplots(figsize=(width, 0.45 * len(names) + 1.5))
    colors = ["tab:green" if v >= 0 else "tab:red" for v in values]
    axes.barh(names, values, xerr=errors, color=colors, capsize=3)
    axes.axvline(0, color="black", linewidth=0.8)
    axes.invert_yaxis()
    return figure, axes


def plot_gains(summary, title, path):
    """Horizontal bars: gain over the baseline in points, with its Welch 95% CI."""
    entries = summary[1:]
    gains = [100 * e["gain"] if e["gain"] is not None else 0.0 for e in entries]
    errors = [np.nan if e["gain_ci"] is None else 100 * e["gain_ci"] for e in entries]
    figure, axes = _signed_bars([e["variant"] for e in entries], gains, errors)
    for index, entry in enumerate(entries):
        if entry["mean"] is None:
            axes.text(0, index, "  all runs diverged", va="center")
        elif entry["diverged"]:
            axes.text(gains[index], index, f"  {entry['diverged']} diverged", va="center")
    axes.set_xlabel(f"accuracy gain over {summary[0]['variant']} (points)")
    axes.set_title(title)
    return save(figure, path)


def plot_stem_differences(differences, title, path):
    """Horizontal bars of `factors.stem_differences`, in points, with Welch 95% CIs."""
    names = [f"{d['stem']}, {level_text(d)} ({d['runs']} vs {d['plain_runs']} runs)"
             for d in differences]
    values = [100 * d["difference"] for d in differences]
    errors = [100 * d["ci"] for d in differences]  # NaN with one run on a side
    figure, axes = _signed_bars(names, values, errors, width=9)
    reach = max(abs(v) + np.nan_to_num(e) for v, e in zip(values, errors)) * 1.1 or 1.0
    axes.set_xlim(-reach, reach)  # zero in the middle: the sign reads at a glance
    axes.set_xlabel("test accuracy minus the plain stem's\nat the same level (points)")
    axes.set_title(title)
    return save(figure, path)


def legend(axes, **kwargs):
    """The legend, or a note where no curve was drawn (no run logged an epoch)."""
    if axes.get_legend_handles_labels()[0]:
        axes.legend(**kwargs)
    else:
        axes.text(0.5, 0.5, "no curve: no finished run of these variants logged an epoch",
                  transform=axes.transAxes, ha="center", va="center", color="gray")


def plot_loss_curves(rows, title, path):
    """Mean training (solid) and validation (dashed) loss per epoch of each variant."""
    figure, axes = pyplot().subplots(figsize=(7, 4.5))
    for index, variant in enumerate(dict.fromkeys(r["variant"] for r in rows)):
        curves = {"loss": [], "val_loss": []}
        for row in rows:
            log = os.path.join(row["run_dir"], "log.csv")
            if row["variant"] == variant and os.path.exists(log):
                records = read_log(log)
                for key in curves:
                    curves[key].append([r[key] for r in records if key in r])
        color = f"C{index % 10}"
        for key, style in (("loss", "-"), ("val_loss", "--")):
            if not curves[key]:
                continue
            length = min(map(len, curves[key]))
            mean = np.mean([c[:length] for c in curves[key]], axis=0)
            axes.plot(np.arange(1, length + 1), mean, style, color=color,
                      label=variant if key == "loss" else None)
    axes.set_xlabel("epoch")
    axes.set_ylabel("loss (solid: train, dashed: validation)")
    axes.set_yscale("log")
    axes.set_title(title)
    legend(axes, fontsize=7, ncol=2)
    return save(figure, path)


def _curves_by_seed(rows, variant, column="val_accuracy"):
    """`{seed: [value per epoch]}`: the `log.csv` column of each finished run of `variant`."""
    curves = {}
    for row in rows:
        if row["variant"] == variant and row["status"] == "completed":
            log = read_log(os.path.join(row["run_dir"], "log.csv"))
            curve = [r[column] for r in log if column in r]
            if curve:
                curves[row["seed"]] = curve
    return curves


def validation_curves(rows, variant, column="val_accuracy"):
    """`(runs, epochs)`: a `log.csv` column of the finished runs of `variant`, cut even."""
    curves = list(_curves_by_seed(rows, variant, column).values())
    if not curves:
        return np.zeros((0, 0))
    length = min(map(len, curves))
    return np.array([curve[:length] for curve in curves])


def gain_curves(rows, variant, baseline):
    """`(seeds, epochs)`: `variant`'s validation accuracy minus `baseline`'s, by seed."""
    ours, theirs = _curves_by_seed(rows, variant), _curves_by_seed(rows, baseline)
    seeds = sorted(set(ours) & set(theirs))
    if not seeds:
        return np.zeros((0, 0))
    length = min(min(len(ours[s]), len(theirs[s])) for s in seeds)
    return np.array([np.subtract(ours[s][:length], theirs[s][:length]) for s in seeds])


def curve_band(curves):
    """The band shaded around the mean of `curves` `(runs, epochs)`: `(low, high, kind)`,
    or `None` for a single run: the 95% Student-t interval from three runs, the range of
    two (whose t interval, 12.7 standard errors wide, would hide every difference)."""
    if len(curves) < 2:
        return None
    if len(curves) == 2:
        return curves.min(axis=0), curves.max(axis=0), "range"
    from scipy import stats

    mean = curves.mean(axis=0)
    half = stats.t.ppf(0.975, len(curves) - 1) * curves.std(axis=0, ddof=1) / np.sqrt(len(curves))
    return mean - half, mean + half, "95% CI"


#: How a figure's title names the bands it shades, by the kinds `curve_band` gave.
_SHADED = {("95% CI",): "95% CI", ("range",): "the range of the two seeds",
           ("95% CI", "range"): "95% CI, or the range of a variant's two seeds"}


def _plot_bands(series, noun, mean_text, ylabel, title, path, zero_line=False):
    """The mean per epoch of each `(color index, variant, curves)`, `curve_band` shaded."""
    figure, axes = pyplot().subplots(figsize=(7, 4.5))
    if zero_line:
        axes.axhline(0, color="black", linewidth=0.8)
    kinds = set()
    for index, variant, curves in series:
        if not curves.size:
            continue
        epochs, color = np.arange(1, curves.shape[1] + 1), f"C{index % 10}"
        count = f"{len(curves)} {noun}" + ("" if len(curves) == 1 else "s")
        axes.plot(epochs, curves.mean(axis=0), color=color, label=f"{variant} ({count})")
        band = curve_band(curves)
        if band is not None:
            axes.fill_between(epochs, band[0], band[1], color=color, alpha=0.2)
            kinds.add(band[2])
    shaded = _SHADED.get(tuple(sorted(kinds)))
    axes.set_xlabel("epoch")
    axes.set_ylabel(ylabel)
    axes.set_title(f"{title}\n({mean_text}" + (f"; shaded: {shaded})" if shaded else ")"))
    legend(axes, fontsize=7, ncol=2)
    return save(figure, path)


def plot_gain_curves(rows, title, path):
    """Each variant's validation accuracy gain over the baseline per epoch, paired by seed."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    series = [(index, variant, 100 * gain_curves(rows, variant, variants[0]))
              for index, variant in enumerate(variants[1:], start=1)]
    ylabel = f"validation accuracy minus {variants[0]}'s (points)" if variants else ""
    return _plot_bands(series, "seed", "paired by seed; mean", ylabel, title, path,
                       zero_line=True)


def plot_accuracy_curves(rows, title, path):
    """Validation accuracy per epoch of each variant, mean over seeds."""
    series = [(index, variant, 100 * validation_curves(rows, variant))
              for index, variant in enumerate(dict.fromkeys(r["variant"] for r in rows))]
    return _plot_bands(series, "run", "mean over seeds", "validation accuracy (%)", title, path)


def plot_lr_sweep(selection, rates, title, path):
    """Mean final validation accuracy by peak rate per variant of `selection`, choice filled."""
    figure, axes = pyplot().subplots(figsize=(7, 4.5))
    for name, choice in selection.items():
        scores = choice["scores"]  # the variant's own grid (an extended sweep's may be wider)
        points = [(rate, *confidence_interval(scores[rate]["values"]))
                  for rate in sorted(scores) if scores[rate]["values"]
                  and not scores[rate]["diverged"]]
        if not points:
            continue
        x, mean, ci = (np.array(values, float) for values in zip(*points))
        line = axes.errorbar(x, 100 * mean, yerr=100 * np.nan_to_num(ci), marker="o",
                             markerfacecolor="white", capsize=3, label=name)
        if choice["rate"] is not None:
            best = list(x).index(choice["rate"])
            # over the line's white-faced markers (errorbar draws its line at zorder 2.1)
            axes.plot(x[best], 100 * mean[best], "o", color=line[0].get_color(),
                      zorder=line[0].get_zorder() + 0.1)
    axes.set_xscale("log")
    axes.set_xticks(rates, [f"{rate:g}" for rate in rates])
    axes.minorticks_off()
    axes.set_xlabel("peak learning rate")
    axes.set_ylabel("final validation accuracy (%)")
    axes.set_title(title + "\n(filled: the rate chosen)")
    legend(axes, fontsize=8)
    return save(figure, path)
