"""A run survives any kill: fault injection at every writing stage, one writer per run,
storage errors, and clear errors for damaged files and image folders.

The fault harness runs a tiny training in a child process with `KERAS_VITNORM_FAULT`
naming a stage (`keras_vitnorm.durable.fault_point`), where the child kills itself with
SIGKILL, then resumes the run here and compares its final weights, bit for bit, with
an uninterrupted run of the same seed.
"""

import errno
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from keras_vitnorm import ViT
from keras_vitnorm import cli
from keras_vitnorm import durable
from keras_vitnorm.training import TrainConfig
from keras_vitnorm.training import evaluate
from keras_vitnorm.training import load_dataset
from keras_vitnorm.training import train
from keras_vitnorm.training.run_files import LockedError
from keras_vitnorm.training.run_files import StorageError
from test_training import TINY
from test_training import assert_unlocked
from test_training import run_python
from test_training import write_image_folder

# 12 steps in epochs of 4, a backup every 3 steps: checkpoints at steps 3, 4, 7, 8, 11, 12.
# Crops, flips, dropout and drop path: every source of randomness a step has.
RUN = dict(model={**TINY, "dropout": 0.1}, drop_path=0.1, steps=12, steps_per_epoch=4,
           backup_every=3, batch_size=32, warmup_steps=1, learning_rate=3e-3, flip=True,
           grad_norm_every=2, tensorboard=False)


def run_config(output_dir, **overrides):
    return TrainConfig.from_recipe("small", **{**RUN, "output_dir": str(output_dir), **overrides})


def final_weights(run_dir):
    with np.load(os.path.join(run_dir, "preset", "model.weights.npz")) as archive:
        return {key: archive[key] for key in archive.files}


