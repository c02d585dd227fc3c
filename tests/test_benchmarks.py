"""The benchmark scripts (benchmarks/): FLOP count, argument checks, workers and tables, not
their timings."""

import argparse
import io
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import keras
import numpy as np
import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import _common  # noqa: E402
import _memory  # noqa: E402
import bench_input  # noqa: E402
import bench_norms  # noqa: E402
import bench_parallel  # noqa: E402
import bench_variants  # noqa: E402
import bench_vit  # noqa: E402
import profile_step  # noqa: E402

BACKEND = keras.backend.backend()


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The workers under test set PyTorch's thread count for timing; later tests in this
    process compare results bit for bit with a fresh process, which needs the default."""
    try:
        import torch
    except ImportError:
        yield
        return
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("preset, published_gmacs", [("s16", 4.6), ("b16", 17.6)])
def test_model_flops_match_published_multiply_adds(preset, published_gmacs):
    # timm lists 4.6 and 17.6 GMACs for vit_small/base_patch16_224; a FLOP is half a MAC.
    from keras_vitnorm.models.presets import preset_config

    c = preset_config(preset)
    flops = bench_vit.model_flops(c["width"], c["depth"], c["mlp_dim"], c["patch_size"], 224, 3,
                                  1000)
    assert flops / 2e9 == pytest.approx(published_gmacs, rel=0.01)


def test_matmul_rate_is_the_best_library_and_leaves_out_one_that_fails(monkeypatch):
    monkeypatch.setitem(bench_vit._BACKEND_MATMUL, "broken", "raise SystemExit(3)\n")
    best, rates = bench_vit.matmul_rate(1, (BACKEND, "broken"), size=64, repeats=1)
    expected = {"numpy", "torch"} | ({BACKEND} & {"jax", "tensorflow"})
    assert "numpy" in rates and set(rates) <= expected
    if BACKEND in ("jax", "tensorflow"):
        assert BACKEND in rates  # measured in its own child process
    assert "broken" not in rates
    assert best == max(rates.values()) and min(rates.values()) > 0


#: Each script's options that must be positive integers (`_common.check_positive_ints`).
POSITIVE = [(bench_vit, "--batch-size"), (bench_vit, "--rounds"), (bench_variants, "--rounds"),
            (bench_variants, "--memory-parallel"), (bench_norms, "--steps"),
            (profile_step, "--steps"), (profile_step, "--rows"), (profile_step, "--image-size"),
            (bench_input, "--batches"), (bench_parallel, "--processes")]


@pytest.mark.parametrize("module, argv, said", [
    *[(module, [flag, "0"], f"{flag} must be a positive integer, got 0")
      for module, flag in POSITIVE],
    *[(module, ["--warmup", "-1"], "--warmup must be 0 or more, got -1")
      for module in (bench_vit, bench_variants, bench_norms)],
    (bench_vit, ["--overrides", '{"image_size": 32}'], "--overrides sets image_size 32"),
    (profile_step, ["--overrides", "{depth: 1}"], "--overrides is not JSON"),
])
def test_bad_arguments_exit_with_a_message_naming_the_value(module, argv, said, capsys):
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    assert exit_info.value.code == 2
    assert said in capsys.readouterr().err


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda_available(),
                    reason="this machine has a CUDA GPU, so --device gpu is valid here")
def test_gpu_device_without_a_gpu_exits_with_a_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_vit.main(["--device", "gpu", "--no-reference"])
    assert exit_info.value.code == 2
    assert "--device gpu needs PyTorch with a CUDA GPU" in capsys.readouterr().err


def test_the_profile_and_the_variant_worker_refuse_what_this_backend_cannot_run():
    if BACKEND != "torch":
        with pytest.raises(SystemExit,
                           match=f"KERAS_BACKEND=torch \\(this process has {BACKEND}\\)"):
            profile_step.main(["--reference"])
    if _common.keras_backend_device() == "cpu":
        with pytest.raises(SystemExit,
                           match=f"--device gpu: the {BACKEND} backend computes on cpu"):
            profile_step.main(["--device", "gpu"])
        with pytest.raises(RuntimeError, match="--device gpu"):
            bench_variants.worker(_variant_arguments(device="gpu"))


def test_norm_worker_times_every_size_norm_and_mode_and_a_failed_backend_fills_its_row():
    args = argparse.Namespace(batch_size=1, steps=1, warmup=0, repeats=1)
    results = bench_norms.worker_norms(args)
    assert set(results) == {f"{size}|{norm}|{mode}" for size in bench_norms.SIZES
                            for norm in ("layernorm", "rmsnorm")
                            for mode in ("forward", "forward+backward")}
    assert all(seconds > 0 for seconds in results.values())
    table = bench_norms.norms_table({"this backend": results, "jax": {"error": "worker died"}})
    assert len(table) == 2 + len(bench_norms.SIZES) + 1
    assert table[-1].startswith("| jax | failed: worker died |")
    assert table[-1].count("|") == table[0].count("|")


def test_rounds_combine_to_the_median_step_and_the_first_compile():
    rounds = [{"train": {"compile_s": 9.0, "step_s": step, "faults": faults, "kernel_s": step / 10}}
              for step, faults in ((3.0, 10.0), (1.0, 30.0), (2.0, 20.0))]
    assert bench_vit.combine_rounds(rounds)["train"] == {
        "compile_s": 9.0, "step_s": 2.0, "round_step_s": [3.0, 1.0, 2.0], "faults": 20.0,
        "kernel_s": pytest.approx(0.2)}
    failure = {"error": "worker died"}
    assert bench_vit.combine_rounds([rounds[0], failure]) == failure
    with_memory = [{"train": {**r["train"], "peak_bytes": peak, "capacity_bytes": 900 + peak}}
                   for r, peak in zip(rounds, (5, 7, 6))]
    combined = bench_vit.combine_rounds(with_memory)["train"]
    assert combined["peak_bytes"] == 7 and combined["capacity_bytes"] == 905


def test_serving_worker_compiles_first_times_each_request_and_releases_memory_after_each():
    events = []

    class Memory:
        """Peaks that grow with each reset, as a GPU's would per mode."""

        def reset(self):
            events.append("reset")

        def peak(self):
            return 100 * events.count("reset")

        def capacity(self):
            return 1000

        def release(self):
            events.append("release")

    steps = {mode: (lambda m=mode: events.append(m)) for mode in ("inference", "train")}
    replies = io.StringIO()
    bench_vit.serve(steps, warmup=2, count=3, repeats=2, memory=Memory(), replies=replies,
                    requests=io.StringIO("train\nspeed\ninference\nquit\ntrain\n"))
    lines = replies.getvalue().splitlines()
    assert [line.split(" ")[0] for line in lines] == ["READY", "TIMED", "ERROR", "TIMED"]
    ready = json.loads(lines[0][len("READY "):])
    assert ready["inference"]["peak_bytes"] == 100 and ready["train"]["peak_bytes"] == 200
    assert ready["train"]["capacity_bytes"] == 1000 and ready["train"]["compile_s"] > 0
    assert set(json.loads(lines[1][len("TIMED "):])) == {"step_s", "faults", "kernel_s"}
    assert "'speed'" in lines[2] and "inference, train" in lines[2]
    # Ready: per mode the first call, 2 warm-up steps, the peak reset, 1 timed step; memory
    # released after READY and after each reply. A request: 1 untimed step, then 3 x 2
    # timed. Nothing after quit.
    compiled = [*["inference"] * 3, "reset", "inference", *["train"] * 3, "reset", "train"]
    assert events == [*compiled, "release", *["train"] * 7, "release", *["inference"] * 7,
                      "release"]


