"""Training: the recipe's pieces, datasets, runs, resume, NaN stop, CLI, data parallel."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import keras
import numpy as np
import pytest

from keras_vitnorm import ViT
from keras_vitnorm import cli
from keras_vitnorm import durable
from keras_vitnorm.training import TrainConfig
from keras_vitnorm.training import TrainingDiverged
from keras_vitnorm.training import evaluate
from keras_vitnorm.training import load_dataset
from keras_vitnorm.training import train
from keras_vitnorm.training.data import Augmentation
from keras_vitnorm.training.data import train_stream
from keras_vitnorm.training.fit_loop import plan_segments
from keras_vitnorm.training.optimizer import decayed_variables
from keras_vitnorm.training.optimizer import make_optimizer

BACKEND = keras.backend.backend()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"image_size": 16, "patch_size": 4, "width": 32, "depth": 1, "num_heads": 2, "mlp_dim": 64}


def assert_unlocked(directory, name="run.lock"):
    """Nothing holds the lock of `directory`: another process could take it now."""
    from keras_vitnorm.training.run_files import RunLock

    RunLock(str(directory), name).acquire().release()


def tiny_config(tmp_path, name="run", **overrides):
    settings = dict(
        model=TINY,
        steps=8,
        batch_size=32,
        warmup_steps=1,
        learning_rate=3e-3,
        tensorboard=False,
        output_dir=str(tmp_path / name),
    )
    settings.update(overrides)
    return TrainConfig.from_recipe("small", **settings)


def run_python(code, env=None, timeout=600):
    environment = {**os.environ, "KERAS_BACKEND": BACKEND, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ----------------------------------------------------------------------------- pieces


@pytest.mark.parametrize(
    "total, per_epoch, epoch, done, expected",
    [
        (40, 10, 0, 0, [(0, 4, 10, 0)]),
        (45, 10, 0, 0, [(0, 4, 10, 0), (4, 5, 5, 0)]),
        (40, 10, 1, 6, [(1, 2, 4, 6), (2, 4, 10, 0)]),
        (45, 10, 4, 2, [(4, 5, 3, 2)]),
        (45, 10, 3, 0, [(3, 4, 10, 0), (4, 5, 5, 0)]),
        (5, 10, 0, 0, [(0, 1, 5, 0)]),
    ],
)
def test_plan_segments_cover_exactly_the_remaining_steps(total, per_epoch, epoch, done, expected):
    segments = plan_segments(total, per_epoch, epoch, done)
    assert segments == expected
    remaining = sum((end - start) * steps for start, end, steps, _ in segments)
    assert remaining == total - epoch * per_epoch - done


def test_weight_decay_only_on_kernels():
    model = ViT(image_size=16, patch_size=4, width=32, depth=1, num_heads=2, mlp_dim=64,
                num_classes=3, stem="dual_patchnorm", layer_scale=0.1)
    config = TrainConfig.from_recipe("small", steps=10, warmup_steps=0, weight_decay=0.5,
                                     learning_rate=0.1)
    optimizer = make_optimizer(config, 10, model)
    before = {v.path: keras.ops.convert_to_numpy(v) for v in model.trainable_variables}
    # Zero gradients: Adam's update is zero, so only weight decay can move a weight.
    optimizer.apply([keras.ops.zeros(v.shape) for v in model.trainable_variables],
                    model.trainable_variables)
    moved = {v.path for v in model.trainable_variables
             if not np.allclose(keras.ops.convert_to_numpy(v), before[v.path])}
    kernels = {v.path for v in decayed_variables(model) if np.any(before[v.path] != 0)}
    assert moved == kernels
    assert any("projection/kernel" in p for p in moved)
    never = ("position_embedding", "class_token", "bias", "gamma", "beta", "scale")
    assert not [p for p in moved if p.rsplit("/", 1)[-1] in never]


def test_learning_rate_warms_up_linearly_then_decays_to_the_minimum():
    model = ViT(image_size=16, patch_size=4, width=16, depth=1, num_heads=2, mlp_dim=32,
                num_classes=2)
    config = TrainConfig.from_recipe("small", steps=100, warmup_steps=10, learning_rate=1e-3,
                                     min_learning_rate=1e-5)
    schedule = make_optimizer(config, 100, model)._learning_rate
    lr = [float(keras.ops.convert_to_numpy(schedule(step))) for step in (0, 5, 10, 55, 100)]
    np.testing.assert_allclose(lr, [0.0, 5e-4, 1e-3, 1e-5 + (1e-3 - 1e-5) * 0.5, 1e-5], rtol=1e-5)


def test_sgd_takes_momentum_steps_without_weight_decay():
    model = ViT(image_size=16, patch_size=4, width=16, depth=1, num_heads=2, mlp_dim=32, num_classes=2)
    config = TrainConfig.from_recipe("small", steps=10, warmup_steps=0, learning_rate=0.1, optimizer="sgd",
                                     momentum=0.5, weight_decay=0.0, grad_clip=0.0)
    optimizer = make_optimizer(config, 10, model)
    assert isinstance(optimizer, keras.optimizers.SGD)
    variable = model.get_layer("stem").projection.kernel
    start = keras.ops.convert_to_numpy(variable).copy()
    ones = [keras.ops.ones(v.shape) for v in model.trainable_variables]
    optimizer.apply(ones, model.trainable_variables)
    optimizer.apply(ones, model.trainable_variables)
    # Keras' SGD: v <- m * v - lr * g, w <- w + v. Two unit gradients move w by lr * (1 + (1 + m)).
    lr = [float(keras.ops.convert_to_numpy(optimizer._learning_rate(step))) for step in (0, 1)]
    expected = start - lr[0] - (lr[0] * 0.5 + lr[1])
    np.testing.assert_allclose(keras.ops.convert_to_numpy(variable), expected, rtol=1e-5)
    with pytest.raises(ValueError, match="Unknown optimizer='adam'.*'adamw', 'sgd'"):
        TrainConfig.from_recipe("small", optimizer="adam")
    with pytest.raises(ValueError, match="momentum=0.9 applies to optimizer='sgd' only"):
        TrainConfig.from_recipe("small", momentum=0.9)


def test_finetune_384_recipe_needs_a_trained_model_and_fine_tunes_it_at_a_new_size(tmp_path):
    with pytest.raises(ValueError, match="fine-tunes a trained model: pass --preset"):
        TrainConfig.from_recipe("finetune_384")
    # A built-in name has no weights: fine-tuning it would train from scratch at the
    # preset's own size, so both fine-tuning recipes refuse it.
    for recipe in ("finetune_384", "vtab_1k"):
        refused = f"'b16' is a built-in architecture without weights.*{recipe}"
        with pytest.raises(ValueError, match=refused):
            TrainConfig.from_recipe(recipe, preset="b16")
    source = ViT(**TINY, num_classes=10)
    source.save_to_preset(tmp_path / "trained")
    config = TrainConfig.from_recipe("finetune_384", preset=str(tmp_path / "trained"))
    assert config.model == {"image_size": 384}
    assert (config.optimizer, config.momentum, config.weight_decay, config.batch_size) == ("sgd", 0.9, 0.0, 512)
    config = TrainConfig.from_recipe(
        "finetune_384", preset=str(tmp_path / "trained"), dataset="digits", model={"image_size": 24},
        steps=6, batch_size=16, warmup_steps=2, steps_per_epoch=3, tensorboard=False,
        output_dir=str(tmp_path / "run"),
    )
    metrics = train(config, verbose=0)
    assert metrics["status"] == "completed"
    tuned = ViT.from_preset(str(tmp_path / "run" / "preset"))
    assert tuned.get_config()["image_size"] == 24
    before = keras.ops.convert_to_numpy(source.get_layer("stem").projection.kernel)
    after = keras.ops.convert_to_numpy(tuned.get_layer("stem").projection.kernel)
    # Fine-tuned from the source's weights: moved, but far less than a fresh init (about sqrt(2)).
    assert 0 < np.linalg.norm(after - before) / np.linalg.norm(before) < 0.5


def test_digits_splits_are_disjoint_and_complete():
    from collections import Counter

    from sklearn.datasets import load_digits

    def examples(split):
        return Counter((x.tobytes(), int(y)) for x, y in zip(*split.arrays))

    data = load_dataset("digits")
    splits = [examples(s) for s in (data.train, data.validation, data.test)]
    assert (data.train.size, data.validation.size, data.test.size) == (1293, 144, 360)
    # Every example is used once: the splits add up to the dataset, duplicates included.
    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype("uint8")[..., None]
    everything = Counter((x.tobytes(), int(y)) for x, y in zip(images, digits.target))
    assert splits[0] + splits[1] + splits[2] == everything
    # The split is fixed (seed 0), whatever the run's seed.
    assert examples(load_dataset("digits").test) == splits[2]


def test_train_examples_is_a_fixed_stratified_subset_of_the_training_split():
    from collections import Counter

    full = load_dataset("digits")
    subset = load_dataset("digits", train_examples=200)
    pairs = [(x.tobytes(), int(y)) for x, y in zip(*subset.train.arrays)]
    assert subset.train.size == len(pairs) == 200
    assert not Counter(pairs) - Counter(
        (x.tobytes(), int(y)) for x, y in zip(*full.train.arrays))
    assert set(Counter(y for _, y in pairs).values()) <= {19, 20, 21}  # 10 classes, balanced
    assert subset.validation.size == full.validation.size and subset.test.size == full.test.size
    again = load_dataset("digits", train_examples=200)
    assert [(x.tobytes(), int(y)) for x, y in zip(*again.train.arrays)] == pairs
    with pytest.raises(ValueError, match="train_examples=5000 is more than the 1293"):
        load_dataset("digits", train_examples=5000)
    with pytest.raises(ValueError, match="train_examples must be a positive integer, got 0"):
        load_dataset("digits", train_examples=0)


def test_train_stream_resumes_with_the_batches_it_would_have_seen(tmp_path):
    data = load_dataset("digits")
    options = dict(image_size=(8, 8), channels=1, batch_size=100, seed=3,
                   augmentation=Augmentation(), end_step=40)
    full = [y for _, y in train_stream(data, start_step=0, **options).take(30).as_numpy_iterator()]
    tail = [y for _, y in train_stream(data, start_step=17, **options).take(13).as_numpy_iterator()]
    for a, b in zip(full[17:], tail):
        np.testing.assert_array_equal(a, b)
    # One pass (1293 examples) never repeats an example: labels over the first 12
    # batches (1200 examples) are a subset of the split's label counts.
    labels = np.concatenate(full[:12]).argmax(-1)
    counts = np.bincount(labels, minlength=10)
    split_counts = np.bincount(data.train.arrays[1], minlength=10)
    assert np.all(counts <= split_counts)


@pytest.mark.parametrize("mixing", [dict(mixup=0.4), dict(mixup=0.4, cutmix=1.0)])
def test_augmented_stream_is_the_same_for_the_same_seed(mixing):
    """With MixUp and CutMix both on, each batch takes one of them by a draw keyed on the
    seed and the step, so the stream repeats (an unseeded draw chose differently)."""
    data = load_dataset("digits")
    options = dict(image_size=(16, 16), channels=1, batch_size=64, seed=5, end_step=6,
                   augmentation=Augmentation(crop="pad", crop_padding=3, flip=True, **mixing))
    first = list(train_stream(data, **options).take(6).as_numpy_iterator())
    second = list(train_stream(data, **options).take(6).as_numpy_iterator())
    assert len(first) == 6
    for (x1, y1), (x2, y2) in zip(first, second):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
    other = next(train_stream(data, **{**options, "seed": 6}).as_numpy_iterator())
    assert not np.array_equal(other[0], first[0][0])


@pytest.mark.parametrize("pipeline, mixing", [
    ("tf.data", dict(mixup=0.4)), ("tf.data", dict(cutmix=1.0)),
    ("python", dict(randaugment_ops=1, mixup=0.4, cutmix=1.0))])
def test_augmentation_is_the_same_under_a_mixed_precision_policy(pipeline, mixing):
    """The augmentation layers compute in float32 whatever the global policy: under
    mixed_bfloat16, Keras' MixUp and CutMix multiplied bfloat16 images by a float32
    draw (a TypeError under tf.data, bfloat16 images elsewhere). (Under tf.data,
    RandAugment draws from a stateful generator, so no second stream repeats it; each
    mixing is tried alone.)"""
    data = load_dataset("digits", pipeline=pipeline)
    augmentation = Augmentation(crop="zoom", flip=True, **mixing)

    def first_batches():
        batches = train_stream(data, (16, 16), 3, 8, 0, augmentation, end_step=2)
        return [tuple(np.asarray(part) for part in batch) for batch, _ in zip(batches, range(2))]

    expected = first_batches()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        mixed = first_batches()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    for (x, y), (x_mixed, y_mixed) in zip(expected, mixed):
        assert x_mixed.dtype == np.float32 and y_mixed.dtype == np.float32
        np.testing.assert_array_equal(x_mixed, x)
        np.testing.assert_array_equal(y_mixed, y)


def test_augmentations_run_and_keep_shapes_and_label_mass():
    data = load_dataset("digits")
    augmentation = Augmentation(crop="pad", crop_padding=2, flip=True, mixup=0.4, cutmix=1.0)
    images, labels = next(iter(train_stream(data, (16, 16), 3, 8, 0, augmentation, end_step=1)))
    assert tuple(images.shape) == (8, 16, 16, 3)
    np.testing.assert_allclose(np.asarray(labels).sum(-1), 1.0, rtol=1e-5)
    assert -1.0 <= float(np.min(images)) and float(np.max(images)) <= 1.0
    rand = Augmentation(crop="zoom", randaugment_ops=2)
    images, _ = next(iter(train_stream(data, (16, 16), 3, 4, 0, rand, end_step=1)))
    assert np.all(np.isfinite(images))
    with pytest.raises(ValueError, match="RandAugment needs RGB"):
        train_stream(data, (16, 16), 1, 4, 0, rand, end_step=1)


def test_randaugment_equalization_counts_its_histogram_with_bincount_in_tf_data():
    """With the fast path `bincount_histogram` on, RandAugment's Equalization counts each
    value's bin inside tf.data with bincount, on every backend, as Keras counts it, and
    outside tf.data with the backend's; switched off, the layer is Keras' own; a
    layer without Keras' private histogram method (another Keras version) is left as
    it is."""
    import tensorflow as tf

    from keras_vitnorm.ops import fast_paths
    from keras_vitnorm.training.data import tf_pipeline

    with fast_paths(False, ["bincount_histogram"]):
        kept = tf_pipeline._stateful_augmentation(Augmentation(randaugment_ops=1), 3, 0)[0]
    assert "_custom_histogram_fixed_width" not in vars(kept.equalization)  # Keras' method
    equalization = tf_pipeline._stateful_augmentation(
        Augmentation(randaugment_ops=1), 3, 0)[0].equalization
    if not hasattr(type(equalization), "_custom_histogram_fixed_width"):
        pytest.skip("this Keras has no Equalization._custom_histogram_fixed_width to replace")
    assert "_custom_histogram_fixed_width" in vars(equalization)  # replaced on this layer
    values = np.random.default_rng(0).uniform(0, 255, (16, 16)).astype("float32")
    values[0, :3] = [0.0, 255.0, 127.5]  # both ends of the range and a midpoint
    expected = np.bincount(np.clip((values * (256 - 1) / 255).astype("int32"), 0, 255).ravel(),
                           minlength=256)
    equalization.backend.set_backend("tensorflow")  # as RandAugment sets it in tf.data
    counted = next(iter(tf.data.Dataset.from_tensors(values).map(
        lambda channel: equalization._custom_histogram_fixed_width(channel, (0, 255), 256))))
    np.testing.assert_array_equal(np.asarray(counted), expected)
    equalization.backend.set_backend(keras.backend.backend())
    eager = equalization._custom_histogram_fixed_width(values, (0, 255), 256)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(eager), expected)

    class OtherEqualization:
        pass

    other = OtherEqualization()
    assert not tf_pipeline.count_histograms_with_bincount(other) and vars(other) == {}
    assert not tf_pipeline.count_histograms_with_bincount(None)


# ----------------------------------------------------------------------------- runs


def test_tiny_model_trains_on_digits_and_beats_chance(tmp_path):
    config = tiny_config(tmp_path, steps=120, steps_per_epoch=30, warmup_steps=5,
                         learning_rate=1e-2)
    metrics = train(config, verbose=0)
    out = tmp_path / "run"
    assert metrics["status"] == "completed" and metrics["steps"] == 120
    # Chance is 0.1; this 1-block width-32 model reached 0.41-0.54 over seeds 0-2 (JAX).
    assert metrics["test_accuracy"] > 0.25, metrics
    assert json.loads((out / "metrics.json").read_text())["test_accuracy"] == metrics["test_accuracy"]
    rows = (out / "log.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 4 and rows[0].startswith("epoch")
    assert ViT.from_preset(str(out / "checkpoints" / "best")).count_params() > 0
    assert (out / "checkpoints" / "last" / "model.weights.npz").exists()
    assert not (out / "backup").exists()
    # The saved preset scores the same on the test split.
    scored = evaluate(str(out), verbose=0)
    assert scored["examples"] == 360
    assert scored["accuracy"] == pytest.approx(metrics["test_accuracy"], abs=1e-6)
    reloaded = ViT.from_preset(str(out / "preset"))
    assert reloaded.get_config()["num_channels"] == 1


@pytest.mark.one_backend
def test_evaluate_reproduces_the_metrics_a_run_reported(tmp_path):
    """`evaluate` on a run directory scores its model as the run's final evaluation did:
    with its loss (label smoothing), its dtype policy and its input pipeline."""
    config = tiny_config(tmp_path, steps=2, label_smoothing=0.2, mixed_precision="mixed_bfloat16",
                         input_pipeline="python")
    metrics = train(config, verbose=0)
    for split, key in (("test", "test"), ("validation", "val")):
        scored = evaluate(str(tmp_path / "run"), split=split, verbose=0)
        assert scored["accuracy"] == metrics[f"{key}_accuracy"], split
        assert scored["loss"] == pytest.approx(metrics[f"{key}_loss"], rel=1e-5), split
    assert keras.config.dtype_policy().name == "float32"  # restored


def test_tensorboard_and_mixed_bfloat16(tmp_path):
    config = tiny_config(tmp_path, steps=3, tensorboard=True, mixed_precision="mixed_bfloat16")
    metrics = train(config, verbose=0)
    assert np.isfinite(metrics["val_loss"])
    assert os.listdir(tmp_path / "run" / "tensorboard" / "train")
    assert keras.config.dtype_policy().name == "float32"  # restored after the run


def test_resume_after_kill_finishes_the_planned_steps_without_starting_over(tmp_path):
    output = tmp_path / "killed"
    code = f"""
        import os, signal, keras
        from keras_vitnorm.training import TrainConfig, train

        class Kill(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)) == 17:
                    os.kill(os.getpid(), signal.SIGKILL)

        config = TrainConfig.from_recipe(
            "small", model={TINY!r}, steps=40, steps_per_epoch=10, batch_size=32,
            warmup_steps=2, backup_every=3, tensorboard=False, output_dir={str(output)!r})
        train(config, callbacks=[Kill()], verbose=0)
    """
    killed = run_python(code)
    assert killed.returncode == -9, killed.stderr[-3000:]
    state = json.loads((output / "backup" / "step-000000016" / "state.json").read_text())
    assert {key: state[key] for key in ("epoch", "batch", "step")} == {"epoch": 1, "batch": 6, "step": 16}
    assert state["train_seconds"] > 0
    assert not (output / "metrics.json").exists()

    class Count(keras.callbacks.Callback):
        steps = 0

        def on_train_batch_end(self, batch, logs=None):
            Count.steps += 1

    config = TrainConfig.from_recipe(
        "small", model=TINY, steps=40, steps_per_epoch=10, batch_size=32, warmup_steps=2,
        backup_every=3, tensorboard=False, output_dir=str(output))
    with pytest.raises(FileExistsError, match="--resume"):
        train(config, verbose=0)
    metrics = train(config, resume=True, callbacks=[Count()], verbose=0)
    assert Count.steps == 40 - 16
    assert metrics["steps"] == 40 and metrics["resumed_from_step"] == 16
    # The training time covers the steps of both runs: the killed one's up to its checkpoint.
    assert metrics["train_seconds"] == pytest.approx(
        state["train_seconds"] + metrics["train_seconds_this_run"], abs=0.05)
    epochs = [line.split(",")[0] for line in (output / "log.csv").read_text().splitlines()[1:]]
    assert epochs == ["0", "1", "2", "3"]
    assert train(config, resume=True, verbose=0) == metrics  # completed: nothing to do


def test_resume_refuses_changed_settings(tmp_path):
    config = tiny_config(tmp_path, steps=2)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train_config.json").write_text(tiny_config(tmp_path, steps=3).to_json())
    with pytest.raises(ValueError, match="steps: saved 3, now 2"):
        train(config, resume=True, verbose=0)


def test_nan_loss_stops_with_the_step(tmp_path):
    config = tiny_config(tmp_path, steps=6, learning_rate=1e38, warmup_steps=0, grad_clip=0)
    with pytest.raises(TrainingDiverged, match="at step 2 \\(epoch 1, batch 2\\)") as error:
        train(config, verbose=0)
    assert error.value.step == 2
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["status"] == "diverged" and metrics["diverged_at_step"] == 2
    assert not (tmp_path / "run" / "checkpoints" / "last").exists()
    assert not (tmp_path / "run" / "preset").exists()


def test_existing_output_dir_is_refused_unless_overwrite(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    config = tiny_config(tmp_path, steps=2)
    with pytest.raises(FileExistsError, match="already exists"):
        train(config, verbose=0)
    assert (out / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="not a keras-vitnorm run"):
        train(config, resume=True, verbose=0)
    # --overwrite deletes runs only, never a directory of the user's own files.
    with pytest.raises(FileExistsError, match="holds files that are not a keras-vitnorm run"):
        train(config, overwrite=True, verbose=0)
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    train(config, verbose=0)
    (out / "grad_norms.csv").write_text("step,group,norm\n")  # as a run of other settings left it
    train(config, overwrite=True, verbose=0)
    assert not (out / "grad_norms.csv").exists()  # the old run was deleted
    assert json.loads((out / "metrics.json").read_text())["status"] == "completed"
    assert not (out / "run.lock").exists()  # a finished run holds no lock file
    assert_unlocked(out)


def test_tfds_dataset_on_mock_data(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=64):
        data = load_dataset("tfds:cifar10")
        assert (data.num_classes, data.channels) == (10, 3)
        assert data.test.name == "test" and data.train.name == "train[:90%]"
        metrics = train(tiny_config(tmp_path, dataset="tfds:cifar10", steps=3, batch_size=16),
                        verbose=0)
    assert metrics["dataset"] == "tfds:cifar10" and metrics["steps"] == 3
    assert np.isfinite(metrics["test_loss"])
    with pytest.raises(ValueError, match="Unknown tensorflow-datasets dataset 'cifar_ten'"):
        load_dataset("tfds:cifar_ten")


def write_image_folder(root, classes=("cat", "dog", "eel"), per_class=10, size=12):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    for index, name in enumerate(classes):
        os.makedirs(root / name, exist_ok=True)
        for i in range(per_class):
            image = rng.integers(0, 60, (size, size, 3)).astype("uint8")
            image[..., index] += 150  # each class has its own dominant colour
            tf.io.write_file(str(root / name / f"{i}.png"), tf.io.encode_png(image))


def test_folder_dataset_splits_and_trains(tmp_path):
    root = tmp_path / "images"
    write_image_folder(root)
    (root / "cat" / "readme.txt").write_text("not an image")
    data = load_dataset(f"folder:{root}")
    assert data.class_names == ["cat", "dog", "eel"] and data.channels == 3
    files = [set(map(str, s.arrays[0])) for s in (data.train, data.validation, data.test)]
    assert sum(map(len, files)) == 30
    assert not (files[0] & files[1] or files[0] & files[2] or files[1] & files[2])
    metrics = train(tiny_config(tmp_path, dataset=f"folder:{root}", steps=30, batch_size=8,
                                learning_rate=1e-2), verbose=0)
    assert metrics["class_names"] == ["cat", "dog", "eel"]
    assert metrics["test_accuracy"] > 0.34  # colours separate the classes; chance is 1/3


def test_folder_with_train_and_test_subfolders(tmp_path):
    write_image_folder(tmp_path / "data" / "train")
    write_image_folder(tmp_path / "data" / "test", per_class=4)
    data = load_dataset(f"folder:{tmp_path / 'data'}", val_fraction=0.2)
    assert (data.train.size, data.validation.size, data.test.size) == (24, 6, 12)
    write_image_folder(tmp_path / "data" / "test", classes=("zebra",), per_class=1)
    with pytest.raises(ValueError, match="zebra"):
        load_dataset(f"folder:{tmp_path / 'data'}")
    with pytest.raises(ValueError, match="does not exist"):
        load_dataset(f"folder:{tmp_path / 'nowhere'}")


# ----------------------------------------------------------------------------- CLI


def cli_error(capsys, *argv):
    try:
        status = cli.main(list(argv))
    except SystemExit as exit:
        status = exit.code
    return status, capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--preset", "s16_dpm"], "Did you mean 's16_dpn'"),
        (["--dataset", "mnist"], "Unknown dataset='mnist'"),
        (["--dataset", "folder:/no/such/dir", "--steps", "2"], "does not exist"),
        (["--epochs", "0"], "epochs must be a positive integer, got 0"),
        (["--label-smoothing", "1.5"], "label_smoothing must be a number in [0.0, 1.0)"),
        (["--set", "depht=2"], "Unknown model setting(s) ['depht']"),
        (["--set", "num_heads=5"], "num_heads"),
        (["--steps", "5", "--warmup-steps", "100"],
         "warmup_steps=100 leaves no steps to decay over: the run has 5 steps. Pass "
         "--warmup-steps 0 (a tenth of the run; any below 5 works)"),
        (["--norm", "rmsnrom"], "argument --norm: invalid choice: 'rmsnrom'. Did you mean "
                                "'rmsnorm'? Valid: layernorm, rmsnorm,"),
        (["--recipe", "big"], "invalid choice: 'big'"),
        (["--crop", "zom"], "invalid choice: 'zom'. Did you mean 'zoom'?"),
        (["--learning-rat", "1"], "unrecognized arguments"),
        (["--resume", "--overwrite"], "not allowed with argument"),
        (["--train-examples", "-3"], "train_examples must be a positive integer, got -3"),
    ],
)
def test_bad_cli_arguments_exit_nonzero_with_a_clear_message(capsys, tmp_path, argv, message):
    status, err = cli_error(capsys, "train", "--output-dir", str(tmp_path / "x"), *argv)
    assert status == 2
    assert message in err
    # one line, not argparse's usage of every option before it
    assert len(err.strip().splitlines()) == 1 and "usage:" not in err, err
    assert not (tmp_path / "x").exists()


def test_console_command_exit_status():
    result = subprocess.run(
        [sys.executable, "-m", "keras_vitnorm", "train", "--preset", "nope"],
        cwd=ROOT, env={**os.environ, "KERAS_BACKEND": BACKEND}, capture_output=True,
        text=True, timeout=300,
    )
    assert result.returncode == 2
    assert "Unknown preset 'nope'" in result.stderr


def test_cli_train_then_evaluate(capsys, tmp_path):
    out = str(tmp_path / "cli")
    status = cli.main(["train", "--output-dir", out, "--steps", "3", "--warmup-steps", "1", "--verbose", "0",
                       "--no-tensorboard", *sum((["--set", f"{k}={v}"] for k, v in TINY.items()), [])])
    assert status == 0
    assert cli.main(["evaluate", out, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    metrics = json.loads(open(os.path.join(out, "metrics.json")).read())
    assert result["accuracy"] == pytest.approx(metrics["test_accuracy"], abs=1e-6)
    status, err = cli_error(capsys, "train", "--output-dir", out, "--steps", "3", "--warmup-steps", "1")
    assert status == 2 and "already exists" in err
    status, err = cli_error(capsys, "evaluate", out, "--dataset", f"folder:{tmp_path}")
    assert status == 2


TINY_ARGV = ["--steps", "2", "--batch-size", "32", "--warmup-steps", "1", "--no-tensorboard",
             *(f"--{key.replace('_', '-')}={value}" for key, value in TINY.items())]


def test_progress_is_a_bar_on_a_terminal_and_one_line_per_epoch_elsewhere():
    import io

    from keras_vitnorm.training.fit_loop import progress_verbosity

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert progress_verbosity(1, Terminal()) == 1
    assert progress_verbosity(1, io.StringIO()) == 2  # a file or a pipe
    assert progress_verbosity(0, io.StringIO()) == 0 and progress_verbosity(2, Terminal()) == 2


@pytest.mark.one_backend
def test_train_writes_one_line_per_epoch_to_a_log_file(tmp_path):
    """`train`'s default verbosity piped to a file: Keras' bar redrawn in place would run
    every step of an epoch together in one line; one line per epoch instead."""
    import subprocess

    log = tmp_path / "train.log"
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-m", "keras_vitnorm", "train", *TINY_ARGV,
                               "--steps-per-epoch", "1", "--output-dir", str(tmp_path / "run")],
                              stdout=f, stderr=subprocess.STDOUT, timeout=600)
    text = log.read_text()
    assert done.returncode == 0, text[-2000:]
    epochs = [line for line in text.splitlines() if line.startswith("1/1 - ")]
    assert len(epochs) == 2, text[-2000:]
    assert "\r" not in text and "\x08" not in text and "━" not in text


@pytest.mark.one_backend
def test_resume_without_output_dir_finds_the_latest_unfinished_run_of_its_settings(
        tmp_path, monkeypatch, capsys):
    from keras_vitnorm.cli import build_parser
    from keras_vitnorm.training import run_directory

    monkeypatch.chdir(tmp_path)
    argv = ["train", *TINY_ARGV, "--verbose", "2"]
    status, err = cli_error(capsys, *argv, "--resume")
    assert status == 2, err
    assert "no unfinished run of these settings in runs" in err and "--output-dir" in err
    status, err = cli_error(capsys, *argv, "--resume", "--output-dir", "runs/nowhere")
    assert status == 2 and "runs/nowhere holds no run" in err, err
    assert not (tmp_path / "runs").exists()  # a failed resume leaves nothing behind

    config = train_config_from_argv(build_parser, argv)
    other = train_config_from_argv(build_parser, [*argv, "--steps", "3"])
    runs = {}
    for stamp, settings, status in (("20240101-000000", config, None),
                                    ("20240102-000000", config, None),
                                    ("20240103-000000", other, None),
                                    ("20240104-000000", config, "completed")):
        runs[stamp] = path = tmp_path / "runs" / f"ti16-digits-{stamp}"
        path.mkdir(parents=True)
        run_directory.prepare(settings, str(path), resume=False, overwrite=False)
        if status:
            (path / "metrics.json").write_text(json.dumps({"status": status}))
    assert cli.main([*argv, "--resume"]) == 0
    out = capsys.readouterr().out
    latest = os.path.join("runs", "ti16-digits-20240102-000000")
    assert f"Resuming {latest}, the latest unfinished run of these settings" in out
    assert json.loads((runs["20240102-000000"] / "metrics.json").read_text())["steps"] == 2
    assert not (runs["20240101-000000"] / "metrics.json").exists()
    assert len(os.listdir(tmp_path / "runs")) == 4


@pytest.mark.one_backend
def test_a_small_image_folder_trains_with_the_recipes_defaults_fitted_to_it(tmp_path, capsys):
    """3 classes of 20 images: 43 to train on, fewer than the recipe's batch of 64, and
    30 steps, fewer than its 100 warm-up steps. Defaults the user did not set are
    fitted, with a note; the same values given as flags are errors that name a value
    that works."""
    root = tmp_path / "images"
    write_image_folder(root, per_class=20)
    argv = ["train", "--dataset", f"folder:{root}", "--no-tensorboard", "--verbose", "2",
            *(f"--{key.replace('_', '-')}={value}" for key, value in TINY.items())]
    assert cli.main([*argv, "--output-dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert ("Note: batch size 32 instead of the recipe's 64, which is more than the 43 "
            "training examples (--batch-size sets it).") in out
    assert ("Note: 3 warm-up steps instead of the recipe's 100, which leave no steps to decay "
            "over in the run's 30 (--warmup-steps sets it).") in out
    settings = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert (settings["batch_size"], settings["warmup_steps"]) == (32, 3)
    status, err = cli_error(capsys, *argv, "--batch-size", "64", "--output-dir",
                            str(tmp_path / "x"))
    assert status == 2 and ("batch_size=64 is more than the 43 training examples of "
                            f"folder:{root}: each batch would repeat examples. Pass "
                            "--batch-size 43 or less") in err, err
    # with --steps-per-epoch too: a batch that repeats examples is refused all the same
    status, err = cli_error(capsys, *argv, "--batch-size", "64", "--steps-per-epoch", "5",
                            "--output-dir", str(tmp_path / "x"))
    assert status == 2 and "each batch would repeat examples" in err, err
    status, err = cli_error(capsys, *argv, "--warmup-steps", "100", "--output-dir",
                            str(tmp_path / "x"))
    assert status == 2 and "Pass --warmup-steps 3 (a tenth of the run; any below 30 works)" \
        in err, err
    assert not (tmp_path / "x").exists()


@pytest.mark.one_backend
def test_resume_without_a_checkpoint_refuses_to_train_a_trained_run_again(tmp_path, capsys):
    """A run whose metrics.json was deleted, or whose checkpoints were, has no step to
    resume from: resuming would train it from step 0 and replace what it has. Only a
    run killed before its first checkpoint starts again from step 0, and says so."""
    config = tiny_config(tmp_path, steps=4, steps_per_epoch=2)
    train(config, verbose=0)
    run = tmp_path / "run"
    (run / "metrics.json").unlink()
    saved = (run / "preset" / "model.weights.npz").read_bytes()
    with pytest.raises(ValueError, match=f"Cannot resume {run}: it has no checkpoint to resume "
                       r"from but a final model \(preset/\): it finished, and its metrics.json "
                       r"is gone.*--overwrite"):
        train(config, resume=True, verbose=0)
    assert (run / "preset" / "model.weights.npz").read_bytes() == saved
    shutil.rmtree(run / "preset")
    with pytest.raises(ValueError, match=f"Cannot resume {run}: it has no checkpoint to resume "
                       r"from, but log.csv records 2 trained epochs.*--overwrite"):
        train(config, resume=True, verbose=0)
    fresh = tiny_config(tmp_path, name="fresh", steps=2)
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "train_config.json").write_text(fresh.to_json())
    assert train(fresh, resume=True, verbose=1)["steps"] == 2
    assert "No checkpoint yet (the run stopped before its first): training from step 0." in (
        capsys.readouterr().out)


def train_config_from_argv(build_parser, argv):
    from keras_vitnorm.cli import train_config_from_args

    return train_config_from_args(build_parser().parse_args(argv))


# ----------------------------------------------------------------------------- devices


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution.DataParallel is JAX-only")
def test_data_parallel_matches_single_device_after_one_step(tmp_path):
    code = f"""
        import json, jax, numpy as np
        from keras_vitnorm.training import TrainConfig, train
        assert jax.device_count() == 4, jax.devices()
        results = {{}}
        for distribute in (False, True):
            config = TrainConfig.from_recipe(
                "small", model={TINY!r}, steps=1, batch_size=16, warmup_steps=0,
                learning_rate=1e-2, crop="none", label_smoothing=0.0, tensorboard=False,
                distribute=distribute, output_dir={str(tmp_path)!r} + f"/dp{{int(distribute)}}")
            metrics = train(config, verbose=0)
            weights = np.load({str(tmp_path)!r} + f"/dp{{int(distribute)}}/preset/model.weights.npz")
            results[distribute] = (metrics, weights)
        (m0, w0), (m1, w1) = results[False], results[True]
        assert m1["replicas"] == 4 and m0["replicas"] == 1
        print(json.dumps({{
            "val_loss": [m0["val_loss"], m1["val_loss"]],
            "weight_diff": max(float(np.max(np.abs(w0[k] - w1[k]))) for k in w0.files),
            "weight_change": max(float(np.max(np.abs(w0[k]))) for k in w0.files),
        }}))
    """
    result = run_python(code, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    single, parallel = report["val_loss"]
    assert parallel == pytest.approx(single, rel=1e-5, abs=1e-6)
    assert report["weight_diff"] < 1e-5


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution.ModelParallel is JAX-only")
def test_fsdp_shards_the_kernels_and_matches_single_device_over_three_steps(tmp_path):
    code = f"""
        import json, jax, numpy as np
        from keras_vitnorm import ViT
        from keras_vitnorm.training import TrainConfig, train
        from keras_vitnorm.training.distribution import distribution_scope
        scope, replicas = distribution_scope("fsdp")
        with scope:
            model = ViT(**{TINY!r}, num_classes=10)
        specs = {{v.path: [str(a) for a in v.value.sharding.spec] for v in model.weights}}
        results = {{}}
        for distribute in (False, "fsdp"):
            # DPN's stem: with the plain stem, digits' constant borders give the patch
            # kernel near-zero gradients whose float32 sums differ in the last bits by
            # device count, which AdamW's normalized step turns into 4.8e-5 (3.7e-7 here).
            config = TrainConfig.from_recipe(
                "small", preset="ti16_dpn", model={TINY!r}, steps=3, batch_size=16,
                warmup_steps=0,
                learning_rate=1e-2, crop="none", label_smoothing=0.0, tensorboard=False,
                distribute=distribute, output_dir={str(tmp_path)!r} + f"/{{distribute}}")
            metrics = train(config, verbose=0)
            results[distribute] = (metrics, np.load({str(tmp_path)!r} + f"/{{distribute}}/preset/model.weights.npz"))
        (m0, w0), (m1, w1) = results[False], results["fsdp"]
        print(json.dumps({{
            "replicas": [replicas, m1["replicas"]], "specs": specs,
            "val_loss": [m0["val_loss"], m1["val_loss"]],
            "weight_diff": max(float(np.max(np.abs(w0[k] - w1[k]))) for k in w0.files),
        }}))
    """
    result = run_python(code, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["replicas"] == [4, 4]
    specs = report["specs"]
    for path in ("block_0/attention/qkv/kernel", "block_0/attention/out/kernel", "block_0/mlp/fc1/kernel",
                 "block_0/mlp/fc2/kernel", "head/kernel"):
        assert specs[path][0] == "batch", (path, specs[path])
    assert "batch" not in specs["stem/position_embedding"] and "batch" not in specs["block_0/mlp/fc1/bias"]
    single, sharded = report["val_loss"]
    assert sharded == pytest.approx(single, rel=1e-5, abs=1e-6)
    assert report["weight_diff"] < 1e-5


def test_distribute_values_are_checked_and_fsdp_is_jax_only(tmp_path, capsys):
    with pytest.raises(ValueError, match="distribute='zero3'. Valid values: 'data', 'fsdp'"):
        tiny_config(tmp_path, distribute="zero3")
    status, err = cli_error(capsys, "train", "--distribute", "zero3")
    assert status == 2 and "invalid choice: 'zero3'" in err
    if BACKEND != "jax":
        with pytest.raises(ValueError, match="distribute='fsdp' is available on the JAX backend only"):
            train(tiny_config(tmp_path, steps=2, distribute="fsdp"), verbose=0)
        assert not (tmp_path / "run").exists()


#: A short run of the tiny model on digits that several processes split: 6 steps of 32.
SPLIT_RUN_ARGV = [
    "train", "--steps", "6", "--steps-per-epoch", "3", "--batch-size", "32", "--warmup-steps", "1",
    "--lr", "3e-3", "--flip", "--no-tensorboard", "--verbose", "0",
    "--image-size", str(TINY["image_size"]), "--patch-size", str(TINY["patch_size"]),
    "--width", str(TINY["width"]), "--depth", str(TINY["depth"]),
    "--num-heads", str(TINY["num_heads"]), "--mlp-dim", str(TINY["mlp_dim"])]


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finish_together(children, timeout=600):
    """`[(exit code, stderr), ...]` of `children` (stderr piped); all are killed if they
    have not ended within `timeout` seconds together."""
    deadline = time.monotonic() + timeout
    try:
        # communicate() drains each pipe, so a child's full pipe cannot block it.
        errors = [child.communicate(timeout=max(1.0, deadline - time.monotonic()))[1]
                  for child in children]
        return [(child.returncode, error) for child, error in zip(children, errors)]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def train_in_one_process(run_dir):
    single = run_python(f"""
        from keras_vitnorm.cli import main
        raise SystemExit(main({SPLIT_RUN_ARGV + ["--output-dir", str(run_dir)]!r}))
    """)
    assert single.returncode == 0, single.stderr[-3000:]


def assert_same_run(one, two):
    """Run `two` (several processes) ended as run `one` (one process) did, to float32
    rounding: the same steps, validation loss, test accuracy and weights. Returns
    `two`'s metrics."""
    one_metrics = json.loads((one / "metrics.json").read_text())
    two_metrics = json.loads((two / "metrics.json").read_text())
    assert two_metrics["steps"] == one_metrics["steps"] == 6
    assert two_metrics["val_loss"] == pytest.approx(one_metrics["val_loss"], rel=1e-5)
    assert two_metrics["test_accuracy"] == one_metrics["test_accuracy"]
    w1 = np.load(one / "preset" / "model.weights.npz")
    w2 = np.load(two / "preset" / "model.weights.npz")
    assert sorted(w1.files) == sorted(w2.files)
    for key in w1.files:
        np.testing.assert_allclose(w2[key], w1[key], atol=2e-5, err_msg=key)
    return two_metrics


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution.initialize is JAX's")
def test_two_jax_processes_train_as_one_process_and_resume(tmp_path):
    """2 local processes (keras.distribution.initialize, one CPU device each), both
    killed in the final evaluation and resumed: the first restores the last checkpoint
    and shares it; weights and validation loss are one process's, to float32 rounding."""
    argv = SPLIT_RUN_ARGV
    train_in_one_process(tmp_path / "one")

    def two_processes(*extra, env=()):
        port = str(free_port())
        children = [subprocess.Popen(
            [sys.executable, "-m", "keras_vitnorm", *argv, "--distribute",
             "--output-dir", str(tmp_path / "two"), *extra],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "KERAS_BACKEND": "jax", "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"localhost:{port}",
                 "KERAS_DISTRIBUTION_NUM_PROCESSES": "2", "KERAS_DISTRIBUTION_PROCESS_ID": str(index),
                 **dict(env)}) for index in range(2)]
        return finish_together(children)

    killed = two_processes(env={durable.FAULT_ENV: "final:evaluated"})
    assert [code for code, _ in killed] == [-9, -9], killed[0][1][-3000:]
    resumed = two_processes("--resume", "--take-over-lock")
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-3000:] + resumed[1][1][-3000:]
    two_metrics = assert_same_run(tmp_path / "one", tmp_path / "two")
    assert two_metrics["replicas"] == 2 and two_metrics["resumed_from_step"] == 6


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.distribute is the TensorFlow backend's")
def test_mirrored_strategy_matches_single_device_after_one_step(tmp_path):
    code = f"""
        import json, numpy as np, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        from keras_vitnorm.training import TrainConfig, train
        results = {{}}
        for distribute in (False, True):
            out = {str(tmp_path)!r} + f"/mirrored{{int(distribute)}}"
            config = TrainConfig.from_recipe(
                "small", model={TINY!r}, steps=1, batch_size=16, warmup_steps=0,
                learning_rate=1e-2, crop="none", label_smoothing=0.0, tensorboard=False,
                distribute=distribute, output_dir=out)
            results[distribute] = (train(config, verbose=0), np.load(out + "/preset/model.weights.npz"))
        (m0, w0), (m1, w1) = results[False], results[True]
        print(json.dumps({{
            "replicas": [m0["replicas"], m1["replicas"]],
            "val_loss": [m0["val_loss"], m1["val_loss"]],
            "weight_diff": max(float(np.max(np.abs(w0[k] - w1[k]))) for k in w0.files),
        }}))
    """
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["replicas"] == [1, 2]
    # The zero-initialized head gets the only non-zero gradients in step one, and
    # Adam's first step moves every element by +-lr whatever its gradient's size, so
    # elements whose gradient is rounding noise (~1e-9) can flip sign when two replicas
    # sum it in another order (measured: head/kernel differs by 2*lr, every other
    # weight by < 1e-6). Step one moves the validation loss by ~0.013; the runs must
    # agree to a third of that, and no weight may differ by more than one flipped step.
    single, parallel = report["val_loss"]
    assert parallel == pytest.approx(single, rel=2e-3)
    assert report["weight_diff"] <= 2 * 1e-2 + 1e-6


