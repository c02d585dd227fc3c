"""Peak memory of the benchmark workers (benchmarks/_memory.py) and the search for the
largest batch that fits (tools/gpu/largest_batch.py): the search against simulated
memory, the failures it must tell apart, and one real search on the CPU."""

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
BENCHMARKS = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCHMARKS)
sys.path.insert(0, os.path.join(ROOT, "tools", "gpu"))
import _common  # noqa: E402
import _memory  # noqa: E402
import largest_batch  # noqa: E402


class Device:
    """A simulated device: a step at `batch` needs `fixed + per_example * batch` bytes of
    `capacity`; each try takes `seconds` of a simulated clock."""

    def __init__(self, fixed=2e9, per_example=7e7, capacity=79e9, seconds=10.0, report=True):
        self.fixed, self.per_example, self.capacity = fixed, per_example, capacity
        self.seconds, self.report, self.now, self.tried = seconds, report, 0.0, []

    def clock(self):
        return self.now

    def peak(self, batch):
        return self.fixed + self.per_example * batch

    def try_batch(self, batch, seconds):
        self.tried.append((batch, seconds))
        self.now += self.seconds
        if self.peak(batch) > self.capacity:
            return {"fits": False}
        if not self.report:
            return {"fits": True, "peak_bytes": None, "capacity_bytes": None}
        return {"fits": True, "peak_bytes": self.peak(batch), "capacity_bytes": self.capacity}

    def search(self, start=256, limit=8192, deadline=1e9, known=None):
        return largest_batch.largest_batch(self.try_batch, start, limit, deadline, known=known,
                                           clock=self.clock)


@pytest.mark.parametrize("device, known, limit, tried, outcome", [
    # Without memory figures: doubling, then bisection to a sixteenth (1100 fits, 1101 does
    # not; 1152 - 1088 = 64 is within a sixteenth of 1088).
    (dict(report=False), False, 8192, [256, 512, 1024, 2048, 1536, 1280, 1152, 1088],
     (1088, 1152, "bracket")),
    # The table's own step at 256 known: 512 by doubling (no capacity known yet), then the
    # line through the two peaks predicts 1100; the bracket closes just above it.
    ({}, True, 8192, [512, 1096, 1160], (1096, 1160, "bracket")),
    ({}, True, 600, [512, 600], (600, None, "limit")),
], ids=["doubles then bisects", "measured peaks guide it", "stops at the limit"])
def test_the_search_brackets_the_largest_batch(device, known, limit, tried, outcome):
    device = Device(**device)
    result = device.search(limit=limit, known={256: device.peak(256)} if known else None)
    assert [batch for batch, _ in device.tried] == tried
    assert (result["largest"], result["does_not_fit"], result["stopped"]) == outcome