def test_ratio_to_reference_pairs_the_rounds():
    timing = {"step_s": 2.0, "round_step_s": [2.0, 1.0, 4.0]}
    reference = {"step_s": 2.0, "round_step_s": [2.2, 1.2, 4.0]}
    # Per round 1.1, 1.2 and 1.0: the median of the ratios, not the ratio of the medians (1.0).
    assert bench_vit.ratio_to_reference(timing, reference) == "1.10x (1.00 to 1.20)"
    assert bench_vit.ratio_to_reference({"step_s": 2.0}, {"step_s": 3.0}) == "1.50x"
    assert bench_vit.ratio_to_reference(timing, None) == "n/a"


def _tiny_interleave_args(preset="s16", rounds=2):
    """bench_vit's parsed arguments for a one-block width-32 ViT at 32x32, batch 2."""
    return argparse.Namespace(
        preset=preset, image_size=32, batch_size=2, steps=1, warmup=0, repeats=1, threads=1,
        mixed_precision="float32", device="cpu", host_memory="default", rounds=rounds,
        modes=["inference", "train"],
        overrides='{"depth": 1, "width": 32, "num_heads": 2, "mlp_dim": 64}')


def test_interleaved_workers_are_timed_once_per_round_and_a_failed_one_is_reported():
    runs = [("ours", BACKEND, "keras")]
    results = bench_vit.interleaved(_tiny_interleave_args(), runs)
    for mode in ("inference", "train"):
        assert len(results["ours"][mode]["round_step_s"]) == 2
        assert results["ours"][mode]["step_s"] > 0 and results["ours"][mode]["compile_s"] > 0
    failed = bench_vit.interleaved(_tiny_interleave_args(preset="s17", rounds=1), runs)
    assert "s17" in failed["ours"]["error"]


def test_interleaved_rounds_rotate_the_order_and_drop_a_worker_that_fails(monkeypatch):
    timed = []

    class FakeWorker:
        def __init__(self, args, implementation, backend):
            if backend == "broken_at_start":
                raise RuntimeError("no such backend")
            self.backend, self.calls = backend, 0
            self.ready = {"inference": {"compile_s": 1.0},
                          "train": {"compile_s": 2.0, "peak_bytes": 7}}

        def time(self, mode):
            timed.append((self.backend, mode))
            self.calls += 1
            if self.backend == "dies" and self.calls == 3:
                raise RuntimeError("worker died")
            return {"step_s": float(self.calls), "faults": 0.0, "kernel_s": 0.0}

        def close(self):
            timed.append((self.backend, "closed"))

    monkeypatch.setattr(bench_vit, "Worker", FakeWorker)
    runs = [("A", "a", "keras"), ("B", "b", "keras"), ("C", "dies", "keras"),
            ("D", "broken_at_start", "keras")]
    results = bench_vit.interleaved(argparse.Namespace(rounds=3, modes=["inference", "train"]),
                                    runs)
    assert list(results) == ["A", "B", "C", "D"]
    assert results["D"] == {"error": "no such backend"} and results["C"] == {"error": "worker died"}
    assert results["A"]["train"]["round_step_s"] == [2.0, 4.0, 6.0]
    assert results["A"]["train"]["compile_s"] == 2.0 and results["A"]["train"]["peak_bytes"] == 7
    first_rounds = [backend for backend, mode in timed[:10] if mode == "inference"]
    # Round 1: a, b, dies; round 2 starts one later (b, dies fails on its 3rd call, a).
    assert first_rounds[:3] == ["a", "b", "dies"] and first_rounds[3:5] == ["b", "dies"]
    assert timed[-3:] == [("a", "closed"), ("b", "closed"), ("dies", "closed")]


