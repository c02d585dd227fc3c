"""Few-shot linear transfer of a study's trained models, as big_vision evaluates it
(docs/study.md, "Few-shot linear transfer"). Each run's accuracies are kept in its
`analysis.json` (key `fewshot`, one entry per request), so a rerun reads them."""

import csv
import json
import os

import numpy as np

from keras_vitnorm import durable
from keras_vitnorm.study.fewshot_lsr import L2_REGULARIZATION
from keras_vitnorm.study.fewshot_lsr import few_shot_draws
from keras_vitnorm.study.fewshot_lsr import fit_least_squares
from keras_vitnorm.study.one_run import ANALYSIS_FILE
from keras_vitnorm.study.stats import difference_row
from keras_vitnorm.study.stats import mean_ci_text
from keras_vitnorm.study.stats import p_value_table

#: Training images per class of each fit (big_vision's configs use 1, 5, 10 and 25).
SHOTS = (10, 25)
#: Draws of the training images per shot count (big_vision's `num_seeds` is 3).
DRAWS = 5
KEY = "fewshot"
CSV_FIELDS = ("group", "variant", "seed", "learning_rate", "run_dir", "dataset", "shots", "draw",
              "accuracy", "test_images")


def check_request(shots, draws, test_examples, batch_size):
    """`(sorted shot counts, draws)`; a `ValueError` naming any value that is not valid."""
    def positive(value):
        return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1

    shots = list(shots)
    if not shots or not all(positive(s) for s in shots):
        raise ValueError(f"shots must be one or more positive integers (training images per "
                         f"class), got {shots!r}.")
    for name, value in (("draws", draws), ("batch_size", batch_size)):
        if not positive(value):
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if test_examples is not None and not positive(test_examples):
        raise ValueError(f"test_examples must be a positive integer (or None: the whole test "
                         f"split), got {test_examples!r}.")
    return sorted({int(s) for s in shots}), int(draws)


def check_dataset(dataset, pipeline="auto"):
    """The input pipeline that reads `dataset` (digits or a folder); nothing is loaded."""
    from keras_vitnorm.training import data as data_lib

    if data_lib.parse_dataset(dataset)[0] == "tfds":  # parse_dataset names unknown forms
        raise ValueError(f"dataset={dataset!r}: few-shot draws need every training label "
                         "before any image is read, which 'digits' and 'folder:<path>' "
                         "datasets give; write the tfds dataset out as class folders.")
    return data_lib.check_pipeline(pipeline, dataset)


class TransferData:
    """A transfer dataset as one few-shot request reads it: of the non-test images only
    those some draw uses, and the test split (or a stratified subset of it)."""

    def __init__(self, dataset, shots=SHOTS, draws=DRAWS, test_examples=None,
                 l2_regularization=L2_REGULARIZATION, pipeline="auto", batch_size=256):
        from keras_vitnorm.training import data as data_lib

        self.shots, self.draws = check_request(shots, draws, test_examples, batch_size)
        pipeline = check_dataset(dataset, pipeline)
        data = data_lib.load_dataset(dataset, pipeline=pipeline)
        raws = np.concatenate([data.train.arrays[0], data.validation.arrays[0]])
        labels = np.concatenate([data.train.arrays[1], data.validation.arrays[1]])
        try:
            draw_indices = few_shot_draws(labels, data.num_classes, self.shots[-1], self.draws,
                                          data.class_names)
        except ValueError as error:
            raise ValueError(f"dataset={dataset!r}: {error}") from None
        used = np.unique(draw_indices)
        self.positions = np.searchsorted(used, draw_indices)  # into the images read
        self.train = data_lib.Split(f"the {len(used)} training images the draws use",
                                    arrays=(raws[used], labels[used]))
        self.test = data.test
        if test_examples is not None:
            if test_examples > data.test.size:
                raise ValueError(f"test_examples={test_examples} is more than the "
                                 f"{data.test.size} test images of {dataset} ({data.test.name}).")
            self.test = data_lib.subset(data.test, test_examples, dataset)
        self.data, self.batch_size = data, batch_size
        self.request = {"dataset": dataset, "shots": self.shots, "draws": self.draws,
                        "test_examples": test_examples, "l2_regularization": l2_regularization,
                        "input_pipeline": pipeline}
        self.key = json.dumps(self.request, sort_keys=True)
        self._batches = {}

    def batches(self, split, image_shape):
        """The evaluation batches of `split` at `image_shape`, made once for every model."""
        from keras_vitnorm.training.data import eval_dataset

        key = (split, tuple(image_shape))
        if key not in self._batches:
            self._batches[key] = eval_dataset(self.data, getattr(self, split),
                                              tuple(image_shape[:2]), image_shape[2],
                                              self.batch_size)
        return self._batches[key]

    def scores(self, train_features, test_features):
        """`{str(shots): [test accuracy of each draw]}` of fits on `train_features`."""
        train_labels, test_labels = self.train.arrays[1], self.test.arrays[1]

        def accuracy(chosen):
            classifier = fit_least_squares(train_features[chosen], train_labels[chosen],
                                           self.data.num_classes,
                                           self.request["l2_regularization"])
            return classifier.accuracy(test_features, test_labels)

        return {str(shots): [accuracy(positions[:, :shots].ravel()) for positions in self.positions]
                for shots in self.shots}


