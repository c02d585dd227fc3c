"""One run of a study: train it, resume it or skip it, and keep what its trained
model gives the study's figures (`run_one`, in the study's process or a worker's)."""

import csv
import gzip
import json
import os

from keras_vitnorm import durable
from keras_vitnorm.training import TrainingDiverged
from keras_vitnorm.training import train
from keras_vitnorm.training.run_layout import FINISHED_STATUSES
from keras_vitnorm.training.run_layout import METRICS_FILE
from keras_vitnorm.training.run_layout import SETTINGS_FILE


def read_metrics(run_dir):
    """A run's `metrics.json`, or `None` before its first save."""
    return durable.read_json(os.path.join(run_dir, METRICS_FILE))


def is_finished(run_dir):
    """Whether the run in `run_dir` has ended: completed or diverged."""
    metrics = read_metrics(run_dir)
    return metrics is not None and metrics.get("status") in FINISHED_STATUSES


def resolved_model(preset, model):
    """The model config `model` makes of a built-in `preset` (so that an override equal
    to the default equals none); `model` as it is for a saved model."""
    from keras_vitnorm.models import PRESETS
    from keras_vitnorm.models import ViT
    from keras_vitnorm.models.presets import preset_config

    if preset in PRESETS and not os.path.isdir(preset):
        return {**ViT.default_config(), **preset_config(preset), **model}
    return dict(model)


def recorded_differences(config, run_dir):
    """How the settings recorded in `run_dir` differ from the planned `config`, as
    `"learning_rate: planned 0.002, recorded 0.02; ..."`; `""` where the same, `None` where
    none are recorded. The run directory is not compared (a study may move)."""
    recorded = durable.read_json(os.path.join(run_dir, SETTINGS_FILE))
    if not isinstance(recorded, dict):
        return None
    planned = json.loads(config.to_json())
    changes = [(key, planned[key], recorded.get(key)) for key in sorted(planned)
               if key not in ("model", "output_dir") and recorded.get(key) != planned[key]]
    # as JSON, as the run recorded it (a tuple is a list there)
    planned_model, recorded_model = (
        json.loads(json.dumps(resolved_model(settings.get("preset"), settings.get("model") or {})))
        for settings in (planned, recorded))
    changes += [(f"model {key}", planned_model.get(key), recorded_model.get(key))
                for key in sorted(set(planned_model) | set(recorded_model))
                if planned_model.get(key) != recorded_model.get(key)]
    return "; ".join(f"{key}: planned {plan!r}, recorded {run!r}" for key, plan, run in changes)


#: A run's per-layer gradient norms (`train --grad-norm-every`): the one result file that
#: grows with the run's length and its depth, so `export_study` keeps it gzip-compressed
#: (a fifth of the bytes), under `COMPRESSED_GRAD_NORMS_FILE`.
GRAD_NORMS_FILE = "grad_norms.csv"
COMPRESSED_GRAD_NORMS_FILE = GRAD_NORMS_FILE + ".gz"


def grad_norms_file(run_dir):
    """The path of the run's gradient norms, its `grad_norms.csv` or, in an exported
    study, `grad_norms.csv.gz`; `None` where it has neither."""
    for name in (GRAD_NORMS_FILE, COMPRESSED_GRAD_NORMS_FILE):
        path = os.path.join(run_dir, name)
        if os.path.isfile(path):
            return path
    return None


def grad_norm_records(grad_norms_csv):
    """The `(step, layer, norm)` records of a `grad_norms.csv`, read gzip-compressed where
    its name ends in `.gz`."""
    opener = gzip.open if os.fspath(grad_norms_csv).endswith(".gz") else open
    with opener(grad_norms_csv, "rt", newline="") as f:
        for row in csv.DictReader(f):
            yield int(row["step"]), row["group"], float(row["norm"])


def read_grad_norms(grad_norms_csv):
    """A run's `grad_norms.csv` (or `.csv.gz`) as `{step: {layer: norm}}`, without the
    records where the zero-initialized head leaves every other gradient zero."""
    steps = {}
    for step, layer, norm in grad_norm_records(grad_norms_csv):
        steps.setdefault(step, {})[layer] = norm
    return {step: layers for step, layers in steps.items()
            if any(norm for layer, norm in layers.items() if layer != "head")}


def run_one(config, group, name, run_dir, verbose, take_over_lock=False, probe_images=None,
            analyze=True, track=None):
    """Trains (or resumes, or skips if finished) one run; returns its results row."""
    metrics = read_metrics(run_dir)
    if metrics is None or metrics.get("status") not in FINISHED_STATUSES:
        config.validate()
        resume = os.path.exists(os.path.join(run_dir, SETTINGS_FILE))
        if verbose:
            print(f"[{group}] {name} seed {config.seed}: "
                  f"{'resuming' if resume else 'training'} in {run_dir}")
        try:
            train(config, resume=resume, verbose=verbose if verbose > 1 else 0,
                  take_over_lock=take_over_lock, track=track)
        except TrainingDiverged:
            pass
        metrics = read_metrics(run_dir)
    elif verbose:
        print(f"[{group}] {name} seed {config.seed}: already {metrics['status']}, skipped")
    if metrics["status"] == "completed" and analyze:
        run_analysis(run_dir, probe_images)
    return {"group": group, "variant": name, "seed": config.seed,
            "learning_rate": config.learning_rate, "status": metrics["status"],
            **{key: metrics.get(key)
               for key in ("test_accuracy", "val_accuracy", "val_examples", "diverged_at_step",
                           "steps")},
            "train_seconds": whole_train_seconds(metrics), "run_dir": run_dir}


def probe_images(config, count=64):
    """The first `count` validation images of `config`'s dataset in model format, on
    which `analysis.json` measures the residual stream; `None` without an image size."""
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
    """A run's training time summed across resumes; `None` where unknown."""
    if "train_seconds" in metrics:
        return metrics["train_seconds"]
    return None if metrics.get("resumed_from_step") else metrics.get("train_seconds_this_run")


ANALYSIS_FILE = "analysis.json"
#: What `export_study` copies of a finished run: no weights, checkpoints or locks.
RUN_RESULT_FILES = (SETTINGS_FILE, METRICS_FILE, "log.csv", GRAD_NORMS_FILE, ANALYSIS_FILE)


def run_analysis(run_dir, probe_images=None):
    """`{"stem_scale", "residual_stream", "probe_images"}` of a run's model from its
    `analysis.json`, else computed from `<run_dir>/preset` and added to it, or `None`."""
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