@pytest.mark.skipif(BACKEND != "torch", reason="torchrun processes are the torch backend's")
def test_distribute_on_torch_outside_torchrun_says_how_to_start_it(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="one process per device: start it with torchrun"):
        train(tiny_config(tmp_path, steps=2, distribute=True), verbose=0)
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(BACKEND != "torch", reason="torchrun processes are the torch backend's")
def test_two_torchrun_processes_train_as_one_process_on_the_same_global_batch(tmp_path):
    """torchrun with 2 CPU processes (gloo), each on half of every batch of 32, killed
    and resumed: the same weights and validation loss as one process, to float32
    rounding; only the first process writes the run (log, checkpoints, preset, metrics)."""
    argv = SPLIT_RUN_ARGV
    train_in_one_process(tmp_path / "one")

    def torchrun(*extra, env=()):
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(free_port()), "-m", "keras_vitnorm", *argv, "--distribute",
             "--output-dir", str(tmp_path / "two"), *extra],
            cwd=ROOT, env={**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1", **dict(env)},
            capture_output=True, text=True, timeout=600,
        )

    # Killed after the first checkpoint, then resumed: the first process restores it
    # and hands the weights, optimizer state and position to the other.
    killed = torchrun(env={durable.FAULT_ENV: "checkpoint:renamed@1"})
    assert killed.returncode != 0 and (tmp_path / "two" / "backup" / "step-000000003").is_dir()
    two = torchrun("--resume", "--take-over-lock")
    assert two.returncode == 0, two.stderr[-3000:]
    two_metrics = assert_same_run(tmp_path / "one", tmp_path / "two")
    assert two_metrics["replicas"] == 2 and two_metrics["resumed_from_step"] == 3
    assert len((tmp_path / "two" / "log.csv").read_text().splitlines()) == 3  # header + 2 epochs
    assert_unlocked(tmp_path / "two")