def test_timed_counts_the_page_faults_of_fresh_memory():
    # A fresh 64 MiB bytes object per step: glibc maps it anew each time (unless
    # this process retained freed memory, which the test suite never asks for),
    # and filling it touches every page.
    calls = []
    timing = _common.timed(lambda: calls.append(len(b"\x01" * (64 << 20))), steps=2, repeats=2,
                           warmup=1, first_call=True)
    assert len(calls) == 1 + 1 + 2 * 2
    assert timing["compile_s"] > 0 and timing["step_s"] > 0 and timing["kernel_s"] >= 0
    # at least one in 600 pages, even with huge pages
    assert timing["faults"] > (64 << 20) // 4096 // 600
    assert "peak_bytes" not in timing and len(timing["runs"]) == 2  # memory: with a WorkerMemory


def test_other_forms_are_the_models_fast_paths_and_each_flips_only_its_own_switch():
    from keras_vitnorm.ops import switch

    # Every fast path of the model step; the input pipelines' are bench_input's.
    assert bench_vit.MODEL_FAST_PATHS == tuple(
        name for name in switch.FAST_PATHS if name != "bincount_histogram")
    for form in bench_vit.MODEL_FAST_PATHS:
        with switch.fast_paths(True):
            assert bench_vit.apply_form(form) == "auto"
            assert [name for name in switch.FAST_PATHS
                    if not switch.fast_path_enabled(name)] == [form]
    with switch.fast_paths(True):
        assert bench_vit.apply_form("tf_xla") is True and bench_vit.apply_form(None) == "auto"
        assert all(switch.fast_path_enabled(name) for name in switch.FAST_PATHS)


def test_other_forms_run_beside_the_library_form_and_compare_with_it(monkeypatch, capsys):
    parser = bench_vit.argument_parser()
    args = parser.parse_args(["--backends", "jax", "tensorflow", "--no-reference",
                              "--other-forms", "attention", "tf_xla", "--modes", "train",
                              "--host-memory", "default"])  # this process keeps glibc's
    runs = bench_vit.implementations(args)
    assert runs == [("keras_vitnorm (jax)", "jax", "keras"),
                    ("keras_vitnorm (jax), attention off", "jax", "keras:attention"),
                    ("keras_vitnorm (tensorflow)", "tensorflow", "keras"),
                    ("keras_vitnorm (tensorflow), attention off", "tensorflow", "keras:attention"),
                    ("keras_vitnorm (tensorflow), XLA", "tensorflow", "keras:tf_xla")]
    worker = parser.parse_args(["--worker", *bench_vit.worker_arguments(args, "keras:tf_xla")])
    assert (worker.implementation, worker.form) == ("keras", "tf_xla")
    # The worker compiles its models in its form.
    compiled = []
    monkeypatch.setattr(bench_vit, "keras_steps", lambda *a, **kw: compiled.append(kw) or {})
    monkeypatch.setattr(bench_vit, "WorkerMemory", lambda *a: None)
    bench_vit.worker_main(worker)
    assert compiled[0]["jit_compile"] is True and capsys.readouterr().out == "RESULT {}\n"
    # Its ratio is its library form's time over its own, round by round.
    timing = {"compile_s": 1.0, "faults": 0.0, "kernel_s": 0.0}
    results = {"keras_vitnorm (tensorflow)": {"train": {**timing, "step_s": 1.5,
                                                        "round_step_s": [1.0, 2.0]}},
               "keras_vitnorm (tensorflow), XLA": {"train": {**timing, "step_s": 2.0,
                                                             "round_step_s": [1.25, 2.0]}}}
    args.threads = 1
    lines = bench_vit.table(args, results, 1e9, 100.0, {"numpy": 100.0}, "float32", None)
    assert lines[4].split(" | ")[3] == "n/a"  # no reference
    assert lines[5].split(" | ")[3] == "0.90x (0.80 to 1.00) vs library form"


@pytest.mark.skipif(BACKEND != "tensorflow", reason="Keras' jit_compile='auto' choice for "
                                                    "TensorFlow; this run's backend is another")
def test_tensorflow_micro_benchmarks_take_the_path_keras_picks_for_fit():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")  # jit_compile="auto"
    assert model.jit_compile is _common.tensorflow_steps_use_xla()


TINY_PROFILE = ["--batch-size", "2", "--steps", "2", "--rows", "5", "--overrides", json.dumps(
    {"image_size": 16, "patch_size": 8, "width": 16, "depth": 1, "num_heads": 2, "mlp_dim": 32,
     "num_classes": 3})]


@pytest.mark.skipif(BACKEND != "tensorflow",
                    reason="profiles TensorFlow kernels; this run's backend is another")
