"""How much each trained model's predictions rest on what Dual PatchNorm's first norm
removes: each patch's mean and standard deviation.

For every finished run of a group that compares stems, the trained model classifies
`IMAGES` images of the run's own training split and as many test images twice: as they
are, and with every patch's mean and standard deviation taken from the same patch of an
image of another class (`keras_vitnorm.analysis.patch_norm.patch_statistics_reliance`).

- A Dual PatchNorm model standardizes each patch first, so it sees the same input
  either way: its accuracy does not move.
- A plain-stem model's fall in accuracy is how much of its decisions those two numbers
  per patch carry.
- Training against test images: a model that fits its training set through the two
  numbers more than it generalizes through them loses more of its training accuracy,
  and follows the donor's class more often when the donor is a training image it has
  fitted.

Each run's result is kept in its `analysis.json` (key `patch_statistics`), so the
table is redrawn where the weights are not kept.
"""

import os

import numpy as np

from keras_vitnorm import durable
from keras_vitnorm.study.runs import ANALYSIS_FILE
from keras_vitnorm.study.stats import mean_ci_text

#: Images of each split every model classifies: at 2,000 the binomial standard error of
#: an accuracy is at most 1.1 points.
IMAGES = 2000
KEY = "patch_statistics"
_DATA_SETTINGS = ("dataset", "val_fraction", "data_dir", "manual_dir", "train_examples",
                  "val_examples", "skip_bad_images", "input_pipeline")


def labelled_images(run_config, image_shape, count=IMAGES):
    """`{"train": (images, labels), "test": (images, labels)}`: at most `count` images
    of the run's own training split and of the test split (`data.subset`), in model
    format."""
    from keras_vitnorm.training import data as data_lib

    settings = {name: run_config.get(name) for name in _DATA_SETTINGS}
    data = data_lib.load_dataset(
        settings["dataset"], settings["val_fraction"], settings["data_dir"], settings["manual_dir"],
        train_examples=settings["train_examples"], val_examples=settings["val_examples"],
        skip_bad_images=bool(settings["skip_bad_images"]), pipeline=settings["input_pipeline"] or "auto")
    images = {}
    for name, split in (("train", data.train), ("test", data.test)):
        part = data_lib.subset(split, count, settings["dataset"])
        xs, ys = [], []
        for x, y in data_lib.eval_dataset(data, part, tuple(image_shape[:2]), image_shape[2], 500):
            xs.append(np.asarray(x))
            ys.append(np.argmax(np.asarray(y), axis=-1))
        images[name] = (np.concatenate(xs), np.concatenate(ys))
    return images


def run_patch_statistics(run_dir, images_for, count=IMAGES, say=None):
    """A finished run's result: `{"requested": count, "train": ..., "test": ...}`, each
    split a `patch_statistics_reliance` dict.

    Read from the run's `analysis.json` when it holds a result for `count` images;
    otherwise computed from `<run_dir>/preset` with the images
    `images_for(run_config, image_shape, count)` returns, and added to the file. `None`
    for a run with neither. `say` (e.g. `print`) reports a result being computed.
    """
    path = os.path.join(run_dir, ANALYSIS_FILE)
    analysis = durable.read_json(path) or {}
    cached = analysis.get(KEY)
    if cached is not None and cached.get("requested") == count:
        return cached
    preset = os.path.join(run_dir, "preset")
    if not os.path.isdir(preset):
        return cached
    from keras_vitnorm.analysis.patch_norm import patch_statistics_reliance
    from keras_vitnorm.models import ViT

    if say:
        say(f"patch statistics of {run_dir}")

    model = ViT.from_preset(preset)
    run_config = durable.read_json(os.path.join(run_dir, "train_config.json"))
    images = images_for(run_config, tuple(model.input_shape[1:]), count)
    result = {"requested": count}
    for split, (x, y) in images.items():
        result[split] = patch_statistics_reliance(model, x, y)
    durable.write_json(path, {**analysis, KEY: result}, stage="analysis")
    return result


def patch_statistics_table(results):
    """Markdown: per variant, over its runs (mean ± 95% CI, percent or points), the
    accuracy on training and test images as they are and with their patch statistics
    swapped, the training-minus-test gap of each, and how often the swapped images are
    classified as their donor's class.

    Args:
        results: `{variant: [run_patch_statistics result per run]}`.
    """
    lines = [
        "| variant | runs | training images (%) | training, statistics swapped (%) "
        "| test images (%) | test, statistics swapped (%) | training minus test (points) "
        "| training minus test, swapped (points) | donor's class, training (%) "
        "| donor's class, test (%) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, runs in results.items():
        if not runs:
            continue

        def column(split, key):
            return np.array([run[split][key] for run in runs])

        cells = [
            column("train", "clean"), column("train", "swapped"),
            column("test", "clean"), column("test", "swapped"),
            column("train", "clean") - column("test", "clean"),
            column("train", "swapped") - column("test", "swapped"),
            column("train", "donor_label"), column("test", "donor_label"),
        ]
        lines.append(f"| {variant} | {len(runs)} | " + " | ".join(mean_ci_text(c) for c in cells) + " |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def write_tables(rows, output_dir, groups, count=IMAGES, say=None):
    """Writes `<output_dir>/<group>_patch_statistics.md` for each of `groups` with
    finished runs whose result is known or can be computed; returns the paths.

    Runs that share a dataset setting and image shape share one set of images. `say`
    (e.g. `print`) reports each run whose result is computed.
    """
    loaded = {}

    def images_for(run_config, image_shape, count):
        key = (tuple(str(run_config.get(name)) for name in _DATA_SETTINGS), image_shape, count)
        if key not in loaded:
            loaded[key] = labelled_images(run_config, image_shape, count)
        return loaded[key]

    paths = []
    for group in groups:
        results = {}
        for row in rows:
            if row["group"] != group or row["status"] != "completed":
                continue
            result = run_patch_statistics(row["run_dir"], images_for, count, say)
            if result is not None:
                results.setdefault(row["variant"], []).append(result)
        table = patch_statistics_table(results)
        if table:
            path = os.path.join(output_dir, f"{group}_patch_statistics.md")
            durable.write_text(path, table)
            paths.append(path)
    return paths