def csv_rows(path):
    return [line for line in open(path).read().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its final weights, metrics, log and gradient-norm records."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    metrics = train(run_config(run_dir), verbose=0)
    return {
        "weights": final_weights(run_dir),
        "metrics": metrics,
        "log": csv_rows(run_dir / "log.csv"),
        "grad_norms": csv_rows(run_dir / "grad_norms.csv"),
    }


def killed_at(stage, run_dir, extra="", **overrides):
    """Trains `run_dir` (RUN with `overrides`) in a child process that kills itself at `stage`."""
    code = f"""
        from keras_vitnorm.training import TrainConfig, train
        config = TrainConfig.from_recipe("small", **{dict(RUN, output_dir=str(run_dir), **overrides)!r})
        {extra}
        train(config, verbose=0)
    """
    child = run_python(code, env={durable.FAULT_ENV: stage})
    assert child.returncode == -signal.SIGKILL, (stage, child.stderr[-3000:])


def assert_same_as_reference(run_dir, reference):
    weights = final_weights(run_dir)
    assert sorted(weights) == sorted(reference["weights"])
    for key, value in reference["weights"].items():
        np.testing.assert_array_equal(weights[key], value, err_msg=key)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["steps"] == 12
    assert metrics["test_accuracy"] == reference["metrics"]["test_accuracy"]
    log = csv_rows(run_dir / "log.csv")
    assert [row.split(",")[0] for row in log] == [row.split(",")[0] for row in reference["log"]]
    # Validation columns are exact; a resumed epoch's training columns average only the
    # batches run after the resume (Keras resets its metrics at each epoch start).
    header = log[0].split(",")
    for column in ("val_accuracy", "val_loss"):
        index = header.index(column)
        assert [r.split(",")[index] for r in log[1:]] == [
            r.split(",")[index] for r in reference["log"][1:]
        ]
    assert csv_rows(run_dir / "grad_norms.csv") == reference["grad_norms"]
    assert not (run_dir / "backup").exists()
    assert_unlocked(run_dir)


STAGES = [
    "checkpoint:begin@1",   # before the first checkpoint: starts again from step 0
    "checkpoint:weights@3",  # weights of step 7 written, its state not yet
    "checkpoint:state@3",    # step 7 complete under its temporary name
    "checkpoint:renamed@3",  # step 7 in place, step 4 not yet deleted
    "best@1",                # best-model preset written, not renamed
    "last@2",                # last-model preset written, not renamed
    "final:evaluated",       # all 12 steps done, killed in the final evaluation
    "preset",                # preset written under its temporary name
    "metrics",               # metrics.json written, not renamed
]


def on_every_backend(stages, each_backend):
    """`stages` as parameters: `each_backend` under every backend, the others marked
    `one_backend` (`tests/conftest.py` runs those under one backend only).

    What a kill can break is the writing code (`keras_vitnorm.durable` and the checkpoint
    callbacks), the same on every backend; a backend enters only through the weights it
    serializes, which one stage of each kind of file covers.
    """
    return [stage if stage in each_backend else pytest.param(stage, marks=pytest.mark.one_backend)
            for stage in stages]


@pytest.mark.parametrize("stage", on_every_backend(STAGES, ["checkpoint:renamed@3", "final:evaluated"]))
def test_killed_at_any_writing_stage_resumes_to_the_uninterrupted_weights(tmp_path, reference, stage):
    run_dir = tmp_path / "run"
    killed_at(stage, run_dir)
    assert not (run_dir / "metrics.json").exists()
    with pytest.raises(ValueError, match=r"has not completed.*its status is unfinished.*--resume"):
        evaluate(str(run_dir))
    train(run_config(run_dir), resume=True, take_over_lock=True, verbose=0)
    assert_same_as_reference(run_dir, reference)


@pytest.mark.one_backend
def test_killed_while_a_checkpoint_of_the_same_step_is_replaced_resumes(tmp_path, reference):
    """With a backup every 2 steps in epochs of 4, the epoch-end checkpoint replaces the
    backup of the same step: killed between moving the old one aside and renaming the
    new one in, the run still resumes from that step, not from step 0."""
    run_dir = tmp_path / "run"
    killed_at("checkpoint:state:replacing@1", run_dir, backup_every=2)
    assert not list((run_dir / "backup").glob("step-*"))  # neither copy is in place
    train(run_config(run_dir, backup_every=2), resume=True, take_over_lock=True, verbose=0)
    assert_same_as_reference(run_dir, reference)
    log = json.loads((run_dir / "metrics.json").read_text())
    assert log["resumed_from_step"] == 4


@pytest.mark.one_backend
def test_killed_after_the_results_are_written_keeps_them(tmp_path, reference):
    run_dir = tmp_path / "run"
    killed_at("final:completed", run_dir)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    # resumed, the completed run is left as it is
    assert train(run_config(run_dir), resume=True, take_over_lock=True, verbose=0) == metrics
    weights = final_weights(run_dir)
    for key, value in reference["weights"].items():
        np.testing.assert_array_equal(weights[key], value)
    assert evaluate(str(run_dir))["examples"] > 0


@pytest.mark.one_backend
def test_a_checkpoint_is_never_a_mix_of_two_steps(tmp_path):
    """Killed between writing a checkpoint's weights and its state, the run resumes from
    the previous complete checkpoint, whose weights and step belong together."""
    run_dir = tmp_path / "run"
    killed_at("checkpoint:state@2", run_dir)
    names = sorted(os.listdir(run_dir / "backup"))
    assert names[-1] == "step-000000003"  # step 4 never completed
    state = json.loads((run_dir / "backup" / "step-000000003" / "state.json").read_text())
    assert {key: state[key] for key in ("epoch", "batch", "step")} == {"epoch": 0, "batch": 3, "step": 3}
    # A checkpoint whose state does not record its training time (as written by
    # earlier versions): the resumed run reports its own time, and the total as unknown.
    del state["train_seconds"]
    (run_dir / "backup" / "step-000000003" / "state.json").write_text(json.dumps(state))
    train(run_config(run_dir), resume=True, take_over_lock=True, verbose=0)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == 12 and metrics["resumed_from_step"] == 3
    assert metrics["train_seconds"] is None and metrics["train_seconds_this_run"] > 0


# ----------------------------------------------------------------------------- one writer


@pytest.mark.one_backend
def test_a_second_process_cannot_write_a_running_run_and_a_killed_ones_run_resumes(tmp_path, reference):
    run_dir = tmp_path / "run"
    gate = tmp_path / "gate"
    code = f"""
        import os, time, keras
        from keras_vitnorm.training import TrainConfig, train

        class Wait(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)) == 5:
                    open({str(tmp_path / "waiting")!r}, "w").close()
                    while not os.path.exists({str(gate)!r}):
                        time.sleep(0.05)

        config = TrainConfig.from_recipe("small", **{dict(RUN, output_dir=str(run_dir))!r})
        train(config, callbacks=[Wait()], verbose=0)
    """
    child = subprocess.Popen(
        [sys.executable, "-c", __import__("textwrap").dedent(code)],
        env={**os.environ, "KERAS_BACKEND": keras.backend.backend()},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.time() + 300
        while not (tmp_path / "waiting").exists():
            assert child.poll() is None, child.communicate()[1][-3000:]
            assert time.time() < deadline
            time.sleep(0.1)
        before = sorted(os.listdir(run_dir))
        for kwargs in (dict(resume=True), dict(overwrite=True), dict(resume=True, take_over_lock=True)):
            with pytest.raises(LockedError, match=f"in use by another process \\(pid {child.pid}"):
                train(run_config(run_dir), verbose=0, **kwargs)
        assert sorted(os.listdir(run_dir)) == before
        code = cli.main(["train", "--resume", "--output-dir", str(run_dir)])
        assert code == 2
        child.kill()  # kill -9: the owner dies holding the lock
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    holder = json.loads((run_dir / "run.lock").read_text())
    assert holder["pid"] == child.pid  # its record stays; its lock went with it
    # the same command resumes, with no flag to take the lock over
    train(run_config(run_dir), resume=True, verbose=0)
    assert_same_as_reference(run_dir, reference)


@pytest.mark.parametrize("command", ["segment", "lit"])
def test_segment_and_lit_runs_have_one_writer(tmp_path, capsys, command):
    from keras_vitnorm.training.run_files import RunLock

    with RunLock(str(tmp_path / "out" / "seed_0")):
        assert cli.main([command, "--output-dir", str(tmp_path / "out"), "--epochs", "1",
                         "--verbose", "0"]) == 2
    assert "is in use by another process" in capsys.readouterr().err
    assert not (tmp_path / "out" / "seed_0" / "metrics.json").exists()


# ----------------------------------------------------------------------------- storage


@pytest.mark.one_backend
def test_a_failed_write_is_one_clear_error_and_the_last_checkpoint_stays_usable(
    tmp_path, reference, monkeypatch
):
    run_dir = tmp_path / "run"
    monkeypatch.setenv(durable.FAULT_ENV, "enospc:checkpoint:weights@2")
    monkeypatch.setattr(durable, "_fault_counts", {})
    with pytest.raises(StorageError, match=r"Could not write .*backup/step-000000004.*No space left on "
                       r"device.*The checkpoint .*step-000000003 \(step 3\) is intact.*--resume"):
        train(run_config(run_dir), verbose=0)
    assert_unlocked(run_dir)  # released on the error
    monkeypatch.delenv(durable.FAULT_ENV)
    train(run_config(run_dir), resume=True, verbose=0)
    assert_same_as_reference(run_dir, reference)


def tiny_train_argv(run_dir):
    return ["keras-vitnorm", "train", "--steps", "4", "--batch-size", "32", "--warmup-steps", "1",
            "--image-size", str(TINY["image_size"]), "--patch-size", str(TINY["patch_size"]),
            "--width", str(TINY["width"]), "--depth", str(TINY["depth"]),
            "--num-heads", str(TINY["num_heads"]), "--mlp-dim", str(TINY["mlp_dim"]),
            "--no-tensorboard", "--verbose", "0", "--output-dir", str(run_dir)]


@pytest.mark.one_backend
def test_a_real_refused_write_ends_with_a_message_and_exit_status_4(tmp_path):
    """The operating system refuses files over 64 KiB (RLIMIT_FSIZE, set in the child
    itself): the first checkpoint cannot be written. The command ends with its message,
    not a traceback or a crash."""
    run_dir = tmp_path / "run"
    argv = tiny_train_argv(run_dir)
    child = run_python(f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails: EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        from keras_vitnorm.cli import console
        sys.argv = {argv!r}
        console()
    """)
    assert child.returncode == 4, child.stderr[-3000:]
    assert "Could not write" in child.stderr and "File too large" in child.stderr
    assert "Traceback" not in child.stderr
    assert (run_dir / "train_config.json").exists()
    assert_unlocked(run_dir)


@pytest.fixture
def traversable_dir():
    """A fresh folder that every user may enter (pytest's own temporary folders are
    private to their owner, so a process that dropped root's rights could not reach
    anything inside them)."""
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="keras_vitnorm_")
    os.chmod(path, 0o755)
    yield pathlib.Path(path)
    for root, folders, _ in os.walk(path):
        for folder in folders:
            os.chmod(os.path.join(root, folder), 0o755)
    shutil.rmtree(path)


@pytest.mark.one_backend
def test_a_directory_without_write_permission_ends_with_a_message_and_exit_status_4(
        traversable_dir):
    """A run directory inside a directory the user may not write (the child drops root's
    rights first, as root writes anywhere)."""
    tmp_path = traversable_dir
    parent = tmp_path / "read_only"
    parent.mkdir()
    parent.chmod(0o555)
    run_dir = parent / "run"
    child = run_python(f"""
        import os, sys
        from keras_vitnorm.cli import console
        # Imported while the interpreter's own files (under root's home) are readable.
        import keras_vitnorm.training.trainer, sklearn.datasets, tensorflow
        if os.geteuid() == 0:
            os.setgid(65534)
            os.setuid(65534)
        sys.argv = {tiny_train_argv(run_dir)!r}
        console()
    """, env={"HOME": str(tmp_path)})
    assert child.returncode == 4, child.stderr[-3000:]
    named = re.search(r"Could not write (\S+): .*Permission denied.*Nothing was written", child.stderr)
    assert named and named.group(1) == str(run_dir), child.stderr[-3000:]
    assert "Traceback" not in child.stderr
    assert not run_dir.exists()


class FailingWrite(keras.callbacks.Callback):
    """Fails at the second epoch end the way a full disk fails a log's write."""

    def __init__(self, error):
        super().__init__()
        self.error = error

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise self.error


@pytest.mark.one_backend
@pytest.mark.parametrize("error, named", [
    (OSError(errno.ENOSPC, "No space left on device", "LOG"), "LOG"),
    # TensorFlow's summary writer raises its own error type, with the reason in its text.
    (RuntimeError("tensorboard/events.out: No space left on device"), "RUN"),
])
def test_a_failed_log_write_is_one_clear_error_and_the_run_resumes(tmp_path, reference, error, named):
    run_dir = tmp_path / "run"
    if isinstance(error, OSError):
        error.filename = str(run_dir / "log.csv")
    named = {"LOG": run_dir / "log.csv", "RUN": run_dir}[named]
    with pytest.raises(StorageError, match=rf"Could not write {named}: .*No space left on device.*"
                       r"last checkpoint .*backup.*is intact.*--resume"):
        train(run_config(run_dir), callbacks=[FailingWrite(error)], verbose=0)
    assert_unlocked(run_dir)
    train(run_config(run_dir), resume=True, verbose=0)
    assert_same_as_reference(run_dir, reference)


# ----------------------------------------------------------------------------- damaged files


@pytest.fixture
def preset_dir(tmp_path):
    keras.utils.set_random_seed(0)
    model = ViT(image_size=16, patch_size=4, width=32, depth=1, num_heads=2, mlp_dim=64,
                num_classes=3)
    path = tmp_path / "preset"
    model.save_to_preset(path)
    return path


def test_a_truncated_weights_archive_is_named(preset_dir):
    weights = preset_dir / "model.weights.npz"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"{weights}.*truncated or corrupt"):
        ViT.from_preset(str(preset_dir))


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"class_name": "ViT", "conf', "is not valid JSON"),
        ('{"class_name": "ViT"}', "needs 'class_name': 'ViT' and a 'config' object"),
        ("[1, 2]", "holds a JSON list, not an object"),
        ("{}", "names no model format"),
    ],
)
def test_a_damaged_config_is_named(preset_dir, text, message):
    (preset_dir / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        ViT.from_preset(str(preset_dir))
    assert str(preset_dir / "config.json") in str(error.value)


def rewrite_weights(preset_dir, change):
    path = preset_dir / "model.weights.npz"
    with np.load(path) as archive:
        arrays = {key: archive[key] for key in archive.files}
    change(arrays)
    np.savez(path, **arrays)


def test_a_weight_missing_from_a_preset_is_an_error_naming_it(preset_dir):
    rewrite_weights(preset_dir, lambda arrays: arrays.pop("block_0/mlp/fc1/kernel"))
    with pytest.raises(ValueError, match=rf"Preset '{preset_dir}'.*missing from the weights: "
                                         r"'block_0/mlp/fc1/kernel"):
        ViT.from_preset(str(preset_dir))
    # An override equal to the preset's own value (training always passes num_classes)
    # changes no weight, so loading stays strict.
    with pytest.raises(ValueError, match="missing from the weights: 'block_0/mlp/fc1/kernel"):
        ViT.from_preset(str(preset_dir), num_classes=3)  # the preset_dir model's own


def test_a_weight_of_the_wrong_shape_or_a_bad_config_value_names_the_preset(preset_dir):
    rewrite_weights(preset_dir, lambda arrays: arrays.update(
        {"block_0/mlp/fc1/kernel": np.zeros((32, 65), "float32")}))
    with pytest.raises(ValueError, match=rf"Preset '{preset_dir}'.*block_0/mlp/fc1/kernel.* "
                                         r"has shape \(32, 65\)"):
        ViT.from_preset(str(preset_dir))
    saved = json.loads((preset_dir / "config.json").read_text())
    saved["config"]["norm_epsilon"] = -1.0
    (preset_dir / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=rf"Preset '{preset_dir}'.*norm_epsilon"):
        ViT.from_preset(str(preset_dir))


def test_a_preset_whose_config_disagrees_with_its_weights_is_an_error(preset_dir):
    """config.json says 24 px, the weights are for 16 px (a 4x4 grid): loaded without an
    override, that is a damaged preset, not an image size to resample to."""
    saved = json.loads((preset_dir / "config.json").read_text())
    saved["config"]["image_size"] = 24
    (preset_dir / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=rf"Preset '{preset_dir}'.*position embedding.*4x4 -> "
                                         r"6x6.*image_size"):
        ViT.from_preset(str(preset_dir))
    # asked for, the same resampling is what an override does
    assert ViT.from_preset(str(preset_dir), image_size=16).get_config()["image_size"] == 16


def test_convert_re_saves_a_preset_with_overrides(preset_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["convert", str(preset_dir), str(out), "--image-size", "24"]) == 0, capsys.readouterr().err
    model = ViT.from_preset(str(out))
    assert model.get_config()["image_size"] == 24
    assert "resampled" in capsys.readouterr().out
    from keras_vitnorm.convert import read_checkpoint

    with pytest.raises(ValueError, match="is a keras_vitnorm preset, not a foreign checkpoint"):
        read_checkpoint(str(preset_dir / "config.json").rsplit("/", 1)[0] + "/")


def test_convert_exits_2_on_a_damaged_checkpoint(tmp_path, capsys):
    bad = tmp_path / "ViT-S_16.npz"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    assert cli.main(["convert", str(bad), str(tmp_path / "out")]) == 2
    assert str(bad) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- image folders


def damaged_folder(root):
    write_image_folder(root)
    truncated = root / "cat" / "0.png"
    truncated.write_bytes(truncated.read_bytes()[:40])
    (root / "dog" / "notes.png").write_text("this is text, not a picture")
    (root / ".ipynb_checkpoints").mkdir()
    (root / "eel" / ".hidden.png").write_text("hidden files are not images")
    return truncated, root / "dog" / "notes.png"


def test_unreadable_images_are_named_before_training_or_skipped_by_a_flag(tmp_path):
    root = tmp_path / "images"
    truncated, text = damaged_folder(root)
    with pytest.raises(ValueError) as error:
        load_dataset(f"folder:{root}")
    message = str(error.value)
    assert "2 file(s)" in message and "--skip-bad-images" in message
    assert f"{truncated} is a truncated PNG" in message
    assert f"{text} is not a JPEG, PNG, GIF or BMP image" in message
    data = load_dataset(f"folder:{root}", skip_bad_images=True)
    assert data.class_names == ["cat", "dog", "eel"]  # no ".ipynb_checkpoints" class
    assert data.train.size + data.validation.size + data.test.size == 31 - 2
    assert "skipped 2 unreadable image(s)" in data.describe()
    metrics = train(run_config(tmp_path / "run", dataset=f"folder:{root}", skip_bad_images=True,
                               steps=2, batch_size=8, grad_norm_every=None), verbose=0)
    assert metrics["status"] == "completed"


@pytest.mark.one_backend
def test_image_files_in_formats_the_pipelines_do_not_read_are_named_not_ignored(tmp_path):
    """TIFF and WebP files (where 32-bit integer and float images live) used to be left
    out without a word: a class of TIFFs became an empty class."""
    from PIL import Image

    root = tmp_path / "images"
    write_image_folder(root)
    Image.new("F", (12, 12)).save(root / "cat" / "float.tiff")
    Image.new("RGB", (12, 12)).save(root / "dog" / "photo.webp")
    with pytest.raises(ValueError) as error:
        load_dataset(f"folder:{root}")
    message = str(error.value)
    assert "2 file(s)" in message
    assert (f"{root / 'cat' / 'float.tiff'} is a TIFF image; image folders hold JPEG, PNG, GIF "
            "or BMP files (convert it)") in message
    assert f"{root / 'dog' / 'photo.webp'} is a WebP image" in message
    data = load_dataset(f"folder:{root}", skip_bad_images=True)
    assert len(data.skipped) == 2 and data.train.size + data.validation.size + data.test.size == 30


@pytest.mark.one_backend
def test_a_class_folder_without_images_is_named(tmp_path):
    root = tmp_path / "images"
    write_image_folder(root)
    (root / "fox").mkdir()
    (root / "fox" / "notes.txt").write_text("no images here")
    write_image_folder(root / "owl", classes=("2020",), per_class=3)  # one folder too deep
    with pytest.raises(ValueError, match=r"class folder\(s\) fox, owl of .* hold no images "
                       r"\(files ending in .jpg.*directly inside them; subfolders are not read\)"):
        load_dataset(f"folder:{root}")


@pytest.mark.one_backend
def test_a_class_too_small_to_stratify_leaves_the_other_classes_stratified(tmp_path):
    """A class of one image used to turn every split into a plain random draw (a class
    could then miss the training split); now each class is split on its own."""
    root = tmp_path / "images"
    write_image_folder(root, per_class=10)
    write_image_folder(root, classes=("fox",), per_class=1)
    data = load_dataset(f"folder:{root}")
    counts = [np.bincount(split.arrays[1], minlength=4).tolist()
              for split in (data.train, data.validation, data.test)]
    assert counts == [[7, 7, 7, 1], [1, 1, 1, 0], [2, 2, 2, 0]]


def test_an_image_damaged_inside_is_named_when_it_fails_to_decode(tmp_path):
    root = tmp_path / "images"
    write_image_folder(root)
    damaged = root / "dog" / "3.png"
    data = bytearray(damaged.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 10):
        data[i] ^= 0xFF  # the PNG's ends are intact, its compressed pixels are not
    damaged.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{damaged} does not decode"):
        train(run_config(tmp_path / "run", dataset=f"folder:{root}", steps=6, batch_size=8,
                         grad_norm_every=None), verbose=0)


def test_storage_errors_are_recognized_from_their_errno():
    from keras_vitnorm.training.run_files import storage_errors

    with pytest.raises(StorageError, match="Could not write x.*intact") as error:
        with storage_errors("x", "The thing is intact."):
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    # the reason once, without errno numbers
    assert str(error.value) == ("Could not write x: Disk quota exceeded. The thing is intact. "
                                "Free space (or fix the permissions), then continue with --resume.")
    assert error.value.errno == errno.EDQUOT
    with pytest.raises(KeyError):
        with storage_errors("x", "safe"):
            raise KeyError("not a storage error")


def test_a_refused_read_elsewhere_is_not_reported_as_a_failed_write(tmp_path):
    from keras_vitnorm.training.run_files import storage_errors

    run_dir = tmp_path / "run"
    elsewhere = PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "preset"))
    with pytest.raises(PermissionError) as raised:
        with storage_errors(str(run_dir), "safe"):
            raise elsewhere
    assert raised.value is elsewhere
    for inside in (run_dir / "log.csv", tmp_path):  # a file of the run, a folder above it
        with pytest.raises(StorageError, match=f"Could not write {re.escape(str(inside))}"):
            with storage_errors(str(run_dir), "safe"):
                raise PermissionError(errno.EACCES, "Permission denied", str(inside))


