"""Nothing silent, nothing lost: what a refused or failed command leaves behind, paths of
the wrong kind, and a study's collect of runs that are not what its plan says."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from keras_vitnorm import cli
from keras_vitnorm import durable
from keras_vitnorm.training import TrainConfig
from keras_vitnorm.training import replaced_run
from keras_vitnorm.training import run_directory
from keras_vitnorm.training import run_layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: A tiny run on the bundled digits, as the fault probe ran it.
TINY_RUN = ["--depth", "2", "--width", "32", "--mlp-dim", "64", "--num-heads", "2",
            "--epochs", "1", "--batch-size", "16", "--no-tensorboard", "--verbose", "0"]
#: The same, two steps long: for the checks that train.
SHORT_RUN = [*TINY_RUN[:TINY_RUN.index("--epochs")], "--steps", "2", "--warmup-steps", "1",
             "--batch-size", "16", "--no-tensorboard", "--verbose", "0"]
TINY = {"image_size": 16, "patch_size": 4, "width": 32, "depth": 1, "num_heads": 2, "mlp_dim": 64}


def run_cli(capsys, *argv):
    """`(exit status, stdout, stderr)` of `keras-vitnorm *argv`."""
    try:
        status = cli.main(list(argv))
    except SystemExit as exit:
        status = exit.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def tree(path):
    """Every file and folder under `path`, relative to it."""
    return sorted(os.path.relpath(os.path.join(root, name), path)
                  for root, folders, files in os.walk(path) for name in folders + files)


# ----------------------------------------------------------------------------- --overwrite


@pytest.mark.one_backend
def test_overwrite_refuses_a_run_directory_holding_the_users_own_files(tmp_path, capsys):
    """--overwrite replaces what a run wrote; a file or folder of the user's own in the
    run directory is named, and nothing is deleted."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "train_config.json").write_text(TrainConfig().to_json())
    (out / "log.csv").write_text("epoch,loss\n0,1.0\n")
    (out / "NOTES.md").write_text("what I saw")
    (out / "myanalysis").mkdir()
    (out / "myanalysis" / "plot.py").write_text("print(1)")
    before = tree(out)
    status, _, err = run_cli(capsys, "train", *TINY_RUN, "--output-dir", str(out), "--overwrite")
    assert status == 2, err
    assert "'NOTES.md', 'myanalysis'" in err and "nothing was deleted" in err, err
    assert tree(out) == before  # no file deleted, and no lock left behind
    assert (out / "NOTES.md").read_text() == "what I saw"


@pytest.mark.one_backend
def test_a_refused_overwrite_of_a_folder_that_is_no_run_leaves_no_lock_in_it(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "data.csv").write_text("1,2\n")
    status, _, err = run_cli(capsys, "train", *TINY_RUN, "--output-dir", str(out), "--overwrite")
    assert status == 2 and "not a keras-vitnorm run" in err, err
    assert os.listdir(out) == ["data.csv"]


def test_what_a_run_writes_is_told_from_what_it_does_not():
    for entry in ("run.lock", "train_config.json", "log.csv", "checkpoints", "backup",
                  "preset", ".preset.writing", ".preset.old", ".writing.metrics.json",
                  "analysis.json", "tensorboard", "grad_norms.csv", ".replaced",
                  ".replaced.moving"):
        assert run_layout.written_by_run(entry), entry
    for entry in ("NOTES.md", "myanalysis", ".writing.NOTES.md", ".git", "preset.bak"):
        assert not run_layout.written_by_run(entry), entry


# ----------------------------------------------------------------------------- failed starts