def test_the_tensorflow_profile_of_a_training_step_finds_the_model_parts_and_the_optimizer(capsys):
    if _common.tensorflow_steps_use_xla():
        pytest.skip("Keras compiles TensorFlow with XLA on this machine: no per-kernel events")
    result = profile_step.main(TINY_PROFILE)
    kernels, parts = result["kernels"], result["parts"]
    # Per step: the block's four forward matmuls (qkv, out, two in the MLP) and their backward.
    assert sum(calls for kernel, (_, calls) in kernels.items()
               if kernel.endswith("MatMul")) >= 3 * 4
    for part in ("attention: projections", "attention: softmax(q k^T) v", "MLP", "norms"):
        assert parts[f"{part}|forward"] > 0 and parts[f"{part}|backward"] > 0
    assert parts["optimizer update|"] > 0
    assert "| optimizer update |" in capsys.readouterr().out


@pytest.mark.skipif(BACKEND != "torch",
                    reason="profiles PyTorch operators; this run's backend is another")
def test_the_pytorch_profile_lists_the_operators_of_keras_and_the_reference():
    result = profile_step.main([*TINY_PROFILE, "--mode", "inference", "--reference"])
    reference, ours = result["tables"]
    assert reference.startswith("== transformers ViT (reference): ")
    assert ours.startswith("== keras_vitnorm (torch): ") and "aten::addmm" in ours


def _variant_arguments(**changes):
    return argparse.Namespace(**{**dict(
        model="study", batch_size=2, rounds=2, steps=1, warmup=1, mixed_precision="float32",
        device="cpu", host_memory="default", variants=["rmsnorm"], measure=["train", "inference"],
        memory_repeats=1, memory_of=None), **changes})


def test_variant_worker_times_training_and_inference_of_every_variant_in_every_round(monkeypatch):
    # The worker's bookkeeping is the same for any model; a one-block one compiles quickly.
    monkeypatch.setitem(bench_variants.MODELS, "study", dict(
        image_size=16, patch_size=4, width=32, depth=1, num_heads=2, mlp_dim=64, num_classes=10))
    args = _variant_arguments()
    result = bench_variants.worker(args)
    assert list(result) == ["seconds", "inference_seconds"]
    for seconds in result.values():
        # the baseline is measured though only rmsnorm was asked for
        assert list(seconds) == ["pre_ln", "rmsnorm"]
        assert all(len(times) == 2 and min(times) > 0 for times in seconds.values())
    ratio, low, high, seconds = bench_variants.summarize(result, "inference_seconds")["pre_ln"]
    assert ratio == low == high == 1.0 and seconds > 0
    table = bench_variants.markdown({BACKEND: result}, args)
    training, inference = table[:table.index("Inference")], table[table.index("Inference"):]
    assert training.startswith("Training-step time") and inference.startswith("Inference-step")
    for part in (training, inference):
        assert "| rmsnorm | " in part and part.count("\n|") == 2 + 2


def test_variant_ratios_pair_each_round_with_the_baseline_of_that_round():
    result = {"seconds": {name: [2.0, 4.0] for name in bench_variants.VARIANTS}}
    result["seconds"]["rmsnorm"] = [1.0, 4.0]  # faster in round 1 only, as its baseline drifted
    ratio, low, high, _ = bench_variants.summarize(result)["rmsnorm"]
    assert (low, high) == (0.5, 1.0) and ratio == 0.75


@pytest.mark.one_backend
def test_variants_are_the_model_changes_of_the_studys_core_group():
    from keras_vitnorm.study.variants import VARIANT_GROUPS

    core = VARIANT_GROUPS["core"]
    assert bench_variants.VARIANTS == {name: model for name, (model, _) in core.items()}
    assert list(bench_variants.VARIANTS) == list(core)
    assert bench_variants.BASELINE == next(iter(core))


@pytest.mark.one_backend
@pytest.mark.parametrize("backend", ["jax", "tensorflow", "torch"])
def test_peak_memory_on_a_gpu_reads_the_backends_allocator_peak_above_its_use_before(
        backend, monkeypatch):
    """The GPU branch against stand-ins of each library's allocator statistics (this
    machine has no GPU); `monkeypatch` fails where the library lacks the function."""
    used = {"now": 1000, "peak": 1000}

    def run():
        used["peak"] = max(used["peak"], 5000)
        used["now"] = 1500

    def reset(*_):
        used["peak"] = used["now"]

    if backend == "jax":
        jax = pytest.importorskip("jax")

        class Device:
            def memory_stats(self):
                return {"bytes_in_use": used["now"], "peak_bytes_in_use": used["peak"]}

        monkeypatch.setattr(jax, "local_devices", lambda: [Device()])
    elif backend == "torch":
        torch = pytest.importorskip("torch")
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: used["now"])
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: used["peak"])
    else:
        tf = pytest.importorskip("tensorflow")
        monkeypatch.setattr(tf.config.experimental, "reset_memory_stats", reset)
        monkeypatch.setattr(tf.config.experimental, "get_memory_info",
                            lambda _: {"current": used["now"], "peak": used["peak"]})
    if backend != "jax":
        used["peak"] = 9000  # before the measurement, forgotten by the reset (JAX has none)
    peak, what = _memory.peak_memory(run, "gpu", backend)
    assert peak == 4000 and what.startswith("GPU")