def test_a_failed_lock_write_leaves_the_directory_free(tmp_path, monkeypatch):
    from keras_vitnorm.training import run_files

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patched:
        patched.setattr(run_files.json, "dump", full_disk)
        with pytest.raises(StorageError, match="Could not write .*run.lock") as error:
            run_files.RunLock(str(tmp_path), "run.lock").acquire()
    # nothing to resume: the advice is to run the command again
    assert str(error.value).endswith("Nothing was written. Free space (or fix the "
                                     "permissions), then run the same command again."), error.value
    with run_files.RunLock(str(tmp_path), "run.lock"):  # nothing holds it
        pass


HOLD_LOCK = """
import sys, time
from keras_vitnorm.training.run_files import RunLock
with RunLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def hold_lock_in_child(directory, prefix=()):
    """A child process (started with `prefix`, e.g. in another PID namespace) that takes
    the run lock of `directory` and holds it; returns it once it holds the lock."""
    child = subprocess.Popen([*prefix, sys.executable, "-c", HOLD_LOCK, str(directory)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    assert line == "held\n", child.communicate()[1][-2000:]
    return child


@pytest.mark.one_backend
def test_the_lock_dies_with_its_holder_and_a_live_holder_is_refused_anywhere(tmp_path):
    from keras_vitnorm.training.run_files import RunLock

    child = hold_lock_in_child(tmp_path)
    try:
        with pytest.raises(LockedError, match=f"in use by another process \\(pid {child.pid} "):
            RunLock(str(tmp_path)).acquire()
        with pytest.raises(LockedError):  # taking over is for a lock without a live holder
            RunLock(str(tmp_path), take_over=True).acquire()
    finally:
        child.kill()
        child.wait()
    with RunLock(str(tmp_path)):  # kill -9 released it
        pass
    # A holder whose pid and host mean nothing here (another PID namespace of this
    # host, as a container or another node sharing the file system would be) is seen
    # through the lock itself, not through its record.
    unshare = ["unshare", "--pid", "--fork", "--mount-proc"]
    try:
        usable = subprocess.run([*unshare, "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        usable = False
    if not usable:
        pytest.skip("unshare cannot make a PID namespace here (needs util-linux and root)")
    child = hold_lock_in_child(tmp_path, unshare)
    try:
        with pytest.raises(LockedError, match="in use by another process"):
            RunLock(str(tmp_path)).acquire()
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("lead", [True, False])
def test_an_error_of_the_first_process_stops_every_process(monkeypatch, lead):
    """The first process's error (a taken lock, a damaged checkpoint) reaches the others
    through the broadcast every process joins, so none of them waits for it."""
    from keras_vitnorm import backend
    from keras_vitnorm.training import run_plan

    plan = run_plan.Plan(1, 1, {}, 1, None, process=(0 if lead else 1, 2))
    sent = []
    first_process_says = "The run directory /r is in use by another process"
    monkeypatch.setattr(backend, "from_first_process",
                        lambda value: sent.append(value) or first_process_says)

    def work():
        raise LockedError(first_process_says)

    expected = LockedError if lead else ValueError
    with pytest.raises(expected, match="in use by another process"):
        run_plan.first_process_then_all(plan, work)
    assert sent == [first_process_says if lead else None]
    monkeypatch.setattr(backend, "from_first_process", lambda value: None)
    assert run_plan.first_process_then_all(plan, lambda: "restored") == ("restored" if lead else None)


# ----------------------------------------------------------------------------- the study runner


STUDY = dict(model=TINY, steps=6, steps_per_epoch=3, batch_size=32, warmup_steps=1,
             learning_rate=3e-3, tensorboard=False, grad_norm_every=3)


def run_tiny_study(study_dir, **kwargs):
    from keras_vitnorm.study import run_study

    base = TrainConfig.from_recipe("small", **STUDY)
    return run_study(base, ["norm_types"], [0], str(study_dir),
                     {"norm_types": ["rmsnorm"]}, verbose=0, **kwargs)


def study_results(study_dir):
    lines = csv_rows(study_dir / "results.csv")
    header = lines[0].split(",")
    keep = [header.index(k) for k in ("group", "variant", "seed", "status", "test_accuracy",
                                      "val_accuracy", "steps")]
    return [[line.split(",")[i] for i in keep] for line in lines]


@pytest.fixture(scope="module")
def reference_study(tmp_path_factory):
    study_dir = tmp_path_factory.mktemp("study") / "s"
    run_tiny_study(study_dir)
    return study_results(study_dir), study_dir


@pytest.mark.one_backend
@pytest.mark.parametrize(
    "stage", ["checkpoint:weights@4", "final:evaluated@2", "preset@2", "metrics@1", "analysis@1", "results@1"])
def test_a_killed_study_reruns_to_the_uninterrupted_results(tmp_path, reference_study, stage):
    """Every kind of file the study writes, killed before it is in place: a run's
    checkpoint, final evaluation, preset and metrics, the run's analysis and the study's
    results table. Stage counts run over the study: the 4th checkpoint is in the second
    run (each run saves at steps 3 and 6), the 2nd preset is the second run's.

    Under one backend: the study resumes a run through the training resume, whose
    kills the matrix above checks under every backend, and writes its own files
    through the same `keras_vitnorm.durable` on all of them."""
    expected, reference_dir = reference_study
    study_dir = tmp_path / "s"
    child = run_python(
        f"""
        from keras_vitnorm.training import TrainConfig
        from keras_vitnorm.study import run_study
        base = TrainConfig.from_recipe("small", **{STUDY!r})
        run_study(base, ["norm_types"], [0], {str(study_dir)!r}, {{"norm_types": ["rmsnorm"]}},
                  verbose=0)
        """,
        env={durable.FAULT_ENV: stage},
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    run_tiny_study(study_dir)  # the same command: the killed study's locks went with it
    assert study_results(study_dir) == expected
    for variant in ("layernorm", "rmsnorm"):
        got = final_weights(study_dir / "norm_types" / variant / "seed_0")
        want = final_weights(reference_dir / "norm_types" / variant / "seed_0")
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"{variant} {key}")


def test_two_studies_cannot_share_a_directory(tmp_path):
    from keras_vitnorm.training.run_files import RunLock

    with RunLock(str(tmp_path / "s"), "study.lock", what="study directory"):
        with pytest.raises(LockedError, match="study directory .* in use by another process"):
            run_tiny_study(tmp_path / "s")


def test_a_run_that_finished_while_this_one_waited_for_its_lock_is_kept(tmp_path, monkeypatch):
    from keras_vitnorm.training import run_files

    acquire = run_files.RunLock.acquire

    def another_process_finishes_first(self):
        (tmp_path / "metrics.json").write_text('{"status": "completed"}')
        return acquire(self)

    monkeypatch.setattr(run_files.RunLock, "acquire", another_process_finishes_first)
    with pytest.raises(FileExistsError, match="already holds a finished segmenter"):
        with run_files.results_run(str(tmp_path), "segmenter"):
            pass
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"status": "completed"}


def test_without_file_locks_the_file_is_the_lock_and_a_dead_holders_is_taken_over(
        tmp_path, monkeypatch):
    """On a file system that keeps no locks (flock fails with ENOLCK) the lock file itself
    is the lock: a live holder is refused, a dead one's lock is reported and taken over
    only when asked."""
    import fcntl

    from keras_vitnorm.training.run_files import RunLock

    def no_locks(*args):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with RunLock(str(tmp_path)):
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
        with pytest.raises(LockedError, match="in use by another process"):
            RunLock(str(tmp_path), take_over=True).acquire()
    assert not (tmp_path / "run.lock").exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)
    (tmp_path / "run.lock").write_text(json.dumps(
        {"pid": int(dead.stdout), "host": __import__("socket").gethostname()}))
    with pytest.raises(LockedError, match="no longer runs, and this file system keeps no file "
                                          "locks.*--take-over-lock"):
        RunLock(str(tmp_path)).acquire()
    with RunLock(str(tmp_path), take_over=True):
        pass


# ----------------------------------------------------------------------------- signals


def run_argv(run_dir):
    """The `keras-vitnorm train` arguments of `run_config(run_dir)`."""
    model = [f"--{key.replace('_', '-')}={value}" for key, value in TINY.items()]
    return ["train", *model, "--set", "dropout=0.1", "--drop-path", "0.1", "--steps", "12",
            "--steps-per-epoch", "4", "--backup-every", "3", "--batch-size", "32",
            "--warmup-steps", "1", "--lr", "3e-3", "--flip", "--grad-norm-every", "2",
            "--no-tensorboard", "--verbose", "0", "--output-dir", str(run_dir)]


SIGNAL_AT = """
import os, sys, keras
import keras_vitnorm.training as training
from keras_vitnorm.cli import console