def write_jpeg_folder(root, corrupt=(), per_class=10, size=12):
    """A class-folder dataset of JPEGs; the classes in `corrupt` have their images
    damaged in the middle (a whole header and end, as a file cut and patched)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for index, name in enumerate(("cat", "dog", "eel")):
        os.makedirs(root / name, exist_ok=True)
        for i in range(per_class):
            image = rng.integers(0, 60, (size, size, 3)).astype("uint8")
            image[..., index] += 150
            path = root / name / f"{i}.jpg"
            Image.fromarray(image).save(path, "JPEG", quality=95)
            if name in corrupt:
                data = bytearray(path.read_bytes())
                middle = len(data) // 2
                data[middle:middle + 64] = b"\xff" * 64
                path.write_bytes(bytes(data))


def save_preset(path, **config):
    from keras_vitnorm import ViT

    ViT(**{**TINY, "num_channels": 1, "num_classes": 10, **config}).save_to_preset(str(path))


@pytest.mark.one_backend
@pytest.mark.parametrize("trigger", ["groupnorm", "randaugment", "truncated_weights",
                                     "other_models_config", "corrupt_jpeg"])
def test_a_refused_start_leaves_no_run_directory_behind(tmp_path, capsys, trigger):
    """Each refusal names its cause and leaves no run directory (or, in a directory that
    was there, nothing of the run), so the same command runs again once its cause is
    fixed instead of finding a half-made run in the way."""
    out = tmp_path / "run"
    argv = ["train", *SHORT_RUN, "--output-dir", str(out)]
    preset = tmp_path / "preset"
    if trigger == "groupnorm":
        argv += ["--norm", "groupnorm", "--set", "norm_groups=5"]
        message = "width=32, norm_groups=5"
    elif trigger == "randaugment":
        argv += ["--randaugment-ops", "2"]
        message = "RandAugment needs RGB images; this dataset/model has 1 channel(s)"
    elif trigger == "truncated_weights":
        save_preset(preset)
        weights = preset / "model.weights.npz"
        weights.write_bytes(weights.read_bytes()[:200])
        argv = ["train", *SHORT_RUN[SHORT_RUN.index("--steps"):], "--preset", str(preset),
                "--output-dir", str(out)]
        message = "model.weights.npz"
    elif trigger == "other_models_config":
        save_preset(preset)
        save_preset(tmp_path / "deeper", depth=2)
        shutil.copy(tmp_path / "deeper" / "config.json", preset / "config.json")
        argv = ["train", *SHORT_RUN[SHORT_RUN.index("--steps"):], "--preset", str(preset),
                "--output-dir", str(out)]
        message = f"Preset {str(preset)!r}"
    else:
        write_jpeg_folder(tmp_path / "images", corrupt=("dog",))
        argv += ["--dataset", f"folder:{tmp_path / 'images'}", "--batch-size", "8"]
        message = "cannot be used as images"
    status, _, err = run_cli(capsys, *argv)
    assert status == 2 and message in err, err
    assert not out.exists(), tree(out)
    # The same command again meets the same cause, not a run directory in its way.
    out.mkdir()  # and in a directory that was there, only what the run wrote goes
    status, _, err = run_cli(capsys, *argv)
    assert status == 2 and message in err and "already exists" not in err, err
    assert os.listdir(out) == []


@pytest.mark.one_backend
def test_a_fixed_input_trains_with_the_same_command_after_a_failed_start(tmp_path, capsys):
    write_jpeg_folder(tmp_path / "images", corrupt=("dog",))
    out = tmp_path / "run"
    argv = ["train", *SHORT_RUN, "--batch-size", "8", "--dataset",
            f"folder:{tmp_path / 'images'}", "--output-dir", str(out)]
    status, _, err = run_cli(capsys, *argv)
    assert status == 2 and "cannot be used as images" in err, err
    write_jpeg_folder(tmp_path / "images")  # the damaged files replaced
    status, _, err = run_cli(capsys, *argv)
    assert status == 0, err
    assert json.loads((out / "metrics.json").read_text())["status"] == "completed"


# ----------------------------------------------------------------------------- --overwrite of a run


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A completed run of `SHORT_RUN` (copied by each test that replaces it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert cli.main(["train", *SHORT_RUN, "--output-dir", str(out)]) == 0
    return out


def files_of(path):
    """`{relative path: bytes}` of every file under `path`."""
    return {name: open(os.path.join(path, name), "rb").read() for name in tree(path)
            if os.path.isfile(os.path.join(path, name))}


def copy_run(finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    return out, files_of(out)


@pytest.mark.one_backend
def test_an_overwrite_that_fails_before_its_first_checkpoint_puts_the_old_run_back(
        tmp_path, capsys, finished_run):
    """--overwrite keeps the run it replaces until the new run has its first checkpoint: a
    new run that fails before it (a preset whose weights file is truncated) leaves the old
    run as it was, bit for bit, so the same command without --overwrite still finds it."""
    out, before = copy_run(finished_run, tmp_path)
    assert "metrics.json" in before and os.path.join("preset", "model.weights.npz") in before
    preset = tmp_path / "preset"
    save_preset(preset)
    weights = preset / "model.weights.npz"
    good = weights.read_bytes()
    weights.write_bytes(good[:200])
    argv = ["train", *SHORT_RUN[SHORT_RUN.index("--steps"):], "--preset", str(preset),
            "--output-dir", str(out)]
    status, _, err = run_cli(capsys, *argv, "--overwrite")
    assert status == 2 and "model.weights.npz" in err, err
    assert files_of(out) == before and tree(out) == tree(finished_run)  # nothing else left
    status, _, err = run_cli(capsys, *argv)
    assert status == 2 and "already exists" in err, err
    weights.write_bytes(good)  # the cause fixed: --overwrite replaces the old run
    status, _, err = run_cli(capsys, *argv, "--overwrite")
    assert status == 0, err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["preset"] == str(preset)
    assert not [entry for entry in os.listdir(out) if entry.startswith(".")], os.listdir(out)


@pytest.mark.one_backend
def test_an_overwrite_that_runs_out_of_space_at_its_first_checkpoint_puts_the_old_run_back(
        tmp_path, capsys, finished_run, monkeypatch):
    """A full disk at the new run's first checkpoint leaves nothing of the new run to
    resume: the old run goes back, bit for bit, and the advice is the same command again
    (--resume would have continued the old run)."""
    from keras_vitnorm import durable

    out, before = copy_run(finished_run, tmp_path)
    argv = ["train", *SHORT_RUN, "--output-dir", str(out), "--seed", "3", "--overwrite"]
    monkeypatch.setenv(durable.FAULT_ENV, "enospc:checkpoint:weights")
    status, _, err = run_cli(capsys, *argv)
    assert status == 4, err
    assert err.strip().endswith(
        f"then run the same command again: the run it was replacing in {out} is back in "
        "place."), err
    assert files_of(out) == before and tree(out) == tree(finished_run)


@pytest.mark.one_backend
def test_an_overwrite_drops_the_old_run_once_the_new_one_has_its_first_checkpoint(
        tmp_path, finished_run):
    """Until the new run's first checkpoint the old run is kept whole (moved aside in the
    run directory); from it on, and after the run, no copy of it remains."""
    import keras

    from keras_vitnorm.training import train

    out, before = copy_run(finished_run, tmp_path)
    old = before["metrics.json"]

    def old_copies():
        return [os.path.join(root, name) for root, _, files in os.walk(out) for name in files
                if name == "metrics.json" and open(os.path.join(root, name), "rb").read() == old]

    seen = []

    class Look(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(len(old_copies()))

    config = TrainConfig.from_recipe("small", model=TINY, steps=3, warmup_steps=1, batch_size=16,
                                     backup_every=1, tensorboard=False, output_dir=str(out))
    metrics = train(config, overwrite=True, callbacks=[Look()], verbose=0)
    assert metrics["status"] == "completed"
    assert seen == [1, 0, 0]  # kept before the checkpoint of step 1, gone after it
    assert not old_copies()
    assert not [entry for entry in os.listdir(out) if entry.startswith(".")], os.listdir(out)


class Killed(BaseException):
    """A process killed at this point: nothing after it runs."""


@pytest.mark.one_backend
@pytest.mark.parametrize("then", ["--resume", "--overwrite"])
@pytest.mark.parametrize("killed", ["while moving the run aside", "before the first checkpoint"])
def test_an_overwrite_killed_before_the_new_runs_first_checkpoint_loses_no_run(
        tmp_path, capsys, monkeypatch, finished_run, killed, then):
    """A process killed after --overwrite moved (part of) the old run aside, before the new
    run's first checkpoint: the next --resume finds the old run put back, as it was, and
    says so; the next --overwrite replaces it."""
    out, before = copy_run(finished_run, tmp_path)
    if killed == "while moving the run aside":  # every entry moved, their folder not renamed
        def rename(source, destination):
            if os.path.basename(destination) == run_layout.REPLACED:
                raise Killed
            os.replace(source, destination)

        monkeypatch.setattr(os, "rename", rename)
        with pytest.raises(Killed):
            replaced_run.move_aside(str(out))
        monkeypatch.undo()
        assert os.listdir(out) == [run_layout.MOVING]  # not even its settings in place
    else:  # moved aside; the new run wrote its settings and then died
        replaced_run.move_aside(str(out))
        other = TrainConfig.from_recipe("small", model=TINY, steps=5, output_dir=str(out))
        durable.write_text(str(out / "train_config.json"), other.to_json())
    assert files_of(out) != before
    argv = ["train", *SHORT_RUN, "--output-dir", str(out), then, "--verbose", "1"]
    if then == "--overwrite":
        argv += ["--seed", "7"]
    status, printed, err = run_cli(capsys, *argv)
    assert status == 0, err
    assert "the run that an --overwrite was replacing" in printed, printed
    if then == "--resume":
        assert "has already completed: nothing to resume" in printed, printed
        assert files_of(out) == before and tree(out) == tree(finished_run)
    else:
        assert json.loads((out / "train_config.json").read_text())["seed"] == 7
        assert json.loads((out / "metrics.json").read_text())["status"] == "completed"
        assert not [entry for entry in os.listdir(out) if entry.startswith(".")], os.listdir(out)


@pytest.mark.one_backend
def test_an_overwrite_stopped_before_its_first_checkpoint_says_the_old_run_comes_back(
        tmp_path, capsys, monkeypatch, finished_run):
    from keras_vitnorm.training import fit_loop

    out, before = copy_run(finished_run, tmp_path)
    compile_classifier = fit_loop.compile_classifier

    def stopped_while_compiling(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return compile_classifier(*args, **kwargs)

    monkeypatch.setattr(fit_loop, "compile_classifier", stopped_while_compiling)
    argv = ["train", *SHORT_RUN, "--output-dir", str(out)]
    status, _, err = run_cli(capsys, *argv, "--overwrite", "--seed", "7")
    assert status == 143, err
    assert (f"before the new run's first checkpoint: the run it replaces in {out} is kept, and "
            "comes back with the next command there") in err, err
    monkeypatch.undo()
    status, printed, err = run_cli(capsys, *argv, "--resume", "--verbose", "1")
    assert status == 0 and "the run that an --overwrite was replacing" in printed, err
    assert files_of(out) == before and tree(out) == tree(finished_run)


# ----------------------------------------------------------------------------- paths


@pytest.mark.one_backend
def test_an_output_dir_that_is_a_file_is_named(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("a file of the user's")
    for argv in (["train", *TINY_RUN, "--output-dir", str(taken)],
                 ["train", *TINY_RUN, "--output-dir", str(taken), "--overwrite"],
                 ["train", *TINY_RUN, "--output-dir", str(taken), "--resume"],
                 ["ablate", "--groups", "stems", "--output-dir", str(taken), "--plan"]):
        status, _, err = run_cli(capsys, *argv)
        assert status == 2, (argv, err)
        assert f"{taken} is a file, not a directory" in err and "Errno" not in err, (argv, err)
    status, _, err = run_cli(capsys, "train", *TINY_RUN, "--output-dir", str(taken / "run"))
    assert status == 2 and f"{taken} is a file, not a directory" in err, err
    assert taken.read_text() == "a file of the user's"


@pytest.mark.one_backend
def test_convert_to_a_destination_that_is_a_file_is_named(tmp_path, capsys):
    save_preset(tmp_path / "preset")
    taken = tmp_path / "taken"
    taken.write_text("a file of the user's")
    status, _, err = run_cli(capsys, "convert", str(tmp_path / "preset"), str(taken))
    assert status == 2, err
    assert f"{taken} is a file, not a directory" in err and "Errno" not in err, err
    assert taken.read_text() == "a file of the user's"


# ----------------------------------------------------------------------------- default directory


@pytest.mark.one_backend
def test_runs_started_in_the_same_second_get_directories_of_their_own(tmp_path, monkeypatch,
                                                                      capsys):
    import datetime
    import types

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2024, 1, 1, 12, 0, 0)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run_directory, "datetime", types.SimpleNamespace(datetime=Frozen))
    first = TrainConfig.from_recipe("small", model=TINY, steps=2, warmup_steps=1, batch_size=16,
                                    tensorboard=False)
    taken = run_directory.default_output_dir(first)
    os.makedirs(taken)
    run_directory.prepare(first, taken, resume=False, overwrite=False)  # a run of other settings
    status, out, err = run_cli(capsys, "train", *SHORT_RUN, "--verbose", "1")
    assert status == 0, err
    assert sorted(os.listdir("runs")) == [os.path.basename(taken), os.path.basename(taken) + "-2"]
    assert json.loads(open(taken + "-2/metrics.json").read())["status"] == "completed"
    assert os.listdir(taken) == ["train_config.json"]  # the other run is as it was


# ----------------------------------------------------------------------------- finished runs


@pytest.mark.one_backend
def test_resuming_a_completed_run_succeeds_and_says_so(tmp_path, monkeypatch, capsys):
    """A scheduler that runs `--resume` again after the run completed (it was stopped
    while the process shut down, say) gets success, not an error."""
    monkeypatch.chdir(tmp_path)
    out = os.path.join("runs", "ti16-digits-20240101-000000")
    assert run_cli(capsys, "train", *SHORT_RUN, "--output-dir", out)[0] == 0
    metrics = open(os.path.join(out, "metrics.json")).read()
    status, printed, err = run_cli(capsys, "train", *SHORT_RUN, "--output-dir", out,
                                   "--resume", "--verbose", "1")
    assert status == 0, err
    assert f"The run in {out} has already completed: nothing to resume" in printed
    assert open(os.path.join(out, "metrics.json")).read() == metrics
    # Without --output-dir: the latest run of these settings in runs/ is the one.
    status, printed, err = run_cli(capsys, "train", *SHORT_RUN, "--resume", "--verbose", "1")
    assert status == 0, err
    assert f"The run in {out} has already completed: nothing to resume" in printed
    # Other settings are refused as before.
    status, _, err = run_cli(capsys, "train", *SHORT_RUN, "--steps", "3", "--output-dir", out,
                             "--resume")
    assert status == 2 and "steps: saved 2, now 3" in err, err


def test_a_sigterm_after_the_run_completed_does_not_fail_it(tmp_path, monkeypatch):
    from keras_vitnorm.training import train

    original = durable.fault_point

    def terminated_at_the_end(stage):
        if stage == "final:completed":
            os.kill(os.getpid(), signal.SIGTERM)
        original(stage)

    monkeypatch.setattr(durable, "fault_point", terminated_at_the_end)
    config = TrainConfig.from_recipe("small", model=TINY, steps=2, warmup_steps=1, batch_size=16,
                                     tensorboard=False, output_dir=str(tmp_path / "run"))
    try:
        metrics = train(config, verbose=0)
    except KeyboardInterrupt as error:  # RunInterrupted: the finished run counted as stopped
        pytest.fail(f"The completed run ended as stopped: {error}")
    assert metrics["status"] == "completed"
    assert json.loads((tmp_path / "run" / "metrics.json").read_text()) == metrics


@pytest.mark.one_backend
def test_a_sigterm_while_the_process_shuts_down_keeps_the_commands_status():
    code = textwrap.dedent("""
        import atexit, os, signal, time
        from keras_vitnorm import cli

        cli.COMMANDS["train"].run = lambda args: print("trained")
        atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.5)))
        cli.console(["train", "--verbose", "0"])
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "KERAS_BACKEND": "torch"})
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.strip() == "trained"


