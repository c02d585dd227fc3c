"""What each trained model's predictions rest on: what Dual PatchNorm's first norm
removes (each patch's mean and standard deviation) or what it keeps (its pattern).
Each run's result is kept in its `analysis.json` (the table: docs/study.md, "Output")."""

import os

import numpy as np

from keras_vitnorm import durable
from keras_vitnorm.analysis.patch_norm import RELIANCE_KEYS
from keras_vitnorm.study.one_run import ANALYSIS_FILE
from keras_vitnorm.study.stats import mean_ci_text
from keras_vitnorm.study.stats import table_text
from keras_vitnorm.training.run_layout import SETTINGS_FILE

#: Images of each split every model classifies: at 2,000 the binomial standard error of
#: an accuracy is at most 1.1 points.
IMAGES = 2000
KEY = "patch_statistics"
_DATA_SETTINGS = ("dataset", "val_fraction", "data_dir", "manual_dir", "train_examples",
                  "val_examples", "skip_bad_images", "input_pipeline")
_ACCURACY_HEADER = ["variant", "runs", "training images (%)", "training, statistics swapped (%)",
                    "training, patterns swapped (%)", "test images (%)",
                    "test, statistics swapped (%)", "test, patterns swapped (%)"]
_SURPLUS_HEADER = ["variant", "runs", "training minus test (points)",
                   "statistics swapped (points)", "patterns swapped (points)",
                   "donor's class, statistics swapped: training / test (%)",
                   "donor's class, patterns swapped: training / test (%)"]


def labelled_images(run_config, image_shape, count=IMAGES):
    """`{"train": (images, labels), "test": (images, labels)}`: at most `count` images of
    the run's own training split and of the test split, in model format."""
    from keras_vitnorm.training import TrainConfig
    from keras_vitnorm.training import data as data_lib

    config = TrainConfig(**run_config)
    data = data_lib.load_dataset(
        config.dataset, config.val_fraction, config.data_dir, config.manual_dir,
        train_examples=config.train_examples, val_examples=config.val_examples,
        skip_bad_images=bool(config.skip_bad_images), pipeline=config.input_pipeline or "auto")
    return {name: data_lib.eval_arrays(data, data_lib.subset(split, count, config.dataset),
                                       tuple(image_shape[:2]), image_shape[2])
            for name, split in (("train", data.train), ("test", data.test))}


def run_patch_statistics(run_dir, images_for, count=IMAGES, say=None):
    """A finished run's `{"requested": count, "train", "test"}` from its `analysis.json`, else
    computed from `<run_dir>/preset` and added to it; `None` for a run with neither."""
    path = os.path.join(run_dir, ANALYSIS_FILE)
    analysis = durable.read_json(path) or {}
    cached = analysis.get(KEY)
    if (cached is not None and cached.get("requested") == count
            and all(key in cached.get(split, {}) for split in ("train", "test")
                    for key in RELIANCE_KEYS)):
        return cached
    preset = os.path.join(run_dir, "preset")
    if not os.path.isdir(preset):
        return None
    from keras_vitnorm.analysis.patch_norm import patch_statistics_reliance
    from keras_vitnorm.models import ViT

    if say:
        say(f"patch statistics of {run_dir}")
    model = ViT.from_preset(preset)
    run_config = durable.read_json(os.path.join(run_dir, SETTINGS_FILE))
    images = images_for(run_config, tuple(model.input_shape[1:]), count)
    result = {"requested": count}
    for split, (x, y) in images.items():
        result[split] = patch_statistics_reliance(model, x, y)
    durable.write_json(path, {**analysis, KEY: result}, stage="analysis")
    return result


def patch_statistics_table(results):
    """Markdown, two tables over each variant's runs (docs/study.md, "Output"); `results`:
    `{variant: [run_patch_statistics result per run]}`."""
    accuracy, surplus = [], []
    for variant, runs in results.items():
        if not runs:
            continue

        def column(split, key):
            return np.array([run[split][key] for run in runs])

        def gap(key):
            return mean_ci_text(column("train", key) - column("test", key))

        def donor(key):
            return f"{mean_ci_text(column('train', key))} / {mean_ci_text(column('test', key))}"

        accuracy.append([variant, str(len(runs)), *(
            mean_ci_text(column(split, key)) for split in ("train", "test")
            for key in ("clean", "statistics_swapped", "patterns_swapped"))])
        surplus.append([variant, str(len(runs)), gap("clean"), gap("statistics_swapped"),
                        gap("patterns_swapped"), donor("statistics_swapped_to_donor"),
                        donor("patterns_swapped_to_donor")])
    if not accuracy:
        return ""
    return ("Accuracy\n\n" + table_text(_ACCURACY_HEADER, accuracy)
            + "\nSurplus on training images, and the donor's class\n\n"
            + table_text(_SURPLUS_HEADER, surplus))


def write_tables(rows, output_dir, groups, count=IMAGES, say=None):
    """Writes `<group>_patch_statistics.md` per group of `groups` with a result."""
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