class SignalAt(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)) == {step}:
            os.kill(os.getpid(), {signal})

trains = training.train
training.train = lambda config, **kwargs: trains(config, callbacks=[SignalAt()], **kwargs)
sys.argv = ["keras-vitnorm", *{argv!r}]
console()
"""


class SignalAt(keras.callbacks.Callback):
    """Sends `signal` to this process as step `step + 1` begins (step 0: before the
    first step, which compiles the training function): it stops at the end of that step."""

    def __init__(self, step, signal_number):
        super().__init__()
        self.step, self.signal = step, signal_number

    def on_train_batch_begin(self, batch, logs=None):
        if int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)) == self.step:
            os.kill(os.getpid(), self.signal)


class UnhandledSignal(Exception):
    pass


@pytest.fixture
def signals_raise():
    """SIGTERM and SIGINT raise `UnhandledSignal` here unless the code under test handles
    them, so that an unhandled one fails the test instead of ending pytest."""
    def unhandled(number, frame):
        raise UnhandledSignal(signal.Signals(number).name)

    previous = {number: signal.signal(number, unhandled)
                for number in (signal.SIGTERM, signal.SIGINT)}
    yield
    for number, handler in previous.items():
        signal.signal(number, handler)


def signal_during(monkeypatch, step, signal_number):
    """`keras_vitnorm.training.train` as the CLI calls it, with `SignalAt(step, signal)`."""
    import keras_vitnorm.training as training

    trains = training.train
    monkeypatch.setattr(training, "train", lambda config, **kwargs: trains(
        config, callbacks=[SignalAt(step, signal_number)], **kwargs))


def test_sigint_and_sigterm_stop_at_a_step_with_its_checkpoint_and_the_same_command_resumes(
        tmp_path, reference, monkeypatch, capsys, signals_raise):
    """Ctrl-C as the first step compiles (a JAX run used to swallow it or crash as it
    exited), then a scheduler's SIGTERM mid-epoch in the resumed run: each ends the
    command with its exit status and the command that continues, the checkpoint of the
    step it stopped at and the lock free; the same command with --resume then finishes
    on the uninterrupted run's weights."""
    run_dir = tmp_path / "run"
    argv = run_argv(run_dir)
    child = run_python(SIGNAL_AT.format(step=0, signal=int(signal.SIGINT), argv=argv))
    assert child.returncode == 130, child.stderr[-3000:]
    resume_command = "keras-vitnorm " + " ".join(argv + ["--resume"])
    assert child.stderr.strip().splitlines()[-1] == (
        f"keras-vitnorm train: error: Stopped by SIGINT at step 1 of 12: the run in {run_dir} "
        f"resumes from its checkpoint of that step ({run_dir / 'backup' / 'step-000000001'}). "
        f"Continue it with: {resume_command}")
    assert sorted(os.listdir(run_dir / "backup")) == ["step-000000001"]
    assert not (run_dir / "metrics.json").exists()
    assert_unlocked(run_dir)

    signal_during(monkeypatch, 5, signal.SIGTERM)  # stops after step 6, batch 2 of epoch 2
    assert cli.main(argv + ["--resume"]) == 143
    error = capsys.readouterr().err
    assert f"Stopped by SIGTERM at step 6 of 12: the run in {run_dir} resumes" in error
    assert error.strip().endswith(f"Continue it with: {resume_command}")
    state = json.loads((run_dir / "backup" / "step-000000006" / "state.json").read_text())
    assert {key: state[key] for key in ("epoch", "batch", "step")} == {
        "epoch": 1, "batch": 2, "step": 6}
    assert_unlocked(run_dir)

    monkeypatch.undo()
    assert cli.main(argv + ["--resume"]) == 0
    assert_same_as_reference(run_dir, reference)