# ----------------------------------------------------------------------------- studies


def study_base(**overrides):
    settings = dict(preset="ti16", model=TINY, steps=4, batch_size=32, warmup_steps=1,
                    tensorboard=False)
    return TrainConfig.from_recipe("small", **{**settings, **overrides})


def fake_finished_run(job_file, accuracy, depth=1, edit=None):
    """Writes the run of a plan's job file as `ablate-job` leaves it, without training:
    its recorded settings (edited by `edit`, as a user who changed the job file), metrics,
    log and analysis (a residual stream of `depth` blocks on the study's 64 probe images)."""
    from keras_vitnorm.study import plan

    job = plan.read_job(job_file)
    settings = dict(job["config"])
    if edit:
        edit(settings)
    run_dir = job["run_dir"]
    os.makedirs(run_dir)
    durable.write_json(os.path.join(run_dir, "train_config.json"), settings)
    durable.write_json(os.path.join(run_dir, "metrics.json"), {
        "status": "completed", "test_accuracy": accuracy, "val_accuracy": accuracy,
        "steps": settings["steps"], "train_seconds": 1.0})
    with open(os.path.join(run_dir, "log.csv"), "w") as f:
        f.write(f"epoch,accuracy,loss,val_accuracy,val_loss\n0,{accuracy},1.0,{accuracy},1.0\n")
    names = ["stem"] + [f"block_{i}" for i in range(depth)]
    durable.write_json(os.path.join(run_dir, "analysis.json"), {
        "stem_scale": None, "probe_images": 64,
        "residual_stream": {"names": names, "rms": [1.0] * len(names),
                            "similarity": [0.5] * depth}})
    return run_dir


