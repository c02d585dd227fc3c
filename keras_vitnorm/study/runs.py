"""One run of a study: train it, resume it or skip it, and keep what its trained
model gives the study's figures.

`run_one` is what both the study's own process and its worker processes
(`keras_vitnorm.study.workers`) call for each (variant, seed).
"""

import csv
import os

from keras_vitnorm import durable
from keras_vitnorm.training import TrainingDiverged
from keras_vitnorm.training import train


def read_metrics(run_dir):
    """A run's `metrics.json`, or `None` before its first save."""
    return durable.read_json(os.path.join(run_dir, "metrics.json"))


def read_grad_norms(grad_norms_csv):
    """A run's `grad_norms.csv` as `{step: {layer: norm}}`, the step-0 record left out
    (with the zero-initialized head every gradient but the head's is zero there)."""
    steps = {}
    with open(grad_norms_csv, newline="") as f:
        for row in csv.DictReader(f):
            if int(row["step"]) > 0:
                steps.setdefault(int(row["step"]), {})[row["group"]] = float(row["norm"])
    return steps


def run_one(config, group, name, run_dir, verbose, take_over_lock=False, probe_images=None, analyze=True):
    """Trains (or resumes, or skips if finished) one run; returns its results row.

    `analyze` computes a finished run's `analysis.json` (the study's figures read it).
    """
    seed = config.seed
    metrics = read_metrics(run_dir)
    if metrics is None or metrics.get("status") not in ("completed", "diverged"):
        config.validate()
        resume = os.path.exists(os.path.join(run_dir, "train_config.json"))
        if verbose:
            print(f"[{group}] {name} seed {seed}: {'resuming' if resume else 'training'} in {run_dir}")
        try:
            train(config, resume=resume, verbose=verbose if verbose > 1 else 0,
                  take_over_lock=take_over_lock)
        except TrainingDiverged:
            pass
        metrics = read_metrics(run_dir)
    elif verbose:
        print(f"[{group}] {name} seed {seed}: already {metrics['status']}, skipped")
    if metrics["status"] == "completed" and analyze:
        run_analysis(run_dir, probe_images)
    return {
        "group": group,
        "variant": name,
        "seed": seed,
        "learning_rate": config.learning_rate,
        "status": metrics["status"],
        "test_accuracy": metrics.get("test_accuracy"),
        "val_accuracy": metrics.get("val_accuracy"),
        "val_examples": metrics.get("val_examples"),
        "diverged_at_step": metrics.get("diverged_at_step"),
        "steps": metrics.get("steps"),
        "train_seconds": whole_train_seconds(metrics),
        "run_dir": run_dir,
    }


def probe_images(config, count=64):
    """The first `count` validation images of `config`'s dataset in model format: the
    images a run's `analysis.json` measures its residual stream on (the same for every
    run of a study, whose runs share the dataset and image size). `None` where the
    config leaves the image size to its preset."""
    from keras_vitnorm.training import data as data_lib

    size = config.model.get("image_size")
    if size is None:
        return None
    size = (size, size) if isinstance(size, int) else tuple(size)
    data = data_lib.load_dataset(config.dataset, config.val_fraction, config.data_dir,
                                 config.manual_dir, skip_bad_images=bool(config.skip_bad_images),
                                 pipeline=config.input_pipeline)
    channels = config.model.get("num_channels", data.channels)
    return data_lib.first_eval_batch(data, data.validation, size, channels, count)[0]


def whole_train_seconds(metrics):
    """A run's training time over all its steps, summed across resumes; `None` where
    unknown (a run resumed from a checkpoint that did not record it). Runs that never
    resumed give their one run's time, also where `metrics.json` predates the total."""
    if "train_seconds" in metrics:
        return metrics["train_seconds"]
    if not metrics.get("resumed_from_step"):
        return metrics.get("train_seconds_this_run")
    return None


ANALYSIS_FILE = "analysis.json"
#: What `export_study` copies of a finished run: no weights, checkpoints or locks.
RUN_RESULT_FILES = ("train_config.json", "metrics.json", "log.csv", "grad_norms.csv", ANALYSIS_FILE)


def run_analysis(run_dir, probe_images=None):
    """What the study's figures read of a finished run's trained model, kept in
    `<run_dir>/analysis.json` so they can be redrawn where the weights are not kept.

    Returns:
        `{"stem_scale": (P, P, C) nested list or None, "residual_stream":
        keras_vitnorm.analysis.residual_stream(model, probe_images) or None,
        "probe_images": count or None}`: read from the file if it holds what is
        asked (a residual stream on as many images when `probe_images` is given),
        else computed from `<run_dir>/preset` and written, with any other analysis the
        file holds (`keras_vitnorm.study.patch_statistics`) kept. `None` for a run with
        neither.
    """
    path = os.path.join(run_dir, ANALYSIS_FILE)
    cached = durable.read_json(path)
    if (cached is not None and "stem_scale" in cached
            and (probe_images is None or cached.get("probe_images") == len(probe_images))):
        return cached
    preset = os.path.join(run_dir, "preset")
    if not os.path.isdir(preset):
        return cached
    from keras_vitnorm.analysis.probes import residual_stream
    from keras_vitnorm.analysis.probes import stem_scale_map
    from keras_vitnorm.models import ViT

    model = ViT.from_preset(preset)
    try:
        stem_scale = stem_scale_map(model).tolist()
    except ValueError:  # raised exactly when the stem has no learned first-norm scale
        stem_scale = None
    stream = None
    if probe_images is not None:
        stream = residual_stream(model, probe_images)
        stream = {"names": list(stream["names"]), "rms": [float(v) for v in stream["rms"]],
                  "similarity": [float(v) for v in stream["similarity"]]}
    # Other analyses kept in the file (`keras_vitnorm.study.patch_statistics`) stay.
    analysis = {**(cached or {}), "stem_scale": stem_scale, "residual_stream": stream,
                "probe_images": None if probe_images is None else len(probe_images)}
    durable.write_json(path, analysis, stage="analysis")
    return analysis