@pytest.mark.skipif(BACKEND != "torch", reason="torchrun runs the PyTorch backend")
def test_two_torchrun_processes_with_dropout_resume_to_the_uninterrupted_run(tmp_path):
    """Dropout draws from each process's PyTorch generator: a resumed run gives every
    process the restored state, so its weights are the uninterrupted run's."""
    argv = [*SPLIT_RUN_ARGV, "--set", "dropout=0.2"]

    def torchrun(run_dir, *extra, env=()):
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(free_port()), "-m", "keras_vitnorm", *argv, "--distribute",
             "--output-dir", str(run_dir), *extra],
            cwd=ROOT, env={**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1", **dict(env)},
            capture_output=True, text=True, timeout=600,
        )

    whole = torchrun(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = torchrun(tmp_path / "resumed", env={durable.FAULT_ENV: "checkpoint:renamed@1"})
    assert killed.returncode != 0
    resumed = torchrun(tmp_path / "resumed", "--resume", "--take-over-lock")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    w1 = np.load(tmp_path / "whole" / "preset" / "model.weights.npz")
    w2 = np.load(tmp_path / "resumed" / "preset" / "model.weights.npz")
    for key in w1.files:
        np.testing.assert_array_equal(w2[key], w1[key], err_msg=key)


def test_the_start_line_names_the_model_settings_that_differ_from_the_preset():
    # The default recipe cuts every built-in preset down; the line that opens a run says
    # so rather than name the preset alone.
    from keras_vitnorm.training.trainer import describe_model

    config = TrainConfig.from_recipe("small", preset="s16_dpn")
    assert describe_model(config) == ("s16_dpn with depth=6, image_size=32, mlp_dim=384, "
                                      "patch_size=8, width=96")
    config.model = {}
    assert describe_model(config) == "s16_dpn"