@pytest.mark.one_backend
def test_the_collect_leaves_out_a_run_trained_with_other_settings_than_its_plans(tmp_path,
                                                                                 capsys):
    """A job file edited before `ablate-job` ran it (a rate of 0.02 and depth 3 for a
    planned 0.002 and depth 1): the tables hold only the runs whose recorded settings
    are the plan's, and the collect names the one it left out and what differs."""
    from keras_vitnorm.study import run_study

    study = tmp_path / "study"
    args = (study_base(), ["norm_types"], [0, 1], str(study), {"norm_types": ["rmsnorm"]})
    commands = run_study(*args, verbose=0, mode="plan")
    files = sorted(command.split()[-1] for command in commands)
    assert [os.path.basename(f) for f in files] == [
        f"norm_types-{variant}-seed_{seed}.job.json" for variant in ("layernorm", "rmsnorm")
        for seed in (0, 1)]

    def edited(settings):
        settings["learning_rate"] = 0.02
        settings["model"] = {**settings["model"], "depth": 3}

    for index, path in enumerate(files):
        edit = edited if os.path.basename(path) == "norm_types-rmsnorm-seed_1.job.json" else None
        fake_finished_run(path, 0.5 + 0.1 * index, depth=3 if edit else 1, edit=edit)
    capsys.readouterr()
    rows = run_study(*args, verbose=1, mode="tables")
    printed = capsys.readouterr().out
    assert [(r["variant"], r["seed"]) for r in rows] == [("layernorm", 0), ("layernorm", 1),
                                                         ("rmsnorm", 0)]
    edited_run = os.path.join(str(study), "norm_types", "rmsnorm", "seed_1")
    assert (f"[norm_types] rmsnorm seed 1: left out of the tables: {edited_run} holds a run of "
            "other settings than the plan's (learning_rate: planned 0.002, recorded 0.02; "
            "model depth: planned 1, recorded 3)") in printed, printed
    results = (study / "results.csv").read_text()
    assert "0.02" not in results and os.path.join("rmsnorm", "seed_1") not in results
    assert "| rmsnorm | 1 |" in (study / "norm_types.md").read_text()
    assert (study / "figures" / "norm_types_residual_stream.png").exists()