def test_variant_memory_worker_measures_the_variant_it_is_given(monkeypatch):
    monkeypatch.setitem(bench_variants.MODELS, "study", dict(
        image_size=16, patch_size=4, width=16, depth=1, num_heads=2, mlp_dim=32, num_classes=10))
    built = []
    build = bench_variants.build
    monkeypatch.setattr(bench_variants, "build", lambda config, name: built.append(
        (config["width"], name)) or build(config, name))
    result = bench_variants.memory_worker(_variant_arguments(memory_of="dyt"))
    # A model this small adds nothing beyond the warm-up's memory; its figure is the
    # kernel's page-level noise, of either sign (`peak_memory` itself is tested below).
    assert result["what"] == "host peak RSS" and isinstance(result["bytes"], int)
    # the one-block warm-up model of the same variant first, then the measured one
    assert built == [(bench_variants.WARM_UP_MODEL["width"], "dyt"), (16, "dyt")]


@pytest.mark.one_backend
@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="the peak restarts only on Linux (/proc/self/clear_refs)")
def test_peak_memory_on_the_cpu_counts_what_the_run_held_at_most():
    size = 128 * 2 ** 20

    def run():
        held = np.ones(size, np.uint8)  # every page touched
        del held

    peak, what = _memory.peak_memory(run, "cpu", "torch")
    assert what == "host peak RSS"
    # Within a tenth: the kernel counts resident pages lazily, and after a thousand tests
    # the process's other threads may free or take a few MiB while `run` holds its array.
    # Reading the current memory instead of the peak would give about 0.
    assert 0.9 * size <= peak < 1.5 * size


@pytest.mark.one_backend
def test_variant_benchmark_runs_one_memory_process_per_variant_and_repeat(
        tmp_path, capsys, monkeypatch):
    calls = []

    def run_worker(script, arguments, backend, threads, device="cpu", gpu_memory="default"):
        calls.append((arguments, backend, gpu_memory))
        if "--memory-of" not in arguments:
            return {"seconds": {"pre_ln": [1.0], "rmsnorm": [0.5]},
                    "inference_seconds": {"pre_ln": [0.2], "rmsnorm": [0.2]}}
        variant = arguments[arguments.index("--memory-of") + 1]
        if variant == "pre_ln" and len(calls) == 2:  # its first process
            return {"error": "out of memory"}
        return {"bytes": {"pre_ln": 200, "rmsnorm": 100}[variant] * 2 ** 20,
                "what": "host peak RSS"}

    monkeypatch.setattr(bench_variants, "run_worker", run_worker)
    output = tmp_path / "variants.json"
    assert bench_variants.main([
        "--model", "study", "--backends", "torch", "--variants", "rmsnorm", "--measure", "train",
        "memory", "--memory-repeats", "2", "--json", str(output)]) == 0
    assert [c[2] for c in calls] == ["default"] + ["shared"] * 4
    assert [c[0][-1] for c in calls[1:]] == ["pre_ln", "rmsnorm", "pre_ln", "rmsnorm"]
    assert all(c[0][c[0].index("--variants") + 1:][:2] == ["pre_ln", "rmsnorm"] for c in calls)
    result = json.loads(output.read_text())["results"]["torch"]
    assert result["peak_bytes"] == {"pre_ln": [200 * 2 ** 20], "rmsnorm": [100 * 2 ** 20] * 2}
    # the baseline first, though a process of another variant finished before its first did
    assert list(result["peak_bytes"]) == ["pre_ln", "rmsnorm"]
    assert result["memory_errors"] == {"pre_ln": "out of memory"}
    assert result["seconds"]["rmsnorm"] == [0.5]
    assert calls[0][0][calls[0][0].index("--measure") + 1] == "train"  # what the worker times
    out = capsys.readouterr().out
    assert "Training-step time" in out and "Inference-step" not in out
    memory = out[out.index("Peak memory"):]
    assert "(host peak RSS)" in memory and "median over 2 process(es)" in memory
    assert "| pre_ln | 200 MiB |" in memory and "| rmsnorm | 100 MiB (0.500) |" in memory


def test_input_benchmark_times_each_pipeline_against_the_training_step(capsys):
    import importlib.util

    try:
        bench_input.main(["--dataset", "digits", "--image-size", "8", "--batch-size", "4",
                          "--batches", "2", "--rounds", "1", "--mixed-precision", "mixed_bfloat16"])
        assert keras.config.dtype_policy().name == "mixed_bfloat16"  # the step's precision
    finally:
        keras.config.set_dtype_policy("float32")
    table = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()
            if line.startswith("| ")}
    step = "training step (study model, mixed_bfloat16)"
    expected = ["python input, first read", "python input, images kept decoded", step]
    if importlib.util.find_spec("tensorflow"):
        expected.append("tf.data input")
    assert sorted(set(rows) - {"what"}) == sorted(expected)
    assert rows[step].endswith("| 1.0x | |")
    step_rate = float(rows[step].split("|")[2].replace(",", ""))
    for name in set(expected) - {step}:
        cells = [cell.strip() for cell in rows[name].split("|")]
        rate, share = float(cells[2].replace(",", "")), float(cells[4].rstrip("%"))
        # Input and step taking turns on one core: the input's share of their time.
        assert abs(share - 100 * step_rate / (rate + step_rate)) < 1.5, rows[name]


def test_input_share_is_the_inputs_part_of_a_turn_taking_core():
    # 1 s to read 100 images, 1 s to train on them: half the time is input.
    assert bench_input.input_share(100, 100) == 0.5
    # Input 3x as fast as the step: a quarter of the time.
    assert bench_input.input_share(300, 100) == 0.25