@pytest.mark.one_backend
def test_a_signal_outside_the_training_steps_stops_at_once_and_a_second_ctrl_c_ends_it(
        signals_raise):
    """Loading data or building the model, nothing needs finishing: the signal raises
    at once. Inside a step, a second Ctrl-C ends the process by SIGINT's own action."""
    from keras_vitnorm.training.interrupts import RunInterrupted
    from keras_vitnorm.training.interrupts import StopRequest

    outside = signal.getsignal(signal.SIGTERM)
    with StopRequest(say=lambda text: None).listening():
        with pytest.raises(RunInterrupted) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises first
    assert stopped.value.exit_status == 143 and "SIGTERM" in str(stopped.value)
    assert signal.getsignal(signal.SIGTERM) is outside  # the handlers are given back
    child = run_python("""
        import os, signal, time
        from keras_vitnorm.training.interrupts import StopRequest

        request = StopRequest()
        with request.listening(), request.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(60)
    """)
    assert child.returncode == -signal.SIGINT, child.stderr[-3000:]
    assert "SIGINT received: stopping at the end of this step" in child.stderr
    assert "Stopping at once" in child.stderr


@pytest.mark.one_backend
def test_every_command_says_what_a_sigterm_stopped(monkeypatch, capsys, signals_raise):
    """Outside a training run too (here `evaluate`), SIGTERM ends a command with its
    message and status 143, not without a word."""
    from keras_vitnorm.cli import evaluate as evaluate_command

    def stopped(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises first

    monkeypatch.setattr(evaluate_command, "run", stopped)
    assert cli.main(["evaluate", "runs/x"]) == 143
    assert capsys.readouterr().err == (
        "keras-vitnorm evaluate: error: Stopped by SIGTERM. Nothing was written.\n")


class TerminatedChild:
    """A worker that records the SIGTERM passed on to it (`terminate`) and exits 143."""

    def __init__(self):
        self.terminated = False

    def poll(self):
        return None

    def terminate(self):
        self.terminated = True

    def wait(self):
        return 143 if self.terminated else None


@pytest.mark.one_backend
@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT])
def test_a_parallel_study_passes_a_signal_on_to_its_workers_and_waits_for_them(
        signals_raise, signal_number):
    from keras_vitnorm.study import workers
    from keras_vitnorm.training.interrupts import RunInterrupted

    children = []

    def start(job):
        children.append(TerminatedChild())
        if len(children) == 2:
            os.kill(os.getpid(), signal_number)
        return children[-1]

    jobs = [{"group": "g", "name": f"v{i}", "seed": 0, "log": "/nowhere"} for i in range(4)]
    with pytest.raises(RunInterrupted) as stopped:
        workers.train_in_workers(jobs, 2, start, poll_seconds=0, say=None)
    assert stopped.value.exit_status == 128 + signal_number
    assert len(children) == 2 and all(child.terminated for child in children)
    assert "The runs in training ([g] v0 seed 0, [g] v1 seed 0) stopped" in str(stopped.value)