@pytest.mark.one_backend
def test_a_collect_that_fails_part_way_rewrites_none_of_its_tables(tmp_path, monkeypatch):
    from keras_vitnorm.study import run_study
    from keras_vitnorm.study import runner

    study = tmp_path / "study"
    args = (study_base(), ["norm_types"], [0], str(study), {"norm_types": ["rmsnorm"]})
    files = sorted(command.split()[-1] for command in run_study(*args, verbose=0, mode="plan"))
    run_dirs = [fake_finished_run(path, 0.5 + 0.1 * index) for index, path in enumerate(files)]
    run_study(*args, verbose=0, mode="tables")
    before = {name: (study / name).read_bytes() for name in ("results.csv", "norm_types.md")}
    for run_dir in run_dirs:  # new results, whose collect then fails at its figures
        metrics = os.path.join(run_dir, "metrics.json")
        durable.write_json(metrics, {**durable.read_json(metrics), "test_accuracy": 0.9})

    def failing(*args, **kwargs):
        raise RuntimeError("a figure failed")

    monkeypatch.setattr(runner, "make_figures", failing)
    with pytest.raises(RuntimeError, match="a figure failed"):
        run_study(*args, verbose=0, mode="tables")
    assert {name: (study / name).read_bytes() for name in before} == before
    assert not [name for name in os.listdir(study) if name.startswith(".writing.")]