def test_parallel_worker_waits_at_the_barrier_and_the_table_gives_the_ratio(tmp_path, monkeypatch):
    from keras_vitnorm import host_memory

    retained = []
    monkeypatch.setattr(host_memory, "retain_freed_memory", lambda: retained.append(True))
    args = argparse.Namespace(model="study", batch_size=2, steps=1, warmup=1, host_memory="retain",
                              mixed_precision="float32", barrier=str(tmp_path), barrier_count=1)
    assert bench_parallel.worker(args)["images_per_second"] > 0
    assert len(os.listdir(tmp_path)) == 1  # it announced itself before timing
    assert retained == [True]  # as the workers of `ablate --parallel` do
    table = bench_parallel.markdown(
        {"jax": {"single": [100.0, 110.0], "parallel": [120.0, 99.0]}, "torch": {"error": "boom"}},
        argparse.Namespace(model="study", batch_size=128, mixed_precision="float32", processes=2,
                           rounds=2, steps=20, host_memory="default"))
    assert "| jax | 105 | 110 | 1.05 (0.90 to 1.20) |" in table
    assert "host memory: default" in table
    assert "| torch | failed: boom | | |" in table


def test_host_memory_setting_is_one_helper_that_retains_only_when_asked(monkeypatch):
    from keras_vitnorm import host_memory

    calls = []
    monkeypatch.setattr(host_memory, "retain_freed_memory", lambda: calls.append(True))
    for script in (bench_parallel, bench_variants, bench_vit, profile_step):
        assert script.apply_host_memory is _common.apply_host_memory
    _common.apply_host_memory("default")
    assert calls == []
    _common.apply_host_memory("retain")
    assert calls == [True]
    with pytest.raises(ValueError, match="'keep'.*retain, default"):
        _common.apply_host_memory("keep")
    parser = argparse.ArgumentParser()
    _common.add_host_memory_argument(parser, "who retains")
    assert parser.parse_args([]).host_memory == "retain"  # unless a run asks for glibc's own


class _FakeTimm:
    """Stands in for timm where it does not import: records `create_model`'s arguments and
    the models it builds, tiny classifiers whose first MLP follows timm's width rule
    (`int(dim * ratio)`)."""

    def __init__(self, names=()):
        self.names, self.calls, self.models = set(names), [], []

    def is_model(self, name):
        return name in self.names

    def create_model(self, name, **kwargs):
        import torch

        self.calls.append({"name": name, **kwargs})
        model = torch.nn.Module()
        block = torch.nn.Module()
        block.mlp = torch.nn.Module()
        width = kwargs["embed_dim"]
        block.mlp.fc1 = torch.nn.Linear(width, int(width * kwargs["mlp_ratio"]))
        model.blocks = torch.nn.ModuleList([block])
        model.head = torch.nn.Linear(3, kwargs["num_classes"])
        model.forward = lambda x: model.head(x.mean((2, 3)))
        self.models.append(model)
        return model


def _tiny_config(**sizes):
    from keras_vitnorm.models.presets import preset_config

    return {**preset_config("s16"), "image_size": 32, "num_classes": 10, **sizes}


def test_timm_steps_build_timms_vit_at_the_configs_sizes_and_train_it_with_adamw(monkeypatch):
    import torch

    timm = _FakeTimm(names=["vit_small_patch16_224"])
    monkeypatch.setitem(sys.modules, "timm", timm)
    compiled, forwards = [], []

    def fake_compile(model):
        compiled.append(model)
        return lambda x: forwards.append(x.shape) or model(x)

    monkeypatch.setattr(torch, "compile", fake_compile)
    steps = _common.timm_steps(_tiny_config(depth=1), 2, ["inference", "train"], threads=1)
    assert timm.calls == [{"name": "vit_small_patch16_224", "pretrained": False, "img_size": 32,
                           "patch_size": 16, "embed_dim": 384, "depth": 1, "num_heads": 6,
                           "mlp_ratio": 4.0, "num_classes": 10}]
    steps["inference"]()
    before = timm.models[0].head.weight.detach().clone()
    steps["train"]()
    assert not torch.equal(before, timm.models[0].head.weight)  # the optimizer's step
    assert len(timm.calls) == 1 and compiled == forwards == []  # one eager model for both
    # A width timm has no name for still gets every size; the name is the base model's.
    # Compiled: the forward pass of both modes through one torch.compile of the model.
    steps = _common.timm_steps(_tiny_config(width=32, num_heads=2, mlp_dim=64), 2,
                               ["inference", "train"], threads=1, compiled=True)
    assert timm.calls[-1]["name"] == "vit_base_patch16_224" and timm.calls[-1]["embed_dim"] == 32
    steps["inference"]()
    steps["train"]()
    assert compiled == [timm.models[-1]] and len(forwards) == 2


def test_timm_vit_refuses_an_mlp_width_timm_cannot_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", _FakeTimm())
    # timm builds int(56 * (61 / 56)) = 60 hidden units for these.
    with pytest.raises(ValueError, match="MLP width of 60 for mlp_dim=61 at width 56"):
        _common.timm_vit(_tiny_config(width=56, num_heads=2, mlp_dim=61))


def test_timm_vit_is_the_references_model_with_real_timm():
    try:
        import timm  # noqa: F401
    except ImportError as error:  # timm imports torchvision, which needs a matching torch build
        pytest.skip(f"timm does not import here: {error}")
    config = _tiny_config(width=32, num_heads=2, mlp_dim=64, depth=2, patch_size=8)
    model = _common.timm_vit(config)
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in _common.reference_vit(config).parameters())
    assert model.patch_embed.proj.kernel_size == (8, 8) and len(model.blocks) == 2


