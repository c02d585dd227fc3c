"""tools/gpu rehearsed on the CPU: run.sh, what a lent GPU session runs, call by call; the
scripts of each check and the tools they call (bench_packing.py, host_waits.py, carry.py).

A lent GPU session has minutes of device time and a bare machine each time, so its
scripts have to work on their first call there. GPU_KIT and GPU_WORK point the kit and
the machine's folders into the test's own folder; the runs are a one-block model on
32-px images, two steps each.
"""

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "gpu"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_input  # noqa: E402
import bench_packing  # noqa: E402
import bench_variants  # noqa: E402
import carry  # noqa: E402
import host_waits  # noqa: E402
import profile_step  # noqa: E402

RUN_SH = os.path.join(ROOT, "tools", "gpu", "run.sh")
#: Extra ablate options: they come last in the recipe's command, so they win.
TINY = ["--image-size", "32", "--steps", "2", "--steps-per-epoch", "2", "--warmup-steps", "1",
        "--grad-norm-every", "2", "--batch-size", "4", "--width", "16", "--num-heads", "2",
        "--mlp-dim", "32", "--depth", "1", "--patch-size", "8", "--mixed-precision", "float32"]


#: Per dataset: its archive's name, its test folder, and a study of its recipe with the
#: number of runs its first plan lists.
DATASETS = {
    "cifar10": ("cifar10-jpg", "test", "converged_lr", 24),  # the sweep: 8 variants x 3 rates
    "imagenette": ("imagenette2_224", "val", "calibrate", 8),  # 8 variants, one rate
}


def _archive(folder, dataset):
    """A tar in the layout of ../shared/data's archive (train/<class>/, test/ or val/)."""
    from PIL import Image

    name, test, _, _ = DATASETS[dataset]
    rng = np.random.default_rng(0)
    images = folder / "images"
    for split, count in (("train", 8), (test, 2)):
        for label in ("n01440764", "n02102040", "n02979186"):
            os.makedirs(images / split / label)
            for i in range(count):
                pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(images / split / label / f"{i:04d}.jpg")
    archive = folder / f"{name}.tar"
    with tarfile.open(archive, "w") as tar:
        for split in ("train", test):
            tar.add(images / split, arcname=split)
    return archive


def _kit_with(kit, archive, part):
    """The kit as one staging call carries it: one of two parts, and the checksum."""
    parts = kit / "parts"
    for name in os.listdir(parts) if parts.exists() else ():
        os.remove(parts / name)
    os.makedirs(parts, exist_ok=True)
    data = archive.read_bytes()
    half = len(data) // 2
    (parts / f"{archive.name}.part-0{part}").write_bytes(data[:half] if part == 0 else data[half:])
    digest = hashlib.sha256(data).hexdigest()
    (parts / f"{archive.name}.sha256").write_text(f"{digest}  {archive.name}\n")


def refusing(*modules):
    """Python source that makes the process it runs in refuse to import `modules` and
    their submodules (and `importlib.util.find_spec` not find them), as where they are
    not installed."""
    return f"""
import importlib.abc, importlib.util, sys

REFUSED = {modules!r}

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in REFUSED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name.split(".")[0])
        return None

find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *args: (
    None if name.split(".")[0] in REFUSED else find_spec(name, *args))
sys.meta_path.insert(0, Refuse())
"""


#: The machine's image has no TensorFlow and no tensorflow-datasets (the device tool's
#: package list): its site folder, on run.sh's PYTHONPATH, refuses them here.
NO_TENSORFLOW = refusing("tensorflow", "tensorflow_datasets")


def _machine_env(tmp_path, **environment):
    """The environment of a script on the machine: the kit, its folders and $OUT in
    `tmp_path`, no KERAS_BACKEND but what the script sets."""
    env = dict(os.environ, PYTHON=sys.executable, GPU_KIT=str(tmp_path / "kit"),
               GPU_WORK=str(tmp_path / "machine"), OUT=str(tmp_path / "out"))
    env.pop("KERAS_BACKEND", None)
    env.update(environment)
    os.makedirs(tmp_path / "out", exist_ok=True)
    return env