@pytest.mark.one_backend
def test_the_residual_stream_figure_and_table_split_a_variants_runs_of_different_depths(tmp_path):
    from keras_vitnorm.study import report

    rows = []
    for seed, depth in ((0, 2), (1, 3)):
        run_dir = tmp_path / f"seed_{seed}"
        run_dir.mkdir()
        names = ["stem"] + [f"block_{i}" for i in range(depth)]
        durable.write_json(str(run_dir / "analysis.json"), {
            "stem_scale": None, "probe_images": 4,
            "residual_stream": {"names": names, "rms": [1.0] * len(names),
                                "similarity": [0.5] * depth}})
        rows.append({"group": "g", "variant": "v", "seed": seed, "status": "completed",
                     "run_dir": str(run_dir)})
    paths = report._residual_stream_outputs("g", rows, np.zeros((4, 16, 16, 1)), str(tmp_path))
    table = open(paths[1]).read()
    assert "| v (2 blocks) | 1 |" in table and "| v (3 blocks) | 1 |" in table


@pytest.mark.one_backend
def test_a_plan_fits_the_recipes_warmup_to_the_run_as_train_does(tmp_path, capsys):
    """The recipe's 100 warm-up steps in a run of 80 (an epoch of the digits at batch 16):
    `train` fits them with a note, and so does the plan, whose job then trains."""
    from keras_vitnorm.study import plan
    from keras_vitnorm.study import run_study

    base = TrainConfig.from_recipe("small", preset="ti16", model=TINY, epochs=1, batch_size=16,
                                   tensorboard=False)
    assert base.warmup_steps == 100
    commands = run_study(base, ["norm_types"], [0], str(tmp_path / "study"),
                         {"norm_types": ["rmsnorm"]}, verbose=1, mode="plan")
    printed = capsys.readouterr().out
    assert printed.count("Note: 8 warm-up steps instead of the recipe's 100, which leave no "
                         "steps to decay over in the run's 80 (--warmup-steps sets it).") == 1
    for command in commands:
        assert plan.read_job(command.split()[-1])["config"]["warmup_steps"] == 8
    # A warm-up the user gave is kept, and refused by the run as `train` refuses it.
    given = TrainConfig.from_recipe("small", preset="ti16", model=TINY, epochs=1, batch_size=16,
                                    warmup_steps=100, tensorboard=False)
    commands = run_study(given, ["norm_types"], [0], str(tmp_path / "given"),
                         {"norm_types": ["rmsnorm"]}, verbose=0, mode="plan")
    assert plan.read_job(commands[0].split()[-1])["config"]["warmup_steps"] == 100


