"""The console command: help without a backend, the frameworks' log lines kept off stderr."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

from keras_vitnorm import choices
from keras_vitnorm import framework_logs
from keras_vitnorm.study.variants import VARIANT_GROUPS
from test_gpu_kit import refusing
from test_training import ROOT
from test_training import TINY
from test_training import run_python

COMMANDS = ("train", "ablate", "evaluate", "convert", "segment", "vtab", "lit")
BACKEND_MODULES = ("keras", "tensorflow", "jax", "torch", "numpy")

# Lines as TensorFlow 2.21 and XLA print them, and lines the command's user must see.
FRAMEWORK_LINES = (
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
    b"I0000 00:00:1795581447.820093   27210 port.cc:153] oneDNN custom operations are on.\n",
    b"E0000 00:00:1795581462.656604   27210 cuda_platform.cc:52] failed call to cuInit: INTERNAL\n",
    b"W0000 00:00:1795573457.706328   29858 cache_dataset_ops.cc:912] The calling iterator did not\n",
    b"To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow "
    b"with the appropriate compiler flags.\n",
    b"WARNING:absl:You are saving your model as an HDF5 file\n",
)
USER_LINES = (
    b"keras-vitnorm train: error: Unknown preset 'nope'\n",
    b"Traceback (most recent call last):\n",
    b"F0000 00:00:1795581462.656604   27210 stream.cc:10] Check failed: device lost\n",
    b"UserWarning: a warning of this project\n",
)


def test_the_cli_vocabulary_is_the_library_vocabulary():
    assert choices.VARIANT_GROUP_NAMES == tuple(VARIANT_GROUPS)


def test_model_switches_reach_the_train_config():
    from keras_vitnorm.cli import build_parser
    from keras_vitnorm.cli import train_config_from_args

    args = build_parser().parse_args(["train", "--weight-standardization", "--qk-norm", "--norm", "dyt"])
    model = train_config_from_args(args).model
    assert {k: model[k] for k in ("weight_standardization", "qk_norm", "norm")} == {
        "weight_standardization": True, "qk_norm": True, "norm": "dyt"}
    assert "weight_standardization" not in train_config_from_args(
        build_parser().parse_args(["train"])).model


def test_help_of_every_command_imports_no_backend():
    code = f"""
        import sys
        from keras_vitnorm import cli
        for command in {COMMANDS!r}:
            try:
                cli.main([command, "--help"])
            except SystemExit as exit:
                assert exit.code == 0, command
        print(sorted(m for m in {BACKEND_MODULES!r} if m in sys.modules))
    """
    result = run_python(code, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert "--verbose" in result.stdout and "Abseil's own log lines" in result.stdout


def test_framework_log_lines_are_recognized():
    assert all(framework_logs.is_framework_log(line) for line in FRAMEWORK_LINES)
    assert not any(framework_logs.is_framework_log(line) for line in USER_LINES)


def test_hidden_drops_framework_lines_written_to_fd_2_and_passes_the_rest_in_order():
    code = f"""
        import os, sys
        from keras_vitnorm import framework_logs
        lines = {[*FRAMEWORK_LINES, *USER_LINES]!r}
        with framework_logs.hidden():
            for line in lines:
                os.write(2, line)  # as the C++ libraries write
            print("python's own stderr", file=sys.stderr)
        print("after the block", file=sys.stderr)
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                            timeout=60)
    expected = b"".join(USER_LINES) + b"python's own stderr\nafter the block\n"
    assert result.returncode == 0 and result.stderr == expected


def test_console_train_prints_no_framework_log_line(tmp_path):
    flags = [f"--set={key}={value}" for key, value in TINY.items() if key != "image_size"]
    command = [sys.executable, "-m", "keras_vitnorm", "train", "--steps", "2", "--batch-size", "16",
               "--warmup-steps", "0", "--image-size", "16", "--no-tensorboard", *flags]
    environment = {**os.environ, "KERAS_BACKEND": keras.backend.backend()}
    quiet = subprocess.run([*command, "--output-dir", str(tmp_path / "a"), "--verbose", "0"], cwd=ROOT,
                           env=environment, capture_output=True, timeout=300)
    assert quiet.returncode == 0, quiet.stderr.decode()
    assert quiet.stderr.splitlines() == [], quiet.stderr.decode()
    assert (tmp_path / "a" / "metrics.json").exists()


@pytest.mark.parametrize("import_keras_first", [True, False])
def test_import_is_lazy_and_registers_the_models_when_keras_is_loaded(tmp_path, import_keras_first):
    path = tmp_path / "model.keras"
    code = f"""
        import sys
        {"import keras" if import_keras_first else ""}
        import keras_vitnorm
        if {import_keras_first}:
            keras_vitnorm.ViT(**{TINY!r}, num_classes=3).save({str(path)!r})
            import subprocess  # a fresh process: nothing of keras_vitnorm touched but the import
            check = "import keras, keras_vitnorm; keras.saving.load_model({str(path)!r}); print('loaded')"
            print(subprocess.run([sys.executable, "-c", check], capture_output=True, text=True).stdout)
        else:
            print("keras" in sys.modules, keras_vitnorm.__version__, sorted(keras_vitnorm.__all__)[:2])
            print(keras_vitnorm.ViT.__name__, "keras" in sys.modules)
    """
    result = run_python(code, timeout=300)
    assert result.returncode == 0, result.stderr
    if import_keras_first:
        assert "loaded" in result.stdout
    else:
        first, second = result.stdout.strip().splitlines()[-2:]
        assert first.startswith("False 0.")
        assert second == "ViT True"


