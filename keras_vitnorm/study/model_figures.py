"""Matplotlib figures of what is inside a study's trained models, saved as PNG:
accuracy and gradient norms by depth, the stem's learned scale, the residual stream."""

import math
import re

import numpy as np

from keras_vitnorm.analysis.probes import depth_group
from keras_vitnorm.study.figures import pyplot
from keras_vitnorm.study.figures import save
from keras_vitnorm.study.one_run import grad_norm_records
from keras_vitnorm.study.stats import confidence_interval
from keras_vitnorm.study.variants import variant_factors


def _depth_order(name):
    """Sort key of a depth group: patch embedding, stem, blocks, final norm, head."""
    block = re.fullmatch(r"block_(\d+)", name)
    if block:
        return 2, int(block[1])
    return {"patch_embedding": 0, "stem": 1, "final_norm": 3}.get(name, 4), 0


def accuracy_by_depth(rows, group="depth_stability"):
    """`{(placement, warm-up): [(depth, mean, ci, runs), ...]}` of a depth group's accuracy."""
    accuracies = {}
    for row in rows:
        if row["group"] == group and row["status"] == "completed":
            factors = variant_factors(group, row["variant"])
            key = (factors["placement"], factors.get("warmup", True))
            accuracies.setdefault(key, {}).setdefault(factors["depth"], []).append(float(row["test_accuracy"]))
    return {key: [(depth, *confidence_interval(values), len(values)) for depth, values in sorted(by_depth.items())]
            for key, by_depth in accuracies.items()}


def plot_accuracy_by_depth(rows, title, path, group="depth_stability"):
    """Test accuracy against depth, a line per placement and warm-up, with 95% CIs."""
    figure, axes = pyplot().subplots(figsize=(7, 4.5))
    colors, series = {}, accuracy_by_depth(rows, group)
    axes.set_xscale("log", base=2)
    for (placement, warmup), points in series.items():
        color = colors.setdefault(placement, f"C{len(colors) % 10}")
        depths = [p[0] for p in points]
        errors = [100 * p[2] if np.isfinite(p[2]) else 0.0 for p in points]
        axes.errorbar(depths, [100 * p[1] for p in points], yerr=errors, color=color, marker="o",
                      capsize=3, linestyle="-" if warmup else "--",
                      label=f"{placement}, {'with' if warmup else 'no'} warm-up")
    depths = sorted({point[0] for points in series.values() for point in points})
    axes.set_xticks(depths, [str(depth) for depth in depths])
    axes.minorticks_off()
    axes.set_xlabel("depth (blocks)")
    axes.set_ylabel("test accuracy (%)")
    axes.set_title(title)
    axes.legend(fontsize=7)
    return save(figure, path)


def depth_profile(grad_norms_csv):
    """`(groups, norms)`: gradient norm per depth group, in depth order, averaged over
    the records; step 0 (where the zero head leaves every other gradient zero) is left
    out when later records exist."""
    per_step = {}
    for step, layer, norm in grad_norm_records(grad_norms_csv):
        group = depth_group(layer + "/weight")
        groups = per_step.setdefault(step, {})
        groups[group] = groups.get(group, 0.0) + norm**2
    if len(per_step) > 1:
        per_step.pop(0, None)
    groups = sorted({g for step in per_step.values() for g in step}, key=_depth_order)
    norms = [float(np.mean([np.sqrt(step.get(g, 0.0)) for step in per_step.values()])) for g in groups]
    return groups, norms


def aligned_depth_profiles(runs):
    """`(groups, {label: norms})`: `depth_profile` of each of `runs` (label: path) on the
    union of their groups, `nan` where a run lacks one (post-LN has no final norm)."""
    profiles = {label: dict(zip(*depth_profile(path))) for label, path in runs.items()}
    groups = sorted({g for profile in profiles.values() for g in profile}, key=_depth_order)
    return groups, {label: [profile.get(g, math.nan) for g in groups]
                    for label, profile in profiles.items()}


def plot_gradient_norms(runs, title, path):
    """Gradient norm by depth for several runs: `runs` maps labels to grad_norms.csv."""
    figure, axes = pyplot().subplots(figsize=(8, 4.5))
    groups, profiles = aligned_depth_profiles(runs)
    for label, norms in profiles.items():
        present = [i for i, norm in enumerate(norms) if not math.isnan(norm)]
        axes.plot(present, [norms[i] for i in present], marker="o", label=label)
    if groups:
        axes.set_xticks(range(len(groups)))
        axes.set_xticklabels(groups, rotation=45, ha="right", fontsize=8)
    axes.set_yscale("log")
    axes.set_ylabel("gradient L2 norm (mean over training)")
    axes.set_title(title)
    axes.legend()
    return save(figure, path)


def plot_stem_scales(scale, title, path):
    """One panel per channel of a `(P, P, C)` stem scale map."""
    channels = scale.shape[-1]
    figure, axes = pyplot().subplots(1, channels, figsize=(max(4.5, 3 * channels + 0.5), 3.3),
                                     squeeze=False)
    for channel in range(channels):
        image = axes[0, channel].imshow(scale[..., channel], cmap="viridis")
        axes[0, channel].set_title(f"channel {channel}")
        axes[0, channel].axis("off")
        figure.colorbar(image, ax=axes[0, channel], fraction=0.046)
    figure.suptitle(title, fontsize=10)
    return save(figure, path)


def split_by_depth(streams):
    """`streams` (`{label: [residual_stream result per run]}`) with a label whose runs
    differ in depth split per depth, `"<label> (<N> blocks)"`."""
    split = {}
    for label, runs in streams.items():
        depths = {}
        for stream in runs:
            depths.setdefault(tuple(stream["names"]), []).append(stream)
        if len(depths) < 2:
            split[label] = runs
        else:
            split.update({f"{label} ({len(names) - 1} blocks)": same
                          for names, same in depths.items()})
    return split


def plot_residual_stream(streams, title, path):
    """Residual-stream RMS and consecutive-stage similarity by depth, mean over runs."""
    streams = split_by_depth(streams)
    figure, (rms_axes, similarity_axes) = pyplot().subplots(1, 2, figsize=(11, 4.2))
    names = []
    for label, runs in streams.items():
        if not runs:
            continue
        names = max(names, runs[0]["names"], key=len)
        rms = np.mean([stream["rms"] for stream in runs], axis=0)
        similarity = np.mean([stream["similarity"] for stream in runs], axis=0)
        label = f"{label} ({len(runs)} runs)" if len(runs) > 1 else label
        rms_axes.plot(range(len(rms)), rms, marker="o", markersize=3, label=label)
        similarity_axes.plot(range(1, len(rms)), similarity, marker="o", markersize=3, label=label)
    if names:
        step = max(1, len(names) // 13)  # at most about 13 labelled stages
        for axes in (rms_axes, similarity_axes):
            axes.set_xticks(range(0, len(names), step))
            axes.set_xticklabels(names[::step], rotation=45, ha="right", fontsize=8)
        similarity_axes.legend(fontsize=6)
    rms_axes.set_ylabel("token RMS after the stage")
    rms_axes.set_yscale("log")
    similarity_axes.set_ylabel("cosine similarity with the previous stage")
    figure.suptitle(title, fontsize=10)
    return save(figure, path)