@pytest.mark.one_backend
@pytest.mark.parametrize("kwargs, message", [
    (dict(seeds=[0, 0]), "seeds (--seeds) name 0 more than once"),
    (dict(seeds=[0], groups=["stems", "stems"]), "groups (--groups) name 'stems' more than once"),
    (dict(seeds=[0, 1], lr_sweep=[1e-3, 2e-3], sweep_seeds=[1, 1]),
     "sweep_seeds (--sweep-seeds) name 1 more than once"),
    (dict(seeds=[0], variant_sweeps={("stems", "dpn"): [1e-3, 2e-3]}),
     "a learning-rate sweep is given for stems:dpn, which is not a variant of the study "
     "(stems:patch, stems:dual_patchnorm"),
])
def test_a_study_refuses_a_seed_or_group_given_twice(tmp_path, kwargs, message):
    """A seed given twice would put the same run in a variant's mean twice; a variant's
    own sweep must name one of the study's variants."""
    from keras_vitnorm.study import run_study

    kwargs = {"groups": ["stems"], **kwargs}
    with pytest.raises(ValueError) as error:
        run_study(study_base(), kwargs.pop("groups"), kwargs.pop("seeds"),
                  str(tmp_path / "study"), verbose=0, mode="plan", **kwargs)
    assert message in str(error.value)
    assert not (tmp_path / "study").exists()