@pytest.mark.one_backend
def test_every_command_ends_by_one_mapping_from_error_to_exit_status():
    from keras_vitnorm.cli.errors import exit_status
    from keras_vitnorm.study.workers import RunsFailed
    from keras_vitnorm.training import TrainingDiverged
    from keras_vitnorm.training.run_files import LockedError
    from keras_vitnorm.training.run_files import StorageError

    def failed(*codes):
        job = {"group": "g", "name": "n", "seed": 0, "log": "/nowhere.log"}
        return RunsFailed([(job, code) for code in codes])

    assert exit_status(TrainingDiverged("NaN", 7)) == 3
    assert exit_status(StorageError(28, "disk full")) == 4
    assert exit_status(failed(4, 4)) == 4 and exit_status(failed(4, 2)) == 1
    for error in (ValueError("bad"), FileExistsError("there"), LockedError("in use"),
                  ImportError("pip install x"), OSError("unreadable")):
        assert exit_status(error) == 2, error
    assert exit_status(RuntimeError("a bug")) is None  # shown with its traceback


@pytest.mark.one_backend
def test_a_command_without_its_extra_says_which_extra_to_install(monkeypatch, capsys):
    from keras_vitnorm import cli
    from keras_vitnorm.cli import errors

    monkeypatch.setitem(errors.EXTRAS, "study", (("not-installed", "no_such_module_here"),))
    for command in ("ablate", "vtab", "lit", "segment"):
        argv = {"ablate": ["--groups", "stems", "--output-dir", "s"],
                "vtab": ["--presets", "p", "--datasets", "digits", "--output-dir", "s"],
                "lit": ["--output-dir", "s"], "segment": ["--output-dir", "s"]}[command]
        assert cli.main([command, *argv]) == 2
        error = capsys.readouterr().err.strip()
        assert error == (f"keras-vitnorm {command}: error: this command needs the 'study' extra: "
                         "pip install 'keras-vitnorm[study]' (missing: not-installed)."), error


#: A `keras-vitnorm` command run by `python -c` with its arguments.
CONSOLE = """
from keras_vitnorm.cli import console
sys.argv = ["keras-vitnorm", *sys.argv[1:]]
console()
"""
#: The same where no backend is installed (a plain `pip install keras-vitnorm`).
NO_BACKEND = refusing("tensorflow", "jax", "jaxlib", "torch") + CONSOLE


@pytest.mark.one_backend
def test_without_tensorflow_the_lab_trains_folders_and_names_the_package_tfds_needs(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in ("a", "b"):
        for split, count in (("train", 6), ("test", 2)):
            os.makedirs(tmp_path / "images" / split / label, exist_ok=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / "images" / split / label / f"{i}.jpg")
    environment = dict(os.environ, KERAS_BACKEND="jax")
    tiny = ["--image-size", "16", "--patch-size", "8", "--width", "8", "--num-heads", "2",
            "--mlp-dim", "16", "--depth", "1", "--batch-size", "4", "--steps", "1",
            "--input-pipeline", "python"]

    def command(*argv, refused=("tensorflow", "tensorflow_datasets")):
        code = refusing(*refused) + CONSOLE
        return subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT,
                              env=environment, capture_output=True, text=True, timeout=300)

    # The study's plan needs no TensorFlow: the lent GPU machine plans and runs it so.
    planned = command("ablate", "--groups", "stems", "--dataset", f"folder:{tmp_path / 'images'}",
                      *tiny, "--plan", "--output-dir", str(tmp_path / "study"))
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert (tmp_path / "study" / "plan" / "commands.txt").read_text().strip()
    # With the queued studies' augmentation (Imagenette's zoom crops, RandAugment,
    # MixUp, stochastic depth), as the python pipeline computes it there.
    augmented = ["--crop", "zoom", "--zoom", "0.75", "--flip", "--randaugment-ops", "2",
                 "--randaugment-factor", "0.5", "--mixup", "0.2", "--drop-path", "0.1"]
    trained = command("train", "--dataset", f"folder:{tmp_path / 'images'}", *tiny, *augmented,
                      "--no-tensorboard", "--output-dir", str(tmp_path / "run"))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["randaugment_ops"] == 2
    # With TensorFlow but not tensorflow-datasets, a tfds: dataset names the package.
    tfds = command("train", "--dataset", "tfds:mnist", *tiny[:-2], "--output-dir",
                   str(tmp_path / "tfds_run"), refused=("tensorflow_datasets",))
    assert tfds.returncode == 2, tfds.stderr[-3000:]
    assert tfds.stderr.strip().splitlines()[-1] == (
        "keras-vitnorm train: error: tfds:<name> datasets need tensorflow-datasets, which is not "
        "installed: pip install 'keras-vitnorm[train]' (or read a folder of images, "
        "folder:<path>, or digits)."), tfds.stderr


@pytest.mark.one_backend
@pytest.mark.parametrize("backend", [None, "jax"])
def test_a_command_without_a_backend_says_which_extra_to_install(tmp_path, backend):
    environment = {key: value for key, value in os.environ.items() if key != "KERAS_BACKEND"}
    if backend:
        environment["KERAS_BACKEND"] = backend
    # Keras reads its default backend from KERAS_HOME's keras.json: none here (tensorflow).
    environment["KERAS_HOME"] = str(tmp_path)
    result = subprocess.run([sys.executable, "-c", NO_BACKEND, "train", "--steps", "2"],
                            cwd=ROOT, env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    expected = backend or "tensorflow"
    assert result.stderr.strip().splitlines() == [
        f"keras-vitnorm train: error: Keras' backend {expected!r} is not installed "
        f"(KERAS_BACKEND={expected}{'' if backend else ', the default'}). Install it with "
        f"pip install 'keras-vitnorm[{expected}]', or another one (jax, tensorflow, torch) and "
        "set KERAS_BACKEND to it."], result.stderr