@pytest.mark.parametrize("name, dtype, expected", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.0),
    ("NVIDIA H100 PCIe", "bfloat16", 756.0),
    ("NVIDIA H100 NVL", "bfloat16", 835.0),
    ("NVIDIA H200", "bfloat16", 989.0),
    ("NVIDIA H200 NVL", "bfloat16", 835.0),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", None),
    ("NVIDIA H100 80GB HBM3", "float32", None),
])
def test_datasheet_peak_is_the_dense_bfloat16_rate_of_the_gpu(name, dtype, expected):
    assert bench_vit.datasheet_tflops(name, dtype) == expected


def test_gpu_table_gives_mfu_against_the_datasheet_and_peak_memory():
    args = argparse.Namespace(device="gpu", preset="b16", image_size=224, batch_size=256,
                              mixed_precision="mixed_bfloat16", threads=16, host_memory="retain")
    timing = {"compile_s": 1.0, "step_s": 0.1, "faults": 0.0, "kernel_s": 0.0,
              "peak_bytes": 20 * 2**30}
    results = {"transformers ViT (PyTorch eager)": {"train": timing},
               "timm ViT (torch.compile)": {"error": "a | traceback | RuntimeError: no GPU|here"}}
    lines = bench_vit.table(args, results, 17.5e9, 800e3, {"torch (GPU)": 800e3}, "bfloat16",
                            ("NVIDIA H100 80GB HBM3", 989.0))
    assert "datasheet peak 989 TFLOP/s (NVIDIA H100 80GB HBM3)" in lines[0]
    header = lines[2].split(" | ")
    row = lines[4].split(" | ")
    # 2560 img/s x 17.5 GFLOPs x 3: 16.8% of 800 TFLOP/s measured, 13.6% of the datasheet's 989.
    assert row[header.index("fraction of matmul peak")] == "16.8%"
    assert row[header.index("MFU (datasheet)")] == "13.6%"
    assert row[header.index("peak memory (GiB)")] == "20.0"
    assert lines[5].count("|") == lines[2].count("|")  # the failure fills the row
    assert "| failed: RuntimeError: no GPU/here |" in lines[5]  # its last line, no "|" of its own


@pytest.mark.parametrize("argv, message", [
    (["fast"], "usage: "),
    (["largest", "5m"], "SECONDS must be a whole number, got '5m'"),
    (["table", "10"], "table takes no SECONDS"),
])
def test_gpu_perf_script_refuses_bad_arguments_before_it_starts(argv, message):
    done = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu", "perf.sh"), *argv],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and message in done.stderr