# ----------------------------------------------------------------------------- more of the kind


@pytest.mark.one_backend
def test_path_arguments_of_the_wrong_kind_are_named(tmp_path, capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    status, _, err = run_cli(capsys, "ablate-job", str(folder))
    assert status == 2 and f"{folder} is a directory, not a JSON file" in err, err
    status, _, err = run_cli(capsys, "train", *TINY_RUN, "--dataset", "tfds:mnist", "--data-dir",
                             str(afile), "--output-dir", str(tmp_path / "run"))
    assert status == 2 and f"data_dir={str(afile)!r} is a file" in err, err
    assert not (tmp_path / "run").exists()
    run = tmp_path / "a_run"
    run.mkdir()
    (run / "train_config.json").write_text(TrainConfig().to_json())
    status, _, err = run_cli(capsys, "ablate", "--groups", "stems", "--output-dir", str(run),
                             "--plan")
    assert status == 2 and f"{run} is a training run's directory" in err, err
    assert os.listdir(run) == ["train_config.json"]


@pytest.mark.one_backend
def test_a_run_directory_given_as_the_preset_names_the_preset_inside_it(tmp_path, capsys):
    run = tmp_path / "run"
    save_preset(run / "preset")
    (run / "train_config.json").write_text("{}")
    status, _, err = run_cli(capsys, "train", *SHORT_RUN[SHORT_RUN.index("--steps"):],
                             "--preset", str(run), "--output-dir", str(tmp_path / "out"))
    assert status == 2, err
    assert f"Its folder {str(run / 'preset')!r} holds one" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.one_backend
def test_a_study_is_not_exported_into_another_study_or_into_itself(tmp_path):
    from keras_vitnorm.study import export_study
    from keras_vitnorm.study import runner

    runner._check_study_config(study_base(), str(tmp_path / "a"))
    runner._check_study_config(study_base(learning_rate=0.01), str(tmp_path / "b"))
    with pytest.raises(ValueError, match="holds another study"):
        export_study(str(tmp_path / "a"), str(tmp_path / "b"))
    with pytest.raises(ValueError, match="lies inside the study"):
        export_study(str(tmp_path / "a"), str(tmp_path / "a" / "export"))
    assert export_study(str(tmp_path / "a"), str(tmp_path / "copy")) == 0
    assert export_study(str(tmp_path / "a"), str(tmp_path / "copy")) == 0  # the same study again


@pytest.mark.one_backend
def test_a_vtab_sweep_refuses_a_value_given_twice_and_a_finished_run_of_other_settings(tmp_path):
    import dataclasses

    from keras_vitnorm.study import vtab

    preset = tmp_path / "model" / "preset"
    save_preset(preset)
    base = TrainConfig.from_recipe("vtab_1k", preset=str(preset), steps=2, batch_size=16,
                                   tensorboard=False)
    out = tmp_path / "vtab"
    with pytest.raises(ValueError, match="seeds name 0 more than once"):
        vtab.run_vtab(base, [str(preset)], ["digits"], str(out), [1e-3], [0, 0], verbose=0)
    run_dir = out / "model" / "digits" / "lr_0.001" / "seed_0"
    run_dir.mkdir(parents=True)
    other = dataclasses.replace(base, dataset="digits", learning_rate=1e-3, seed=0, steps=5,
                                train_examples=vtab.TRAIN_EXAMPLES,
                                val_examples=vtab.VAL_EXAMPLES)
    (run_dir / "train_config.json").write_text(other.to_json())
    (run_dir / "metrics.json").write_text(json.dumps({"status": "completed", "val_accuracy": 0.5,
                                                      "test_accuracy": 0.5}))
    with pytest.raises(ValueError, match=r"other settings than this sweep's \(steps: planned 2, "
                                         r"recorded 5\)"):
        vtab.run_vtab(base, [str(preset)], ["digits"], str(out), [1e-3], [0], verbose=0)
    assert not (out / "vtab_results.csv").exists()