def pooled_features(model, batches, progress=None):
    """`(images, width)` float32 pooled features (what the head reads) of `batches`."""
    backbone = model.backbone()
    features = []
    for batch in batches:
        images = np.asarray(batch[0])
        features.append(np.asarray(backbone.predict_on_batch(images)["pooled"], "float32"))
        if progress is not None:
            progress.add(len(images))
    return np.concatenate(features)


def run_fewshot(run_dir, transfer, verbose=0, say=None):
    """A finished run's `{"request", "accuracy", "test_images"}` from its `analysis.json`, else
    computed from `<run_dir>/preset` and added to it; `None` for a run with neither."""
    path = os.path.join(run_dir, ANALYSIS_FILE)
    analysis = durable.read_json(path) or {}
    entries = analysis.get(KEY) or {}
    cached = entries.get(transfer.key)
    if (isinstance(cached, dict) and cached.get("request") == transfer.request
            and all(len(cached.get("accuracy", {}).get(str(s), ())) == transfer.draws
                    for s in transfer.shots)):
        return cached
    preset = os.path.join(run_dir, "preset")
    if not os.path.isdir(preset):
        return None
    from keras_vitnorm.models import ViT
    from keras_vitnorm.models.vit_config import in_model_range

    if say:
        say(f"few-shot features of {run_dir}")
    model = ViT.from_preset(preset, **in_model_range({}))  # its images are in [-1, 1]
    shape = tuple(model.input_shape[1:])
    progress = None
    if verbose:
        import keras

        progress = keras.utils.Progbar(transfer.train.size + transfer.test.size, unit_name="image")
    train = pooled_features(model, transfer.batches("train", shape), progress)
    test = pooled_features(model, transfer.batches("test", shape), progress)
    result = {"request": transfer.request, "accuracy": transfer.scores(train, test),
              "test_images": int(transfer.test.size)}
    durable.write_json(path, {**analysis, KEY: {**entries, transfer.key: result}},
                       stage="analysis")
    return result


def run_mean(result, shots):
    """A run's accuracy at `shots`: its mean over the draws."""
    return float(np.mean(result["accuracy"][str(shots)]))


def fewshot_table(results, shots):
    """Markdown, a table per shot count: each variant's accuracy against the baseline.
    `results`: `{variant: [run_fewshot result per run]}`, baseline first."""
    if not any(results.values()):
        return ""
    baseline = next(iter(results))
    sections = []
    for count in shots:
        values = {name: [run_mean(r, count) for r in runs] for name, runs in results.items()}
        base = values[baseline]
        rows = []
        for name, own in values.items():
            cells = [name, str(len(own)), mean_ci_text(own), mean_ci_text(base)]
            rows.append((cells + ["baseline"], None) if name == baseline
                        else difference_row(cells, own, base))
        header = ["variant", "runs", f"{count}-shot accuracy (%), mean ± 95% CI",
                  f"{baseline} (%)", "difference, points (Welch 95% CI)"]
        sections.append(f"{count} training images per class\n\n" + p_value_table(header, rows))
    return "\n".join(sections)


def read_results(study_dir):
    """The rows of `<study_dir>/results.csv`, run directories joined to `study_dir`."""
    path = os.path.join(study_dir, "results.csv")
    if not os.path.isfile(path):
        raise ValueError(f"{study_dir} holds no results.csv: give a study directory that "
                         "`keras-vitnorm ablate` has written (its results.csv names the runs).")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    missing = {"group", "variant", "seed", "status", "run_dir"} - set(rows[0] if rows else ())
    if not rows or missing:
        raise ValueError(f"{path} has no result rows with the columns group, variant, seed, "
                         f"status and run_dir{f' (missing: {sorted(missing)})' if rows else ''}.")
    for row in rows:
        row["run_dir"] = os.path.normpath(os.path.join(study_dir, row["run_dir"]))
    return rows