@pytest.mark.one_backend
def test_a_study_worker_child_runs_its_entry_module_once():
    """The child's command imports the study package once: run as `-m` of a module that
    the package itself imports, Python executes that module a second time (and warns)."""
    from keras_vitnorm.study import workers

    command = workers.child_command("job.json")[:-1]  # no job file: the usage, status 2
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "usage: python -m keras_vitnorm.study JOB_FILE" in result.stderr
    assert "RuntimeWarning" not in result.stderr and "sys.modules" not in result.stderr


@pytest.mark.one_backend
def test_a_study_worker_names_a_run_directory_it_cannot_take_with_exit_status_2(tmp_path, capsys):
    """As `ablate-job` does (keras_vitnorm.cli.errors): a file of the user's in the run's
    directory is named, status 2, not a traceback of status 1."""
    from keras_vitnorm.study import plan as plan_lib
    from keras_vitnorm.study import workers

    run_dir = tmp_path / "norm_types" / "layernorm" / "seed_0"
    run_dir.mkdir(parents=True)
    (run_dir / "notes.txt").write_text("mine")
    path = tmp_path / "plan" / "run.job.json"
    path.parent.mkdir()
    durable.write_json(str(path), plan_lib.job("norm_types", "layernorm", TrainConfig.from_recipe(
        "small", **STUDY), str(run_dir), str(tmp_path)))
    assert workers.main([str(path)]) == 2
    assert f"error: Output directory {run_dir} already exists" in capsys.readouterr().err
    assert (run_dir / "notes.txt").read_text() == "mine"