def test_a_prediction_the_device_refutes_gives_way_to_bisection():
    device = Device()
    device.capacity = 50e9  # fits up to 685, but the try at 512 reports a roomier device
    answers = iter([79e9])

    def optimistic(batch, seconds):
        outcome = device.try_batch(batch, seconds)
        if outcome["fits"]:
            outcome["capacity_bytes"] = next(answers, device.capacity)
        return outcome

    result = largest_batch.largest_batch(optimistic, 256, 8192, 1e9,
                                         known={256: device.peak(256)}, clock=device.clock)
    batches = [batch for batch, _ in device.tried]
    assert batches[:3] == [512, 1096, 800]  # predicted 1100 fails: the middle (804) next
    assert result["largest"] <= 685 < result["does_not_fit"]
    assert result["does_not_fit"] - result["largest"] <= max(8, result["largest"] // 16)


def test_it_halves_when_the_first_batch_does_not_fit_and_says_when_nothing_does():
    device = Device(capacity=2e9 + 7e7 * 40)  # 40 fits
    result = device.search(start=256)
    assert [batch for batch, _ in device.tried][:3] == [256, 128, 64]
    assert result["largest"] <= 40 < result["does_not_fit"]
    nothing = Device(capacity=1e9).search(start=4)
    assert nothing == {"largest": None, "does_not_fit": 1, "stopped": "nothing fits",
                       "known": {}, "tries": nothing["tries"]}
    assert [attempt["batch"] for attempt in nothing["tries"]] == [4, 2, 1]


def test_it_starts_no_try_it_cannot_finish_and_gives_each_the_time_left():
    device = Device(report=False, seconds=10.0)
    result = device.search(deadline=25.0)
    # Tries at t=0 (25 s left) and t=10 (15 s); at t=20 5 s are left, less than a try takes.
    assert device.tried == [(256, 25.0), (512, 15.0)]
    assert (result["largest"], result["stopped"]) == (512, "time")


def test_a_failure_other_than_memory_ends_the_search_with_what_it_found():
    outcomes = iter([{"fits": True, "peak_bytes": None, "capacity_bytes": None},
                     {"error": "RuntimeError: cuDNN broke"}])
    result = largest_batch.largest_batch(lambda batch, seconds: next(outcomes), 8, 64, 1e9,
                                         clock=lambda: 0.0)
    assert (result["largest"], result["stopped"]) == (8, "error")
    cell = largest_batch.describe_largest_batch(result)
    assert cell == ">= 8 (batch 16 failed: RuntimeError: cuDNN broke)"
    timed_out = largest_batch.largest_batch(
        lambda batch, seconds: {"error": "still running", "timed_out": True}, 8, 64, 1e9,
        clock=lambda: 0.0)
    assert timed_out["stopped"] == "time" and timed_out["largest"] is None


@pytest.mark.parametrize("result, cell", [
    ({"largest": 1096, "does_not_fit": 1160, "stopped": "bracket"}, "1096 (1160 does not fit)"),
    ({"largest": 600, "does_not_fit": None, "stopped": "limit"}, ">= 600 (the limit)"),
    ({"largest": 512, "does_not_fit": 2048, "stopped": "time"},
     ">= 512 (out of time; 2048 does not fit)"),
    ({"largest": None, "does_not_fit": None, "stopped": "time"}, "none found (out of time)"),
    ({"largest": None, "does_not_fit": 1, "stopped": "nothing fits"}, "none: 1 does not fit"),
])
def test_each_outcome_has_its_own_cell(result, cell):
    assert largest_batch.describe_largest_batch({**result, "tries": []}) == cell


def test_predicted_largest_is_a_safe_bound_from_one_peak_and_the_line_from_two():
    # One point: fixed part 2 GB, 70 MB per example, 79 GB: batch * capacity / peak.
    assert largest_batch.predicted_largest({256: 2e9 + 7e7 * 256}, 79e9) == int(
        256 * 79e9 / 19.92e9)
    assert largest_batch.predicted_largest({256: 19.92e9, 512: 2e9 + 7e7 * 512}, 79e9) == 1100
    assert largest_batch.predicted_largest({256: 19.92e9}, None) is None
    assert largest_batch.predicted_largest({256: None}, 79e9) is None


def test_the_implementations_share_the_time_quickest_compilation_first():
    tries = []
    clock = [0.0]

    def attempt(implementation, backend, batch, seconds):
        tries.append((implementation, batch, seconds))
        clock[0] += 10.0
        return {"fits": batch <= 256, "peak_bytes": None, "capacity_bytes": None}

    runs = [("slow", "jax", "keras"), ("failed", "torch", "timm"), ("quick", "torch", "reference")]
    results = {"slow": {"train": {"compile_s": 30.0, "peak_bytes": 5}},
               "failed": {"error": "no timm"},
               "quick": {"train": {"compile_s": 1.0, "peak_bytes": 3}}}
    found = largest_batch.largest_batches(runs, results, 128, 256, 90.0, attempt,
                                          clock=lambda: clock[0])
    assert list(found) == ["quick", "slow"]  # the failed one is not searched
    # quick may use half of the 90 s; its one try (256, the limit) leaves 80 s to slow.
    # The table's step at 128 counts as a fit: neither tries it again.
    assert tries == [("reference", 256, 45.0), ("keras", 256, 80.0)]
    assert found["quick"]["largest"] == 256 and found["slow"]["stopped"] == "limit"


@pytest.mark.parametrize("output, returncode, expected", [
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", 1, True),
    ("jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying", 1, True),
    ("errors_impl.ResourceExhaustedError: OOM when allocating tensor", 1, True),
    ("RuntimeError: CUDNN_STATUS_ALLOC_FAILED", 1, True),
    ("MemoryError", 1, True),
    ("", -signal.SIGKILL, True),
    ("ImportError: timm does not import here", 1, False),
    ("RuntimeError: shapes do not match", 1, False),
])
def test_out_of_memory_is_told_from_other_failures(output, returncode, expected):
    assert _common.is_out_of_memory(output, returncode) is expected


def test_run_worker_marks_a_child_out_of_memory_and_stops_one_out_of_time(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        if "oom" in sys.argv:
            raise MemoryError("no room")
        if "slow" in sys.argv:
            time.sleep(30)
        print('RESULT {"train": {"step_s": 1.0}}')
    """))
    assert _common.run_worker(str(script), ["ok"], "torch", 1) == {"train": {"step_s": 1.0}}
    oom = _common.run_worker(str(script), ["oom"], "torch", 1)
    assert oom["out_of_memory"] is True and oom["error"].endswith("MemoryError: no room")
    slow = _common.run_worker(str(script), ["slow"], "torch", 1, timeout=1)
    assert slow["timed_out"] is True and "out_of_memory" not in slow


def test_worker_environment_sets_jaxs_gpu_memory_as_asked(monkeypatch):
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    cpu = _common.worker_env("jax", 2, "cpu", "whole")
    assert cpu["JAX_PLATFORMS"] == "cpu" and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in cpu
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in _common.worker_env("jax", 2, "gpu")
    assert _common.worker_env("jax", 2, "gpu", "shared")["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    whole = _common.worker_env("jax", 2, "gpu", "whole")
    assert whole["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"
    assert "XLA_CLIENT_MEM_FRACTION" not in whole
    # Both spellings set make JAX's CUDA plugin refuse the GPU: the one in use is kept.
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")
    whole = _common.worker_env("jax", 2, "gpu", "whole")
    assert whole["XLA_CLIENT_MEM_FRACTION"] == "0.95"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in whole
    with pytest.raises(ValueError, match="'all'.*default, shared, whole"):
        _common.worker_env("jax", 2, "gpu", "all")


def test_worker_memory_on_the_cpu_is_the_peak_resident_memory_since_its_reset():
    # In a fresh process, started from this one: its peak is its own, not this process's.
    code = textwrap.dedent("""
        import json, mmap, sys
        import numpy as np
        sys.path.insert(0, sys.argv[1])
        from _memory import WorkerMemory, peak_memory
        memory = WorkerMemory("torch", "cpu")
        start = memory.peak()
        block = b"\\x01" * (256 << 20)
        grown = memory.peak()
        del block
        memory.reset()
        after_reset = memory.peak()

        def allocate():  # 64 MiB of fresh pages, every one written, unmapped before it returns
            block = mmap.mmap(-1, 64 << 20)
            np.frombuffer(block, dtype=np.uint8)[:] = 1
            block.close()

        print(json.dumps([start, grown, after_reset, memory.capacity(),
                          *peak_memory(allocate, "cpu", "torch")]))
    """)
    done = subprocess.run([sys.executable, "-c", code, BENCHMARKS], capture_output=True, text=True,
                          check=True)
    start, grown, after_reset, capacity, peak, what = json.loads(done.stdout)
    assert start < 200 << 20 and grown - start >= 250 << 20
    if sys.platform.startswith("linux"):
        assert after_reset < grown - (200 << 20)
    assert capacity is None
    # peak_memory counts what `allocate` held at its peak, though it freed it before returning.
    assert what == "host peak RSS" and 60 << 20 <= peak < 200 << 20
    with pytest.raises(ValueError, match="'mxnet' is not one of jax, tensorflow, torch"):
        _memory.WorkerMemory("mxnet", "cpu")
    with pytest.raises(ValueError, match="'tpu' is not one of cpu, gpu"):
        _memory.WorkerMemory("jax", "tpu")


@pytest.mark.one_backend
def test_largest_batch_search_on_the_cpu_reports_peak_memory_and_each_try(tmp_path, capsys):
    """A whole run: bench_vit's table, then one try of the search seeded by it, each a
    process of its own; the search stops at the limit. The driver is the same under every
    backend."""
    import bench_vit

    tiny = ["--backends", "torch", "--no-reference", "--image-size", "16", "--batch-size", "2",
            "--threads", "1", "--host-memory", "default", "--overrides",
            '{"depth": 1, "width": 16, "num_heads": 2, "mlp_dim": 32, "patch_size": 8}']
    table = tmp_path / "table.json"
    assert bench_vit.main([*tiny, "--modes", "train", "--steps", "1", "--repeats", "1",
                           "--warmup", "0", "--json", str(table)]) == 0
    train = json.loads(table.read_text())["results"]["keras_vitnorm (torch)"]["train"]
    assert train["peak_bytes"] > 50 << 20 and train["capacity_bytes"] is None  # host memory
    capsys.readouterr()
    path = tmp_path / "result.json"
    assert largest_batch.main([*tiny, "--limit", "4", "--known", str(table),
                               "--json", str(path)]) == 0
    found = json.loads(path.read_text())["largest_batch"]["keras_vitnorm (torch)"]
    assert (found["largest"], found["stopped"]) == (4, "limit")
    assert [(t["batch"], t["fits"]) for t in found["tries"]] == [(4, True)]
    assert found["tries"][0]["peak_bytes"] > 50 << 20
    table = capsys.readouterr().out
    assert "| keras_vitnorm (torch) | >= 4 (the limit) |" in table
    assert "| 2 known, 4 fits |" in table


def test_largest_batch_table_shows_the_peak_at_the_largest_batch_and_the_tries():
    args = argparse.Namespace(device="gpu", preset="b16", image_size=224,
                              mixed_precision="mixed_bfloat16", batch_size=256, limit=8192)
    found = {"jax": {"largest": 1096, "does_not_fit": 1160, "stopped": "bracket",
                     "known": {"256": 20 * 2**30}, "tries": [
        {"batch": 512, "fits": True, "peak_bytes": 40 * 2**30, "capacity_bytes": 76 * 2**30},
        {"batch": 1096, "fits": True, "peak_bytes": 75 * 2**30, "capacity_bytes": 76 * 2**30},
        {"batch": 1160, "fits": False}]},
        "timm": {"largest": None, "does_not_fit": None, "stopped": "error",
                 "tries": [{"batch": 256, "error": "x | ImportError: no timm"}]},
        "torch": {"largest": 256, "does_not_fit": None, "stopped": "time",
                  "known": {256: 30 * 2**30}, "tries": []}}
    lines = largest_batch.largest_batch_table(args, found)
    assert lines[4] == ("| jax | 1096 (1160 does not fit) | 75.0 | 76.0 | "
                        "256 known, 512 fits, 1096 fits, 1160 does not fit |")
    assert lines[5] == ("| timm | none found (batch 256 failed: ImportError: no timm) | n/a "
                        "| n/a | 256 failed |")
    # A search out of time before its first try: the table's step is its largest.
    assert lines[6] == "| torch | >= 256 (out of time) | 30.0 | n/a | 256 known |"


def _search_arguments(path, *more):
    return ["--backends", "torch", "--no-reference", "--batch-size", "2", "--threads", "1",
            "--limit", "8", "--known", str(path), *more]


@pytest.mark.one_backend
def test_a_known_table_seeds_the_search_and_must_share_its_settings(tmp_path, monkeypatch, capsys):
    """The driver's bookkeeping, the same under every backend (the tries are simulated)."""
    tried = []

    def fake_try(args, implementation, backend, batch, seconds):
        tried.append((implementation, batch))
        return {"fits": batch <= 4, "peak_bytes": None, "capacity_bytes": None}

    monkeypatch.setattr(largest_batch, "try_batch", fake_try)
    settings = {"preset": "s16", "image_size": 224, "batch_size": 2, "mixed_precision": "float32",
                "device": "cpu", "overrides": "{}"}
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"settings": settings, "results": {
        "keras_vitnorm (torch)": {"train": {"compile_s": 1.0, "peak_bytes": 100}}}}))
    out = tmp_path / "largest.json"
    assert largest_batch.main(_search_arguments(table, "--json", str(out))) == 0
    # The table's step at 2 fitted: the search starts by doubling it.
    assert tried == [("keras", 4), ("keras", 8)]
    found = json.loads(out.read_text())["largest_batch"]["keras_vitnorm (torch)"]
    assert (found["largest"], found["does_not_fit"], found["stopped"]) == (4, 8, "bracket")
    capsys.readouterr()
    table.write_text(json.dumps({"settings": {**settings, "batch_size": 256}, "results": {}}))
    with pytest.raises(SystemExit):
        largest_batch.main(_search_arguments(table))
    assert "was measured with batch_size 256, this search has 2" in capsys.readouterr().err
    table.write_text("[1, 2]")
    with pytest.raises(SystemExit):
        largest_batch.main(_search_arguments(table))
    assert "not a table of bench_vit.py's --json" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["--limit", "64", "--device", "cpu", "--seconds", "0"], "--seconds must be positive, got 0.0"),
    (["--device", "cpu"], "--limit is required on the CPU"),
    (["--limit", "0"], "--limit must be a positive integer, got 0"),
    (["--limit", "8", "--batch-size", "16"], "--limit (8) must be at least --batch-size (16)"),
    (["--overrides", '{"image_size": 32}', "--limit", "64"], "--overrides sets image_size 32"),
])
def test_bad_arguments_exit_with_a_message(argv, said, capsys):
    with pytest.raises(SystemExit) as exit_info:
        largest_batch.main(argv)
    assert exit_info.value.code == 2
    assert said in capsys.readouterr().err
