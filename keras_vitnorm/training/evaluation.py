"""`evaluate`: a saved model, or a finished run's, scored again on a split of a dataset."""

import os

from keras_vitnorm import durable
from keras_vitnorm.models import ViT
from keras_vitnorm.models.vit_config import in_model_range
from keras_vitnorm.training import data as data_lib
from keras_vitnorm.training.config import dtype_policy
from keras_vitnorm.training.optimizer import compile_classifier
from keras_vitnorm.training.run_layout import METRICS_FILE
from keras_vitnorm.training.run_layout import SETTINGS_FILE
from keras_vitnorm.validation import check_choice
from keras_vitnorm.validation import check_positive_int


def image_size(model):
    """`(height, width)` of the images `model` takes."""
    size = model.get_config()["image_size"]
    return (size, size) if isinstance(size, int) else tuple(size)


def evaluate(path, dataset=None, split="test", batch_size=256, val_fraction=None,
             data_dir=None, manual_dir=None, verbose=1):
    """Scores the saved model in `path` on the `split` ("test", "validation" or "train")
    of a dataset. `path` is a preset directory or a run directory (its `preset/`, scored
    by default as the run's final evaluation scored it).

    Returns `{"dataset", "split", "examples", "accuracy", "loss", "preset"}`.
    """
    check_choice("split", split, ("test", "validation", "train"))
    check_positive_int("batch_size", batch_size)
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} does not exist or is not a directory.")
    run_settings = durable.read_json(os.path.join(path, SETTINGS_FILE)) or {}
    if run_settings:
        metrics = durable.read_json(os.path.join(path, METRICS_FILE)) or {}
        status = metrics.get("status", "unfinished (no metrics.json)")
        if status != "completed":
            last = os.path.join(path, "checkpoints", "last")
            raise ValueError(
                f"The run in {path!r} has not completed, so it has no final model to score: "
                f"its status is {status}. "
                + ("Start a new run." if status == "diverged" else
                   f"Finish it with `keras-vitnorm train --resume --output-dir {path}`.")
                + (f" Its model at the latest epoch end is the preset {last}."
                   if os.path.exists(last) else ""))
    elif not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"{path!r} is neither a preset directory (config.json, model.weights.npz) nor a "
            f"run directory ({SETTINGS_FILE}).")
    dataset = dataset or run_settings.get("dataset")
    if dataset is None:
        raise ValueError(f"{path} is not a run directory; name the dataset to score it on.")
    val_fraction = val_fraction or run_settings.get("val_fraction", 0.1)
    # The run's own dataset is split as the run split it (a held-out val_examples too).
    own = dataset == run_settings.get("dataset")
    data = data_lib.load_dataset(
        dataset, val_fraction, data_dir, manual_dir,
        skip_bad_images=bool(run_settings.get("skip_bad_images")),
        train_examples=run_settings.get("train_examples") if own else None,
        val_examples=run_settings.get("val_examples") if own else None,
        pipeline=run_settings.get("input_pipeline") or "auto")
    preset_dir = os.path.join(path, "preset") if run_settings else path
    with dtype_policy(run_settings.get("mixed_precision") or "float32"):
        return _score(preset_dir, data, split, batch_size,
                      run_settings.get("label_smoothing") or 0.0, verbose)


def _score(preset_dir, data, split, batch_size, label_smoothing, verbose):
    model = ViT.from_preset(preset_dir, **in_model_range({}))  # the pipelines feed [-1, 1]
    model.check_datasets = False
    classes = model.get_config()["num_classes"]
    if classes != data.num_classes:
        raise ValueError(
            f"The model in {preset_dir} has {classes} classes but {data.name} has "
            f"{data.num_classes}; it was not trained on this dataset.")
    chosen = getattr(data, split)
    images = data_lib.eval_dataset(data, chosen, image_size(model),
                                   model.get_config()["num_channels"], batch_size)
    compile_classifier(model, "sgd", label_smoothing)  # the optimizer is unused: evaluate only
    result = model.evaluate(images, return_dict=True, verbose=verbose)
    return {"preset": preset_dir, "dataset": data.name, "split": f"{split} ({chosen.name})",
            "examples": chosen.size, "accuracy": float(result["accuracy"]),
            "loss": float(result["loss"])}