@pytest.mark.one_backend
def test_a_study_worker_stopped_by_sigterm_leaves_a_checkpoint_and_its_job_resumes(
        tmp_path, monkeypatch, capsys, signals_raise):
    """What a scheduler's SIGTERM to `ablate-job` (or `ablate --parallel`'s SIGTERM to a
    worker) does: the run stops with the checkpoint of its step, exit status 143; the
    same job then finishes on the weights of a job never stopped."""
    from keras_vitnorm.study import plan as plan_lib
    from keras_vitnorm.study import one_run
    from keras_vitnorm.study import workers

    config = TrainConfig.from_recipe("small", **STUDY)

    def job_file(study_dir):
        run_dir = study_dir / "norm_types" / "layernorm" / "seed_0"
        path = study_dir / "plan" / "run.job.json"
        path.parent.mkdir(parents=True)
        durable.write_json(str(path), plan_lib.job("norm_types", "layernorm", config,
                                                   str(run_dir), str(study_dir)))
        return str(path), run_dir

    whole, whole_dir = job_file(tmp_path / "whole")
    plan_lib.run_job(whole, verbose=0)
    stopped, stopped_dir = job_file(tmp_path / "stopped")
    trains = one_run.train
    monkeypatch.setattr(one_run, "train", lambda config, **kwargs: trains(
        config, callbacks=[SignalAt(1, signal.SIGTERM)], **kwargs))
    assert workers.main([stopped]) == 143
    assert "Stopped by SIGTERM at step 2 of 6" in capsys.readouterr().err
    assert sorted(os.listdir(stopped_dir / "backup")) == ["step-000000002"]
    monkeypatch.undo()
    assert cli.main(["ablate-job", stopped, "--verbose", "0"]) == 0
    got, want = final_weights(stopped_dir), final_weights(whole_dir)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


