"""tools/gpu/run.sh rehearsed on the CPU: what a lent GPU session runs, call by call.

A lent GPU session has minutes of device time and a bare machine each time, so the
script has to work on its first call there. This rehearsal runs it as the session
would (tools/gpu/README.md): the dataset's parts staged over two calls, then a call
that reassembles and checks them, plans a recipe study, trains the plan's first runs
side by side under a time limit and brings the study back as an archive; then a
second call on the same ("warm") machine, which must plan only what is left.
GPU_KIT and GPU_WORK point the kit and the machine's folders into the test's own
folder; the runs are a one-block model on 32-px images, two steps each (the whole
rehearsal takes one to two minutes on a 2-core machine).
"""

import hashlib
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_SH = os.path.join(ROOT, "tools", "gpu", "run.sh")
#: Extra ablate options: they come last in the recipe's command, so they win.
TINY = ["--steps", "2", "--steps-per-epoch", "2", "--warmup-steps", "1", "--grad-norm-every", "2",
        "--batch-size", "4", "--width", "16", "--num-heads", "2", "--mlp-dim", "32",
        "--depth", "1", "--patch-size", "8", "--mixed-precision", "float32"]


def _cifar10_like_archive(folder):
    """A tar in cifar10-jpg.tar's layout (train/<class>/*.jpg, test/<class>/*.jpg)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    images = folder / "images"
    for split, count in (("train", 8), ("test", 2)):
        for name in ("airplane", "bird", "cat"):
            os.makedirs(images / split / name)
            for i in range(count):
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(images / split / name / f"{i:04d}.jpg")
    archive = folder / "cifar10-jpg.tar"
    with tarfile.open(archive, "w") as tar:
        for split in ("train", "test"):
            tar.add(images / split, arcname=split)
    return archive


def _kit_with(kit, archive, part):
    """The kit as one staging call carries it: one part and the checksum."""
    parts = kit / "parts"
    for name in os.listdir(parts) if parts.exists() else ():
        os.remove(parts / name)
    os.makedirs(parts, exist_ok=True)
    data = archive.read_bytes()
    half = len(data) // 2
    (parts / f"cifar10-jpg.tar.part-0{part}").write_bytes(data[:half] if part == 0 else data[half:])
    digest = hashlib.sha256(data).hexdigest()
    (parts / "cifar10-jpg.tar.sha256").write_text(f"{digest}  cifar10-jpg.tar\n")


def _run(tmp_path, *argv):
    env = dict(os.environ, PYTHON=sys.executable, GPU_KIT=str(tmp_path / "kit"),
               GPU_WORK=str(tmp_path / "machine"), OUT=str(tmp_path / "out"))
    env.pop("KERAS_BACKEND", None)
    os.makedirs(tmp_path / "out", exist_ok=True)
    return subprocess.run(["bash", RUN_SH, *argv], env=env, capture_output=True, text=True,
                          timeout=600)


def _finished_runs(archive):
    with tarfile.open(archive) as tar:
        return sorted({os.path.dirname(name) for name in tar.getnames()
                       if name.endswith("metrics.json")})


@pytest.mark.one_backend
def test_the_gpu_study_script_stages_trains_resumes_and_exports_on_the_cpu(tmp_path):
    archive = _cifar10_like_archive(tmp_path)
    for part in (0, 1):  # two staging calls, one part each
        _kit_with(tmp_path / "kit", archive, part)
        done = _run(tmp_path, "stage")
        assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "machine" / "parts")) == [
        "cifar10-jpg.tar.part-00", "cifar10-jpg.tar.part-01", "cifar10-jpg.tar.sha256"]

    os.remove(tmp_path / "kit" / "parts" / "cifar10-jpg.tar.part-01")  # the third call's carry
    done = _run(tmp_path, "cifar10", "converged_lr", "2", "300", *TINY)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    study = tmp_path / "machine" / "studies" / "converged_lr"
    plan = (study / "plan" / "commands.txt").read_text().splitlines()
    assert len(plan) == 24  # the sweep: 8 variants at 3 rates, seed 0
    assert all(line.startswith("KERAS_BACKEND=jax keras-vitnorm ablate-job ") for line in plan)
    first = _finished_runs(tmp_path / "out" / "converged_lr.tar.gz")
    assert len(first) == 2, done.stdout[-3000:]
    assert os.path.exists(tmp_path / "out" / "converged_lr-logs.tar.gz")

    # The same command on the warm machine: the finished runs stay, the plan is the rest.
    done = _run(tmp_path, "cifar10", "converged_lr", "2", "300", *TINY)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rest = (study / "plan" / "commands.txt").read_text().splitlines()
    assert len(rest) == 22 and not set(rest) & set(plan[:2])
    second = _finished_runs(tmp_path / "out" / "converged_lr.tar.gz")
    assert len(second) == 4 and set(first) < set(second)


@pytest.mark.one_backend
def test_the_gpu_study_script_names_missing_parts_and_bad_arguments(tmp_path):
    archive = _cifar10_like_archive(tmp_path)
    _kit_with(tmp_path / "kit", archive, 0)  # part-01 never staged
    done = _run(tmp_path, "cifar10", "converged_lr", "2", "30", *TINY)
    assert done.returncode == 1
    assert "the parts of cifar10-jpg do not add up: carry the missing ones" in done.stderr
    assert not os.path.exists(tmp_path / "machine" / "data" / "cifar10-jpg")
    done = _run(tmp_path, "mnist", "converged", "2", "30")
    assert done.returncode == 2 and "unknown dataset 'mnist': cifar10 or imagenette" in done.stderr
    done = _run(tmp_path, "cifar10", "converged")
    assert done.returncode == 2 and "usage: " in done.stderr