def write_fewshot(study_dir, dataset, shots=SHOTS, draws=DRAWS, test_examples=None,
                  batch_size=256, pipeline="auto", l2_regularization=L2_REGULARIZATION,
                  verbose=1, take_over_lock=False):
    """Scores every completed run of a study by few-shot linear transfer to `dataset`.

    Writes `<group>_fewshot.md` per group with a result and `fewshot.csv` under the
    study's lock; returns `{group: table}`.

    Args:
        study_dir: a study directory (its `results.csv` names the runs).
        dataset: `"digits"` or `"folder:<path>"`.
        shots, draws: training images per class of each fit; fits per shot count.
        test_examples: a stratified subset of the test split (`None`: all of it).
        batch_size, pipeline: images per forward pass; `"auto"`, `"tf.data"` or `"python"`.
        l2_regularization: the ridge penalty (big_vision's `2.0 ** 10`).
        verbose: 0 silent, 1 a line and a progress bar per run computed.
        take_over_lock: as for `run_study`.
    """
    from keras_vitnorm.training import run_files

    check_request(shots, draws, test_examples, batch_size)
    check_dataset(dataset, pipeline)
    rows = read_results(study_dir)
    completed = [row for row in rows if row["status"] == "completed"]
    if not completed:
        raise ValueError(f"{study_dir}/results.csv lists no completed run to evaluate.")
    say = print if verbose else None
    with run_files.RunLock(study_dir, "study.lock", take_over=take_over_lock,
                           what="study directory"):
        with run_files.storage_errors(study_dir, "Finished runs are intact.", run_files.AGAIN):
            transfer = TransferData(dataset, shots, draws, test_examples, l2_regularization,
                                    pipeline, batch_size)
            found = {}
            for row in completed:
                if row["run_dir"] not in found:
                    found[row["run_dir"]] = run_fewshot(row["run_dir"], transfer, verbose, say)
                    if found[row["run_dir"]] is None and say:
                        say(f"[{row['group']}] {row['variant']} seed {row['seed']}: no preset "
                            "and no result for this request, left out")
            if not any(found.values()):
                raise ValueError(f"No completed run of {study_dir} has a preset or a few-shot "
                                 "result for this request to table.")
            return _write_outputs(study_dir, rows, found, transfer)


def dataset_text(dataset):
    """`dataset` as the tables name it: an image folder by its own name, not by the path it
    had on the machine that scored it (the tables travel, with a study's results, to
    machines where that path means nothing)."""
    if dataset.startswith("folder:"):
        return f"the image folder '{os.path.basename(os.path.normpath(dataset[len('folder:'):]))}'"
    return dataset


def _write_outputs(study_dir, rows, found, transfer):
    tables, records = {}, []
    request = transfer.request
    header = (f"Few-shot linear transfer to {dataset_text(request['dataset'])}: regularized "
              f"least squares (l2 {request['l2_regularization']:g}) on each model's pre-logit "
              "features, "
              f"{request['draws']} draws of the training images per shot count, scored on "
              f"{transfer.test.size} test images (keras_vitnorm.study.fewshot, as big_vision's "
              "fewshot_lsr). A run's accuracy is its mean over the draws; mean ± 95% CI over "
              "runs.\n\n")
    for group in dict.fromkeys(row["group"] for row in rows):
        results = {}
        for row in (r for r in rows if r["group"] == group):
            results.setdefault(row["variant"], [])  # the baseline first, whatever its runs did
            result = found.get(row["run_dir"]) if row["status"] == "completed" else None
            if result is None:
                continue
            results[row["variant"]].append(result)
            for shots in transfer.shots:
                for draw, accuracy in enumerate(result["accuracy"][str(shots)]):
                    records.append({
                        "group": group, "variant": row["variant"], "seed": row["seed"],
                        "learning_rate": row.get("learning_rate"),
                        "run_dir": os.path.relpath(row["run_dir"], study_dir),
                        "dataset": request["dataset"], "shots": shots, "draw": draw,
                        "accuracy": accuracy, "test_images": result["test_images"]})
        table = fewshot_table(results, transfer.shots)
        if table:
            tables[group] = header + table
            durable.write_text(os.path.join(study_dir, f"{group}_fewshot.md"), tables[group])
    durable.write_csv(os.path.join(study_dir, "fewshot.csv"), CSV_FIELDS, records)
    return tables