def _run(tmp_path, *argv, **environment):
    site = tmp_path / "machine" / "site"
    os.makedirs(site, exist_ok=True)
    (site / "sitecustomize.py").write_text(NO_TENSORFLOW)
    # GPU_RESULTS: the test's own committed studies, whatever the repository holds.
    env = _machine_env(tmp_path, GPU_RESULTS=str(tmp_path / "committed"), **environment)
    return subprocess.run(["bash", RUN_SH, *argv], env=env, capture_output=True, text=True,
                          timeout=600)


def _recipe(data, studies, study, *options):
    """recipes/cifar10_study.sh on `study` as run.sh calls it, `data` its dataset folder."""
    env = dict(os.environ, PYTHON=sys.executable, STUDIES=study)
    env.pop("KERAS_BACKEND", None)
    done = subprocess.run(["bash", os.path.join(ROOT, "recipes", "cifar10_study.sh"), str(data),
                           str(studies), *options, "--parallel", "1"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _finished_runs(archive):
    with tarfile.open(archive) as tar:
        return sorted({os.path.dirname(name) for name in tar.getnames()
                       if name.endswith("metrics.json")})


@pytest.mark.one_backend
@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_the_gpu_study_script_stages_trains_resumes_and_exports_on_the_cpu(tmp_path, dataset):
    name, _, study_name, planned = DATASETS[dataset]
    archive = _archive(tmp_path, dataset)
    for part in (0, 1):  # two staging calls, one part each
        _kit_with(tmp_path / "kit", archive, part)
        done = _run(tmp_path, "stage")
        assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "machine" / "parts")) == [
        f"{name}.tar.part-00", f"{name}.tar.part-01", f"{name}.tar.sha256"]

    os.remove(tmp_path / "kit" / "parts" / f"{name}.tar.part-01")  # the third call's carry
    if dataset == "imagenette":
        # A call whose time runs out while its runs train: within its SECONDS it stops
        # them and still brings back their logs, the tables' log and the export.
        started = time.monotonic()
        done = _run(tmp_path, dataset, study_name, "2", "40", *TINY, GPU_TABLES_SECONDS="12",
                    GPU_MPS="1")  # on a machine without MPS's daemon
        took = time.monotonic() - started
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert ("GPU_MPS=1: nvidia-cuda-mps-control is not on PATH; the runs share the GPU "
                "without MPS") in done.stdout
        assert took < 40 + 5, (took, done.stdout[-3000:])
        assert _finished_runs(tmp_path / "out" / f"{study_name}.tar.gz") == []
        assert "no run has finished: no tables to write" in done.stdout
        assert "the tables step failed" not in done.stdout
        with tarfile.open(tmp_path / "out" / f"{study_name}-logs.tar.gz") as tar:
            assert sum(name.endswith(".job.json.log") for name in tar.getnames()) == 2
    # With GPU_MPS=1 and a stand-in for MPS's control daemon, which logs its calls.
    fake = tmp_path / "bin"
    os.makedirs(fake)
    calls = _fake_mps_control(fake)
    done = _run(tmp_path, dataset, study_name, "2", "300", *TINY, GPU_MPS="1",
                PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    pipe = tmp_path / "machine" / "mps" / "pipe"
    assert f"GPU_MPS=1: the MPS daemon runs (pipe {pipe})" in done.stdout
    assert calls.read_text().splitlines() == [f"start {pipe}", "get_server_list", "quit"]
    assert "no MPS server ran: the runs took turns on the GPU" in done.stdout  # it lists none
    study = tmp_path / "machine" / "studies" / study_name
    plan = (study / "plan" / "commands.txt").read_text().splitlines()
    assert len(plan) == planned
    assert all(line.startswith("KERAS_BACKEND=jax keras-vitnorm ablate-job ") for line in plan)
    exported = tmp_path / "out" / f"{study_name}.tar.gz"
    first = _finished_runs(exported)
    assert len(first) == 2, done.stdout[-3000:]
    assert os.path.exists(tmp_path / "out" / f"{study_name}-logs.tar.gz")

    if dataset != "cifar10":
        return  # the next session's start is the same script for either dataset
    # The next session, as tools/gpu/README.md's step 4 has it: the exported study
    # committed, a bare machine (the same paths) with the parts staged again, the
    # same command. It starts from the committed runs and plans the rest.
    from keras_vitnorm.study import export_study

    with tarfile.open(exported) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    # The tables written again here from the runs' files (the call may cut them short).
    os.remove(tmp_path / "unpacked" / study_name / "lr_sweep.csv")
    _recipe(tmp_path / "machine" / "data" / name, tmp_path / "unpacked", study_name, *TINY,
            "--tables-only")
    swept = (tmp_path / "unpacked" / study_name / "lr_sweep.csv").read_text().splitlines()
    assert len(swept) == 1 + 2  # a header and the two finished runs
    export_study(str(tmp_path / "unpacked" / study_name),
                 str(tmp_path / "committed" / f"cifar10-{study_name.replace('_', '-')}"))
    for entry in os.listdir(tmp_path / "machine"):  # a bare machine at the same paths
        path = tmp_path / "machine" / entry
        if path.is_dir() and entry != "parts":  # the parts are staged again
            shutil.rmtree(path)
        elif path.is_file():
            os.remove(path)
    done = _run(tmp_path, dataset, study_name, "2", "300", *TINY)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rest = (study / "plan" / "commands.txt").read_text().splitlines()
    assert len(rest) == planned - 2 and not set(rest) & set(plan[:2])
    second = _finished_runs(exported)
    assert len(second) == 4 and set(first) < set(second)


@pytest.mark.one_backend
def test_the_gpu_study_script_names_missing_parts_and_bad_arguments(tmp_path):
    archive = _archive(tmp_path, "cifar10")
    _kit_with(tmp_path / "kit", archive, 0)  # part-01 never staged
    done = _run(tmp_path, "cifar10", "converged_lr", "2", "30", *TINY)
    assert done.returncode == 1
    assert "the parts of cifar10-jpg do not add up: carry the missing ones" in done.stderr
    assert not os.path.exists(tmp_path / "machine" / "data" / "cifar10-jpg")
    done = _run(tmp_path, "mnist", "converged", "2", "30")
    assert done.returncode == 2 and "unknown dataset 'mnist': cifar10 or imagenette" in done.stderr
    done = _run(tmp_path, "cifar10", "converged")
    assert done.returncode == 2 and "usage: " in done.stderr


@pytest.mark.one_backend
def test_the_imagenette_check_unpacks_the_staged_parts_and_calls_both_benchmarks(
        tmp_path, monkeypatch):
    """tools/gpu/imagenette_check.sh after one staging call, with `python3` and
    `nvidia-smi` stood in for: `run.sh unpack` reassembles and unpacks the data, and the
    input benchmark and the profile get arguments they accept, the input its folder."""
    archive = _archive(tmp_path, "imagenette")
    _kit_with(tmp_path / "kit", archive, 0)
    assert _run(tmp_path, "stage").returncode == 0
    _kit_with(tmp_path / "kit", archive, 1)
    done, commands = with_stand_in_gpu(tmp_path, "imagenette_check.sh", printed="| a row |")
    assert done.returncode == 0, done.stderr[-2000:]
    data = tmp_path / "machine" / "data" / "imagenette2_224"
    assert sorted(os.listdir(data)) == ["train", "val"]
    assert [c[0] for c in commands] == ["benchmarks/bench_input.py", "benchmarks/profile_step.py"]
    monkeypatch.setenv("KERAS_BACKEND", "jax")  # as the script exports it
    inputs = bench_input.parse_arguments(commands[0][1:])
    assert inputs.dataset == f"folder:{data}/train" and inputs.recipe == "imagenette"
    assert inputs.pipelines == ["python"] and inputs.mixed_precision == "mixed_bfloat16"
    profile = profile_step.parse_arguments(commands[1][1:])
    assert (profile.device, profile.preset, profile.batch_size) == ("gpu", "ti16", 256)
    assert os.path.dirname(profile.json) == str(tmp_path / "out")
    assert (tmp_path / "out" / "imagenette_check.md").read_text().count("| a row |") == 2
    bad = _run(tmp_path, "unpack")
    assert bad.returncode == 2 and "unpack DATASET" in bad.stderr


def with_stand_in_gpu(tmp_path, script, *argv, printed=""):
    """Runs `tools/gpu/<script> argv` with `python3` and `nvidia-smi` stood in for (the
    stand-in python3 logs its arguments and prints `printed`); returns the finished
    process and the argument lists python3 was called with."""
    fake = tmp_path / "bin"
    os.makedirs(fake, exist_ok=True)
    calls = tmp_path / "calls"
    calls.write_text("")
    (fake / "python3").write_text(
        f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" "--END--" >> {calls}\n'
        + (f"echo {printed!r}\n" if printed else ""))
    (fake / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'a stand-in GPU, 1 MiB'\n")
    for tool in ("python3", "nvidia-smi"):
        os.chmod(fake / tool, 0o755)
    env = _machine_env(tmp_path, PATH=f"{fake}:{os.environ['PATH']}",
                       PYTHON=str(fake / "python3"))
    done = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu", script), *argv], env=env,
                          capture_output=True, text=True, timeout=60)
    commands = [c.strip("\n").split("\n") for c in calls.read_text().split("--END--\n")
                if c.strip()]
    return done, commands


@pytest.mark.one_backend
@pytest.mark.parametrize("part", ["s16", "b16-jax", "b16-torch"])
def test_each_efficiency_part_calls_the_benchmark_with_arguments_it_accepts(tmp_path, part):
    """tools/gpu/efficiency.sh, with `python3` and `nvidia-smi` stood in for: every
    benchmark command it would run on the GPU parses, and writes its JSON to $OUT."""
    done, commands = with_stand_in_gpu(tmp_path, "efficiency.sh", part)
    assert done.returncode == 0, done.stderr[-2000:]
    benchmarks = [c[1:] for c in commands if c[0] == "benchmarks/bench_variants.py"]
    assert len(benchmarks) == {"s16": 2, "b16-jax": 1, "b16-torch": 2}[part]
    for argv in benchmarks:
        args = bench_variants.parse_arguments(argv)  # exits on an argument it does not take
        assert args.device == "gpu" and args.mixed_precision == "mixed_bfloat16"
        assert os.path.dirname(args.json) == str(tmp_path / "out")
    bad, _ = with_stand_in_gpu(tmp_path, "efficiency.sh", "b32")
    assert bad.returncode == 2 and "usage: " in bad.stderr


def _plan(recipe_data, studies, study):
    """The recipe's `--plan` for `study` as run.sh calls it, with `recipe_data` as the
    dataset folder (planning reads no image)."""
    _recipe(recipe_data, studies, study, "--plan")
    return (studies / study / "plan" / "commands.txt").read_text().splitlines()


@pytest.mark.one_backend
def test_the_committed_converged_lr_study_is_the_recipes_plan_on_the_gpu_machine(tmp_path):
    """docs/study-results/cifar10-converged-lr, where each lent session's
    `cifar10 converged_lr` call starts, holds the converged comparison's runs at 1e-3
    (its README): the recipe on the GPU machine (run.sh's data folder,
    /tmp/data/cifar10-jpg) plans the same study, those runs' settings are the plan's
    at 1e-3 but for the data folder and output directory, and it plans only the rest
    of the sweep."""
    import json

    committed = os.path.join(ROOT, "docs", "study-results", "cifar10-converged-lr")
    machine_data = "/tmp/data/cifar10-jpg"
    fresh = _plan(machine_data, tmp_path / "fresh", "converged_lr")
    with open(tmp_path / "fresh" / "converged_lr" / "study_config.json") as f:
        planned_base = json.load(f)
    with open(os.path.join(committed, "study_config.json")) as f:
        assert json.load(f) == planned_base
    assert len(fresh) == 24  # the sweep: 8 variants x 3 rates, seed 0

    def job(line):
        with open(line.split()[-1]) as f:
            return json.load(f)

    adopted = 0
    for line in fresh:
        planned = job(line)
        run_dir = os.path.join(committed, planned["run_dir"])
        if "/lr_0.001/" not in planned["run_dir"] + "/":
            assert not os.path.exists(run_dir)
            continue
        for seed in (0, 1, 2):
            with open(os.path.join(os.path.dirname(run_dir), f"seed_{seed}",
                                   "train_config.json")) as f:
                trained = json.load(f)
            expected = {**planned["config"], "seed": seed}
            assert trained["dataset"] != expected["dataset"]
            for key in ("dataset", "output_dir"):
                trained.pop(key), expected.pop(key)
            assert trained == expected, planned["run_dir"]
            adopted += 1
    assert adopted == 24
    shutil.copytree(committed, tmp_path / "machine" / "converged_lr")
    rest = _plan(machine_data, tmp_path / "machine", "converged_lr")
    assert len(rest) == 16 and not any("lr_0.001" in line for line in rest)


def test_a_data_part_is_what_a_call_carries_beside_the_tree_and_the_wheels(tmp_path, capsys):
    assert carry.part_size(20_000_000, 3_000_000) == 40_000_000  # 67.1 MB - 27 MB, whole MB
    with pytest.raises(ValueError, match=r"the working tree \(60,000,000\) and the wheels "
                                         r"\(3,000,000\) with a margin of 4,000,000 leave 0"):
        carry.part_size(60_000_000, 3_000_000)
    # The committed tree leaves parts of at least 38 MB beside the wheels (2.9 MB), so
    # that CIFAR-10 (92.7 MB) stages in 3 calls and Imagenette (150.5 MB) in 4, as
    # tools/gpu/README.md plans them.
    assert carry.part_size(carry.tree_bytes(ROOT), 3_000_000) >= 38_000_000
    wheels = tmp_path / "whl"
    os.makedirs(wheels)
    (wheels / "keras.whl").write_bytes(b"0" * 1000)
    assert carry.main([str(wheels)]) == 0
    size = int(capsys.readouterr().out)
    assert size == carry.part_size(carry.tree_bytes(ROOT), 1000)
    assert carry.main([str(tmp_path / "missing")]) == 2
    assert "usage: python tools/gpu/carry.py WHEEL_DIR" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["--packs", "2", "0"], "--packs takes positive numbers of runs, got [2, 0]"),
    (["--steps", "0"], "--steps must be a positive integer, got 0"),
    (["--sharing", "mps"], "--sharing mps is NVIDIA's Multi-Process Service for a GPU: it needs "
                           "--device gpu"),
    (["--process-seconds", "0"], "--process-seconds must be a positive integer, got 0"),
    (["--runs-per-process", "0"], "--runs-per-process must be a positive integer, got 0"),
])
def test_the_packing_benchmark_refuses_bad_arguments_with_a_message(argv, said, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_packing.main(argv)
    assert exit_info.value.code == 2
    assert said in capsys.readouterr().err


@pytest.mark.one_backend
def test_packed_runs_train_as_runs_alone_and_the_table_has_a_row_per_pack_and_sharing():
    script = os.path.join(ROOT, "tools", "gpu", "bench_packing.py")
    done = subprocess.run(
        [sys.executable, script, "--model", "tiny", "--batch-size", "4", "--packs", "1", "2",
         "--steps", "2", "--rounds", "1", "--check", "--sharing", "program", "processes",
         "--runs-per-process", "2"],
        env=dict(os.environ, KERAS_BACKEND="jax"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    checked = re.search(r"2 runs in one program against each alone after 2 steps \(float32\): "
                        r"largest difference (\S+) of the variables' scale", done.stdout)
    assert checked and float(checked.group(1)) <= 1e-4, done.stdout
    rows = re.findall(r"^\| (\d+) \| ([a-z0-9 ]+) \| [\d.]+ \| [\d,]+ \| ([\d.]+)x \|$",
                      done.stdout, re.M)
    # 2 processes of 2 runs each: their row counts every run.
    processes = "processes of 2 runs in one program each"
    assert [(runs, how) for runs, how, _ in rows] == [
        ("1", "one run"), ("2", "one program"), ("4", processes)], done.stdout
    assert rows[0][2] == "1.00"
    # The processes' row is printed as soon as it is measured, before the table (a lent
    # GPU's call cut short keeps it), with how long its slowest process took to start.
    measured = re.search(rf"^4 {processes}: [\d.]+ ms per step, [\d,]+ images/s in all \(the "
                         r"last compiled its step \d+ s after its start\)$", done.stdout, re.M)
    assert measured and measured.start() < done.stdout.index("| runs |"), done.stdout


#: What `--device gpu --sharing mps` parses to, for the MPS rows.
MPS_ARGS = bench_packing.parse_arguments(["--device", "gpu", "--sharing", "mps"])


def _fake_mps_control(folder, start_code=0, servers=""):
    """An `nvidia-cuda-mps-control` on PATH that logs its calls, as the daemon's control
    answers them: `-d` exits with `start_code`, `get_server_list` prints `servers`."""
    log = folder / "calls.log"
    script = folder / "nvidia-cuda-mps-control"
    script.write_text(f"""#!/usr/bin/env bash
if [ "$1" = -d ]; then
    echo "start $CUDA_MPS_PIPE_DIRECTORY" >> {log}
    [ {start_code} = 0 ] || echo "cannot open the pipe folder" >&2
    exit {start_code}
fi
read -r command
echo "$command" >> {log}
[ "$command" = get_server_list ] && echo {servers}
exit 0
""")
    script.chmod(0o755)
    return log


@pytest.mark.parametrize("start_code, servers, said", [
    (0, "4242", None),
    (0, "", "the MPS daemon started no server; the processes ran without it"),
    (1, "", "nvidia-cuda-mps-control -d exited with 1: cannot open the pipe folder"),
    (None, "", "nvidia-cuda-mps-control is not on this machine's PATH"),  # no daemon at all
])
def test_mps_rows_run_under_a_daemon_that_is_quit_after_and_say_why_they_did_not(
        tmp_path, monkeypatch, capsys, start_code, servers, said):
    if start_code is None:
        monkeypatch.setenv("PATH", str(tmp_path))
    else:
        log = _fake_mps_control(tmp_path, start_code, servers)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    seen = []

    def row(args, packs, how, env=None):
        seen.append(env["CUDA_MPS_PIPE_DIRECTORY"])
        assert os.path.isdir(env["CUDA_MPS_PIPE_DIRECTORY"])  # while the daemon runs
        return packs, how, 0.01, 100.0 * packs

    monkeypatch.setattr(bench_packing, "processes_row", row)
    rows = bench_packing._mps_rows(MPS_ARGS, [2, 8])
    if said is None:
        assert rows == [(2, "processes under MPS", 0.01, 200.0),
                        (8, "processes under MPS", 0.01, 800.0)]
    else:
        assert rows == [(k, "processes under MPS", None, said) for k in (2, 8)]
    if start_code != 0:  # no daemon ran: nothing to quit, and the call's output says why
        assert seen == [] and capsys.readouterr().out == (
            f"processes under MPS: did not run: {said}\n")
        assert start_code is None or len(log.read_text().splitlines()) == 1
        return
    assert log.read_text().split("\n") == [f"start {seen[0]}", "get_server_list", "quit", ""]
    assert seen == [seen[0]] * 2 and not os.path.exists(seen[0])  # its folder is removed


def test_processes_that_outrun_their_time_are_stopped_and_their_row_says_so(monkeypatch,
                                                                             capsys):
    started, popen = [], subprocess.Popen

    def never_ending_worker(command, **options):
        started.append(popen(["sleep", "60"], **options))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", never_ending_worker)
    args = bench_packing.parse_arguments(["--model", "tiny", "--process-seconds", "1"])
    began = time.monotonic()
    row = bench_packing._guarded(lambda: bench_packing.processes_row(args, 2, "processes"), 2,
                                 "processes")
    assert time.monotonic() - began < 5
    assert len(started) == 2 and all(p.returncode == -signal.SIGKILL for p in started)
    said = "2 processes did not finish in 1 s (--process-seconds)"
    assert row == (2, "processes", None, said)
    assert capsys.readouterr().out == f"2 processes: did not run: {said}\n"


def test_packing_benchmark_refuses_a_process_with_another_keras_backend(monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    with pytest.raises(SystemExit, match="run it with KERAS_BACKEND=jax"):
        bench_packing.main(["--model", "tiny"])


def test_a_failed_packing_check_ends_the_script_after_its_table(monkeypatch, capsys):
    import keras

    if keras.backend.backend() != "jax":
        pytest.skip("bench_packing.py times JAX programs (the subprocess test covers the check)")
    from keras_vitnorm import ops

    monkeypatch.setattr(bench_packing, "check", lambda *args: 0.5)
    fence = ops.fast_path_enabled("residual_fence")  # the script turns it off
    try:
        with pytest.raises(SystemExit, match=r"the check failed: .*\(2 runs: 5.00e-01\)"):
            bench_packing.main(["--model", "tiny", "--batch-size", "2", "--packs", "1", "2",
                                "--steps", "1", "--rounds", "1", "--check"])
    finally:
        keras.config.set_dtype_policy("float32")
        ops.set_fast_paths(fence, ["residual_fence"])
    out = capsys.readouterr().out
    assert "largest difference 5.00e-01" in out and "| 2 |" in out  # the table came first


def test_the_packing_check_script_calls_the_benchmark_with_arguments_it_accepts(tmp_path):
    """tools/gpu/packing.sh with `python3` and `nvidia-smi` stood in for: each of its
    commands parses (a refused one would spend a lent GPU's minutes on an error), and
    its output comes back in $OUT."""
    done, commands = with_stand_in_gpu(tmp_path, "packing.sh", printed="| 1 | table |")
    assert done.returncode == 0, done.stderr[-2000:]
    assert [c[0] for c in commands] == ["tools/gpu/bench_packing.py"] * 3
    parsed = [bench_packing.parse_arguments(c[1:]) for c in commands]
    assert all(args.device == "gpu" for args in parsed)
    assert {"processes", "mps"} <= {how for args in parsed for how in args.sharing}
    assert parsed[-1].check  # the check, which compiles most, last
    assert (tmp_path / "out" / "packing.md").read_text().count("| 1 | table |") == 3


@pytest.mark.skipif(__import__("keras").backend.backend() != "torch",
                    reason="counts the PyTorch backend's calls")
def test_host_waits_counts_reads_and_uploads_and_not_device_work():
    """Each read of a value and each tensor made from host data counts once, by phase;
    work that stays on the device, and tensors named as kept on the host, do not."""
    import torch

    x = torch.ones(3)
    step = torch.zeros(())  # as PyTorch's optimizers keep their step counters
    with host_waits.HostWaits(host_tensors=[step]) as waits:
        waits.mark("first")
        y = torch.nn.functional.softmax(x * 2.0, dim=0).sum()  # device work only
        y.item()
        float(y)
        bool(y > 0)
        waits.mark("second")
        y.numpy()
        y.tolist()
        torch.as_tensor(0.5)
        torch.tensor([1, 2])
        x[x > 0]  # boolean indexing: the output's size is a value
        step.item()
    assert waits.count() == 8 and waits.count(phase="second") == 5
    assert (waits.count("read"), waits.count("upload")) == (6, 2)
    sites = waits.sites("first")
    assert sum(sites.values()) == 3
    assert all("test_gpu_kit.py" in frames for _, _, frames in sites)
    assert "3 reads, 0 uploads" in waits.report("first")


@pytest.mark.skipif(__import__("keras").backend.backend() != "torch",
                    reason="counts the PyTorch backend's calls")
def test_host_waits_counts_keras_step_and_the_references_side_by_side(capsys):
    """Keras' `train_on_batch` makes the host wait at each Python number it turns into a
    tensor; the reference waits once, for its loss (docs/performance.md, "Where the host
    waits")."""
    assert host_waits.main(["--mode", "train", "--reference", "--batch-size", "1"]) == 0
    out = capsys.readouterr().out
    keras_part, reference_part = out.split("== transformers ViT (reference), one train call")
    assert keras_part.startswith("== keras_vitnorm (torch), train, float32, fast paths on")
    waits = int(keras_part.split("\n")[1].split()[0])
    assert waits > 1
    assert reference_part.split("\n")[1] == (
        "1 calls that would wait for the GPU (1 reads, 0 uploads)")


@pytest.mark.parametrize("argv, said", [
    (["--batch-size", "0"], "--batch-size must be a positive integer, got 0"),
    (["--mode", "fit", "--reference"], "--reference counts a train or inference step, not fit"),
])
def test_host_waits_refuses_bad_arguments_with_a_message(argv, said, capsys):
    with pytest.raises(SystemExit) as exit_info:
        host_waits.main(argv)
    assert exit_info.value.code == 2
    assert said in capsys.readouterr().err
