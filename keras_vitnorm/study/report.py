"""The study's figures, and the tables computed with them: gains, curves, gradient norms,
stem scales, residual streams, and what Dual PatchNorm's first norm removes."""

import os

import numpy as np

from keras_vitnorm import durable
from keras_vitnorm.study import factors
from keras_vitnorm.study.one_run import grad_norms_file
from keras_vitnorm.study.one_run import run_analysis
from keras_vitnorm.study.stats import table_text
from keras_vitnorm.study.tables import summarize
from keras_vitnorm.study.variants import DEPTHS
from keras_vitnorm.study.variants import DPN_PATCH_SIZES
from keras_vitnorm.study.variants import STEM_PAIRS


def make_figures(rows, figure_dir, probe_images=None):
    """Writes every figure the results allow (docs/study.md, "Output") and, with
    `probe_images`, each group's `<group>_residual_stream.md`; returns the paths."""
    from keras_vitnorm.study import figures
    from keras_vitnorm.study import model_figures

    paths = []
    for group in dict.fromkeys(row["group"] for row in rows):
        group_rows = [r for r in rows if r["group"] == group]
        summary = summarize(group_rows)
        differences = factors.stem_differences(rows, group)
        if differences:
            # a factorial group compares each stem with the plain stem at its own level
            paths.append(figures.plot_stem_differences(
                differences, f"{group}: each stem against the plain stem\n(mean, Welch 95% CI)",
                os.path.join(figure_dir, f"{group}_differences.png")))
        elif len(summary) > 1:
            paths.append(figures.plot_gains(
                summary, f"{group}: test accuracy gain", os.path.join(figure_dir, f"{group}_gains.png")))
            paths.append(figures.plot_gain_curves(
                group_rows, f"{group}: validation accuracy gain per epoch",
                os.path.join(figure_dir, f"{group}_gain_curves.png")))
        paths.append(figures.plot_loss_curves(
            group_rows, f"{group}: loss per epoch (mean over seeds)",
            os.path.join(figure_dir, f"{group}_loss.png")))
        paths.append(figures.plot_accuracy_curves(
            group_rows, f"{group}: validation accuracy per epoch",
            os.path.join(figure_dir, f"{group}_accuracy.png")))
        if probe_images is not None:
            paths.extend(_residual_stream_outputs(group, group_rows, probe_images, figure_dir))
    for group, pair in STEM_PAIRS.items():
        paths.extend(_stem_figures(rows, group, pair, figure_dir))
    if any(r["group"] == "depth_stability" for r in rows):
        paths.append(model_figures.plot_accuracy_by_depth(
            rows, "test accuracy by depth (mean, 95% CI over seeds)",
            os.path.join(figure_dir, "depth_stability_by_depth.png")))
    deepest = [r for r in rows if r["group"] == "depth_stability" and r["status"] == "completed"]
    grad_runs = _grad_norm_runs(deepest, [f"{placement}-depth_{max(DEPTHS)}"
                                          for placement in ("pre_ln", "post_ln", "deepnorm")])
    if len(grad_runs) > 1:
        paths.append(model_figures.plot_gradient_norms(
            grad_runs, f"gradient norm by depth, depth {max(DEPTHS)}",
            os.path.join(figure_dir, "depth_gradient_norms.png")))
    return paths


def _grad_norm_runs(finished, variants):
    """`{"<variant> (seed <s>)": gradient norms file}` of each of `variants`' first run."""
    found = {}
    for variant in variants:
        run = next((r for r in finished if r["variant"] == variant), None)
        path = run and grad_norms_file(run["run_dir"])
        if path:
            found[f"{variant} (seed {run['seed']})"] = path
    return found


def _stem_figures(rows, group, pair, figure_dir):
    from keras_vitnorm.study import model_figures

    finished = [r for r in rows if r["group"] == group and r["status"] == "completed"]
    paths, grad_runs = [], _grad_norm_runs(finished, pair)
    if len(grad_runs) == 2:
        paths.append(model_figures.plot_gradient_norms(
            grad_runs, f"{group}: gradient norm by depth",
            os.path.join(figure_dir, f"{group}_gradient_norms.png")))
    dpn = next((r for r in finished if r["variant"] == pair[1]), None)
    analysis = run_analysis(dpn["run_dir"]) if dpn else None
    if analysis and analysis.get("stem_scale") is not None:
        paths.append(model_figures.plot_stem_scales(
            np.asarray(analysis["stem_scale"]),
            f"{group}: learned scale of DPN's first stem LayerNorm",
            os.path.join(figure_dir, f"{group}_stem_scales.png")))
    return paths


def _residual_stream_outputs(group, rows, images, figure_dir):
    from keras_vitnorm.study import model_figures

    streams = {}
    for run in rows:
        analysis = run_analysis(run["run_dir"], images) if run["status"] == "completed" else None
        if analysis and analysis.get("residual_stream"):
            streams.setdefault(run["variant"], []).append(analysis["residual_stream"])
    if not streams:
        return []
    streams = model_figures.split_by_depth(streams)
    table = os.path.join(figure_dir, f"{group}_residual_stream.md")
    durable.write_text(table, factors.residual_stream_table(streams))
    return [model_figures.plot_residual_stream(
        streams, f"{group}: residual stream of trained models, mean over seeds "
                 f"({len(images)} validation images)",
        os.path.join(figure_dir, f"{group}_residual_stream.png")), table]


def dpn_mechanism(base, output_dir, patch_sizes=DPN_PATCH_SIZES, train_count=10000):
    """Writes `dpn_mechanism.md`: what DPN's first norm removes from the data (docs/study.md)."""
    from keras_vitnorm.analysis.patch_norm import VARIANCE_FLOOR
    from keras_vitnorm.analysis.patch_norm import patch_norm_probe
    from keras_vitnorm.training import data as data_lib

    size = base.model.get("image_size")
    size = (size, size) if isinstance(size, int) else tuple(size)
    data = data_lib.load_dataset(base.dataset, base.val_fraction, base.data_dir, base.manual_dir,
                                 train_examples=train_count,
                                 skip_bad_images=bool(base.skip_bad_images),
                                 pipeline=base.input_pipeline)
    channels = base.model.get("num_channels", data.channels)

    train_images, train_labels = data_lib.eval_arrays(data, data.train, size, channels)
    test_images, test_labels = data_lib.eval_arrays(data, data.validation, size, channels)
    header = ["patch size", "dims per patch", "pixels (plain stem's input)",
              "patches after LN_0 (DPN's input)",
              f"after LN_0 with variance floor {VARIANCE_FLOOR:g}",
              "only the mean and std per patch (what LN_0 removes)", "energy in patch means",
              "patches with std below 0.1"]
    table = []
    for patch in patch_sizes:
        probe = patch_norm_probe(train_images, train_labels, test_images, test_labels, patch)
        table.append([str(patch), f"{probe['patch_dim']} (LN_0 removes 2)", *(
            f"{probe[key]:.1%}" for key in ("pixels", "standardized_patches", "floored_patches",
                                            "patch_mean_and_std", "energy_in_means",
                                            "low_contrast"))])
    path = os.path.join(output_dir, "dpn_mechanism.md")
    durable.write_text(path, (
        f"Linear probes (logistic regression) trained on {len(train_images):,} training images, "
        f"scored on {len(test_images):,} validation images; chance is {1 / data.num_classes:.0%}."
        "\n\n" + table_text(header, table)))
    return path