@pytest.mark.large
@pytest.mark.one_backend
def test_gpu_perf_script_runs_its_table_and_search_on_the_cpu(tmp_path):
    """tools/gpu/perf.sh's CPU path with a one-block model: the table, then the search
    seeded by the table's training step (about a minute on a 2-core machine)."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, PERF_DEVICE="cpu",
               PERF_BATCH="2", PERF_LIMIT="4", PERF_ROUNDS="1", PERF_STEPS="1", PERF_PRESETS="b16",
               PERF_BACKENDS="torch", PERF_TIMM="eager", PERF_IMAGE_SIZE="32",
               PERF_OVERRIDES='{"depth": 1, "width": 32, "num_heads": 2, "mlp_dim": 64, '
                              '"patch_size": 8, "num_classes": 10}')
    done = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu", "perf.sh"), "all", "600"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    report = (tmp_path / "perf.md").read_text()
    assert "| keras_vitnorm (torch) | train |" in report
    assert any(f"| timm ViT (PyTorch eager) | {cell}" in report for cell in ("failed: ", "train |"))
    assert "Largest training batch of b16" in report
    found = json.loads((tmp_path / "largest.json").read_text())["largest_batch"]
    assert [t["batch"] for t in found["keras_vitnorm (torch)"]["tries"]] == [4]  # 2 from the table
    assert sorted(os.listdir(tmp_path)) == ["b16.json", "largest.json", "perf.log", "perf.md"]


@pytest.mark.parametrize("op_name, part", [
    # JAX's name scopes
    ("jit(step)/jvp(block_3)/attn_norm/jit(_var)/reduce_sum", ("norms", "forward")),
    ("jit(step)/transpose(jvp(final_norm))/mul", ("norms", "backward")),
    ("jit(step)/jvp(stem)/patch_norm/sub", ("norms", "forward")),
    ("jit(step)/jvp(block_0)/attention/qkv/dot_general", ("attention: projections", "forward")),
    ("jit(step)/transpose(jvp(block_0))/attention/out/dot_general",
     ("attention: projections", "backward")),
    ("jit(step)/jvp(block_0)/attention/reduce_max", ("attention: softmax(q k^T) v", "forward")),
    ("jit(step)/transpose(jvp(block_1))/mlp/fc1/dot_general", ("MLP", "backward")),
    ("jit(step)/jvp(stem)/conv_general_dilated", ("stem", "forward")),
    ("jit(step)/jvp(compile_loss)/categorical_crossentropy/exp", ("head and loss", "forward")),
    ("jit(step)/adam_w/CosineDecay/cos", ("optimizer update", "")),
    ("jit(step)/add", ("other", "")),
    # TensorFlow's op names
    ("vit_1/block_4_1/mlp_1/fc1_1/Tensordot/MatMul", ("MLP", "forward")),
    ("gradient_tape/vit_1/block_0_1/attention_1/MatMul_1/MatMul",
     ("attention: softmax(q k^T) v", "backward")),
    ("gradient_tape/vit_1/block_0_1/attention_1/qkv_1/Tensordot/MatMul",
     ("attention: projections", "backward")),
    ("gradient_tape/vit_1/block_2_1/mlp_norm_1/mul_2/Mul", ("norms", "backward")),
    ("vit_1/stem_1/projection_1/Tensordot/MatMul", ("stem", "forward")),
    ("adam_w/Sqrt_17", ("optimizer update", "")),
    ("compile_loss/sparse_categorical_crossentropy/Log", ("head and loss", "forward")),
    ("mul_28", ("other", "forward")),
    ("vit_1/Cast", ("other", "forward")),
])
def test_the_profile_puts_each_operation_in_its_part_and_pass(op_name, part):
    assert profile_step.part_of(op_name) == part


def _event(name, ns, **stats):
    """An event of a JAX trace (`jax.profiler.ProfileData`), as `device_events` reads it."""
    return SimpleNamespace(name=name, duration_ns=ns, stats=list(stats.items()))


def _line(name, events):
    return SimpleNamespace(name=name, events=events)


def _plane(name, lines):
    return SimpleNamespace(name=name, lines=lines)


def test_the_jax_profile_reads_one_line_of_a_gpu_plane_and_every_cpu_thread():
    kernel = dict(hlo_module="jit_step")
    gpu = _plane("/device:GPU:0", [
        _line("XLA Ops", [_event("fusion.1", 30, hlo_op="fusion.1", **kernel),
                          _event("gemm.2", 70, hlo_op="gemm.2", **kernel)]),
        _line("Stream #13", [_event("sm90_gemm", 70, hlo_op="gemm.2", **kernel)]),
        _line("other module", [_event("x", 500, hlo_op="x", hlo_module="jit_other")])])
    host = _plane("/host:CPU", [_line("python", [_event("dispatch", 900)])])
    profile = SimpleNamespace(planes=[host, gpu])
    assert profile_step.device_events(profile, "jit_step") == [("fusion.1", 30), ("gemm.2", 70)]
    cpu = _plane("/host:CPU", [_line("thread 1", [_event("a", 5, hlo_op="a", **kernel)]),
                               _line("thread 2", [_event("b", 7, hlo_op="b", **kernel)])])
    cpu_profile = SimpleNamespace(planes=[cpu])
    assert profile_step.device_events(cpu_profile, "jit_step") == [("a", 5), ("b", 7)]
    rows = profile_step.trace_contents(profile)
    assert "/device:GPU:0 / XLA Ops: fusion.1 x1, gemm.2 x1" in rows


@pytest.mark.one_backend
def test_the_jax_profile_splits_a_steps_device_time_by_part(tmp_path):
    script = os.path.join(ROOT, "benchmarks", "profile_step.py")
    tiny = json.dumps({"image_size": 16, "patch_size": 8, "width": 16, "depth": 1,
                       "num_heads": 2, "mlp_dim": 32, "num_classes": 3})
    done = subprocess.run(
        [sys.executable, script, "--batch-size", "2", "--steps", "2", "--overrides", tiny,
         "--json", str(tmp_path / "profile.json")],
        env=dict(os.environ, KERAS_BACKEND="jax"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "profile.json").read_text())
    parts = result["parts"]
    for part in ("norms|forward", "norms|backward", "attention: projections|forward",
                 "attention: softmax(q k^T) v|backward", "MLP|forward", "optimizer update|"):
        assert parts.get(part, 0) > 0, parts
    assert result["unmatched_seconds"] <= 0.01 * sum(parts.values())
    assert result["flops"] > 0 and "| optimizer update |" in done.stdout
    shares = re.findall(r"\| ([\d.]+)% \|$", done.stdout, re.M)
    assert abs(sum(map(float, shares)) - 100) < 0.5


def test_the_jax_profile_finds_each_instructions_scope_in_the_compiled_text():
    hlo = """HloModule jit_step, is_scheduled=true

%fused_computation.1 (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %m.3 = f32[4]{0} multiply(%p0, %p0), metadata={op_name="jit(step)/jvp(block_0)/mlp/mul"}
}

ENTRY %main.9 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %dot.2 = f32[4]{0} add(%p, %p), metadata={op_name="jit(step)/jvp(block_0)/attn_norm/add"}
  %mul_fusion = f32[4]{0} fusion(%dot.2), kind=kLoop, calls=%fused_computation.1
  %copy_bitcast_fusion.1 = f32[4]{0} fusion(%mul_fusion), kind=kLoop, calls=%fused_computation.9
  ROOT %copy.5 = f32[4]{0} copy(%copy_bitcast_fusion.1)
}
"""
    scopes = profile_step.instruction_scopes(hlo)
    assert scopes["dot.2"] == "jit(step)/jvp(block_0)/attn_norm/add"
    assert scopes["mul_fusion"] == "jit(step)/jvp(block_0)/mlp/mul"  # its computation's root
    # added by the compiler, no metadata anywhere: the scope of what it reads
    assert scopes["copy_bitcast_fusion.1"] == scopes["copy.5"] == scopes["mul_fusion"]
    assert "p" not in scopes  # a parameter reads nothing