# ----------------------------------------------------------------------------- failed commands


@pytest.mark.one_backend
def test_failed_commands_leave_no_directory_they_made(tmp_path, capsys):
    """A segment, vtab or study command that fails before writing anything takes back
    the directories its lock made; one that existed before stays."""
    from keras_vitnorm.training.run_files import RunLock

    out = tmp_path / "segment"
    status = cli.main(["segment", "--scenes", "20", "10", "10", "--epochs", "1", "--batch-size",
                       "10", "--warmup-steps", "100", "--output-dir", str(out), "--verbose", "0"])
    assert status == 2 and "warmup_steps=100" in capsys.readouterr().err
    assert not out.exists()
    preset = tmp_path / "preset"
    ViT(**TINY, num_classes=3).save_to_preset(str(preset))
    out = tmp_path / "vtab"
    status = cli.main(["vtab", "--presets", str(preset), "--datasets", f"folder:{tmp_path}/none",
                       "--output-dir", str(out), "--verbose", "0"])
    assert status == 2 and "does not exist" in capsys.readouterr().err
    assert not out.exists()
    (tmp_path / "mine").mkdir()
    with pytest.raises(ZeroDivisionError):
        with RunLock(str(tmp_path / "mine" / "a" / "b")):
            1 / 0
    assert sorted(os.listdir(tmp_path / "mine")) == []  # made a/ and a/b/: both gone
    with RunLock(str(tmp_path / "mine")):
        pass
    assert (tmp_path / "mine").is_dir()  # not made by the lock: kept


def test_segment_names_a_bad_scene_count(capsys, tmp_path):
    status = cli.main(["segment", "--scenes", "0", "10", "10", "--output-dir", str(tmp_path / "s")])
    error = capsys.readouterr().err
    assert status == 2 and "scenes must be three positive integers (train, validation, test; " \
        "--scenes), got (0, 10, 10)" in error, error
    assert "warmup" not in error


def test_evaluate_names_a_bad_batch_size(capsys, tmp_path):
    preset = tmp_path / "preset"
    ViT(**TINY, num_classes=10, num_channels=1).save_to_preset(str(preset))
    status = cli.main(["evaluate", str(preset), "--dataset", "digits", "--batch-size", "0"])
    error = capsys.readouterr().err
    assert status == 2 and error.strip() == (
        "keras-vitnorm evaluate: error: batch_size must be a positive integer, got 0."), error
