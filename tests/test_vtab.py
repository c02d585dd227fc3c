"""The VTAB-1k protocol: its splits, the rate chosen on validation, the sweep and its command."""

import csv
import json
import os

import numpy as np
import pytest

from keras_vitnorm import ViT
from keras_vitnorm import cli
from keras_vitnorm.study import vtab
from keras_vitnorm.study.stats import confidence_interval
from keras_vitnorm.training import TrainConfig
from keras_vitnorm.training import load_dataset

TINY = {"image_size": 16, "patch_size": 4, "width": 32, "depth": 1, "num_heads": 2, "mlp_dim": 64}


def _examples(split):
    return {(x.tobytes(), int(y)) for x, y in zip(*split.arrays)}


def test_vtab_splits_hold_800_train_and_200_validation_examples_apart_from_the_test_split():
    data = load_dataset("digits", train_examples=800, val_examples=200)
    assert (data.train.size, data.validation.size, data.test.size) == (800, 200, 360)
    train, validation, test = _examples(data.train), _examples(data.validation), _examples(data.test)
    assert len(train) + len(validation) == 1000  # no example in both
    assert not train & validation and not train & test and not validation & test
    again = load_dataset("digits", train_examples=800, val_examples=200)
    assert _examples(again.validation) == validation  # fixed draw, the same for every run
    labels = [y for _, y in validation]
    assert min(np.bincount(labels)) >= 15  # stratified: every class in the validation split
    with pytest.raises(ValueError, match="val_examples=1300 leaves no training examples of the 1293"):
        load_dataset("digits", val_examples=1300)
    with pytest.raises(ValueError, match="val_examples must be a positive integer, got 0"):
        load_dataset("digits", val_examples=0)


def test_tfds_vtab_split_takes_the_first_800_and_the_next_200():
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=1200):
        data = load_dataset("tfds:cifar10", train_examples=800, val_examples=200)
        full = load_dataset("tfds:cifar10")
        order = [x for x, _ in full.train.source.take(1000).as_numpy_iterator()]
        assert (data.train.size, data.validation.size) == (800, 200)
        assert [x for x, _ in data.validation.source.as_numpy_iterator()] == order[800:1000]


def _row(preset, dataset, rate, seed, val, test, status="completed"):
    return {"preset": preset, "dataset": dataset, "learning_rate": rate, "seed": seed, "status": status,
            "val_accuracy": val, "test_accuracy": test, "run_dir": "x"}


def test_the_rate_is_chosen_on_mean_validation_accuracy_and_reported_on_test():
    rows = [
        _row("plain", "a", 0.01, 0, 0.50, 0.90), _row("plain", "a", 0.01, 1, 0.52, 0.92),
        _row("plain", "a", 0.001, 0, 0.60, 0.40), _row("plain", "a", 0.001, 1, 0.58, 0.44),
        _row("dpn", "a", 0.01, 0, 0.70, 0.71), _row("dpn", "a", 0.01, 1, None, None, status="diverged"),
        _row("dpn", "a", 0.001, 0, 0.65, 0.60), _row("dpn", "a", 0.001, 1, 0.66, 0.62),
    ]
    chosen = vtab.select(rows)
    assert chosen[("a", "plain")] == (0.001, [0.40, 0.44])  # best validation, even with worse test
    assert chosen[("a", "dpn")] == (0.01, [0.71])  # diverged runs do not count
    table = vtab.vtab_table(rows)
    mean, half = confidence_interval([40.0, 44.0])
    assert f"| a | {mean:.1f} +- {half:.1f} (lr 0.001, n=2) | 71.0 (lr 0.01, n=1) |" in table
    assert vtab.preset_label("runs/b16_dpn/preset") == "b16_dpn" and vtab.preset_label("x.npz") == "x.npz"


# The sweep's runs, skipping and table; fine-tuning on each backend is test_training.py's.
@pytest.mark.one_backend
def test_vtab_sweep_trains_each_rate_and_seed_resumes_and_writes_the_table(tmp_path, capsys):
    ViT(**TINY, num_classes=10).save_to_preset(tmp_path / "model_a")
    argv = ["vtab", "--presets", str(tmp_path / "model_a"), "--datasets", "digits", "--lrs", "0.01", "0.001",
            "--seeds", "0", "--output-dir", str(tmp_path / "sweep"), "--steps", "2",
            "--steps-per-epoch", "2", "--batch-size", "16", "--warmup-steps", "0", "--verbose", "0",
            "--no-tensorboard"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "| digits |" in out and "n=1" in out
    with open(tmp_path / "sweep" / "vtab_results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["learning_rate"], r["seed"], r["status"]) for r in rows] == [
        ("0.01", "0", "completed"), ("0.001", "0", "completed")]
    settings = json.loads((tmp_path / "sweep" / rows[0]["run_dir"] / "train_config.json").read_text())
    assert (settings["train_examples"], settings["val_examples"], settings["optimizer"]) == (800, 200, "sgd")
    first = (tmp_path / "sweep" / "vtab.md").read_text()
    assert cli.main(argv) == 0  # everything finished: nothing is trained again
    assert (tmp_path / "sweep" / "vtab.md").read_text() == first

    assert cli.main(["vtab", "--presets", "a", "--datasets", "digits", "--output-dir", str(tmp_path / "x"),
                     "--lr", "0.1"]) == 2
    assert "--lr is set by the sweep" in capsys.readouterr().err
    assert cli.main(["vtab", "--presets", str(tmp_path / "model_a"), "--datasets", "digits", "tfds:",
                     "--output-dir", str(tmp_path / "x")]) == 2
    assert "tfds" in capsys.readouterr().err
    with pytest.raises(ValueError, match="fine-tunes a trained model"):
        TrainConfig.from_recipe("vtab_1k")
    assert os.path.exists(tmp_path / "sweep" / "model_a" / "digits" / "lr_0.001" / "seed_0" / "metrics.json")
