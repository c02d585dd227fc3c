"""The benchmark scripts' FLOP count, argument checks and micro-benchmark worker (not their timings)."""

import argparse
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import bench_ab  # noqa: E402
import bench_input  # noqa: E402
import bench_norms  # noqa: E402
import bench_parallel  # noqa: E402
import bench_randaugment  # noqa: E402
import bench_variants  # noqa: E402
import bench_vit  # noqa: E402
import host_waits  # noqa: E402
import profile_tensorflow  # noqa: E402
import profile_torch  # noqa: E402


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
    flops = bench_vit.model_flops(c["width"], c["depth"], c["mlp_dim"], c["patch_size"], 224, 3, 1000)
    assert flops / 2e9 == pytest.approx(published_gmacs, rel=0.01)


def test_matmul_rate_is_the_best_library_and_leaves_out_one_that_fails(monkeypatch):
    import keras

    backend = keras.backend.backend()
    monkeypatch.setitem(bench_vit._BACKEND_MATMUL, "broken", "raise SystemExit(3)\n")
    best, rates = bench_vit.matmul_rate(1, (backend, "broken"), size=64, repeats=1)
    expected = {"numpy", "torch"} | ({backend} & {"jax", "tensorflow"})
    assert "numpy" in rates and set(rates) <= expected
    if backend in ("jax", "tensorflow"):
        assert backend in rates  # measured in its own child process
    assert "broken" not in rates
    assert best == max(rates.values()) and min(rates.values()) > 0


@pytest.mark.parametrize("module, argv", [
    (bench_vit, ["--batch-size", "0"]),
    (bench_vit, ["--repeats", "-1"]),
    (bench_vit, ["--rounds", "0"]),
    (bench_vit, ["--warmup", "-1"]),
    (bench_variants, ["--rounds", "0"]),
    (bench_variants, ["--model", "b16"]),
    (bench_variants, ["--device", "tpu"]),
    (bench_norms, ["--steps", "0"]),
    (bench_norms, ["--warmup", "-2"]),
    (bench_norms, ["--part", "speed"]),
    (bench_ab, ["--rounds", "0"]),
    (bench_ab, ["--changes", "faster"]),
    (bench_ab, ["--preset", "s17"]),
    (bench_ab, ["--host-memory", "keep"]),
    (bench_vit, ["--host-memory", "keep"]),
    (profile_torch, ["--steps", "0"]),
    (profile_torch, ["--mode", "speed"]),
    (profile_torch, ["--rows", "0"]),
    (host_waits, ["--batch-size", "0"]),
    (host_waits, ["--mode", "test"]),
    (profile_torch, ["--device", "tpu"]),
    (profile_tensorflow, ["--steps", "0"]),
    (profile_tensorflow, ["--mode", "speed"]),
    (profile_tensorflow, ["--image-size", "-3"]),
    (bench_input, ["--batches", "0"]),
    (bench_randaugment, ["--randaugment-ops", "0"]),
    (bench_randaugment, ["--counts", "loop"]),
    (bench_parallel, ["--processes", "0"]),
    (bench_parallel, ["--model", "b16"]),
])
def test_bad_arguments_exit_with_a_message(module, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.parametrize("script, backend", [(profile_torch, "torch"), (profile_tensorflow, "tensorflow")])
def test_profile_scripts_refuse_a_process_with_another_keras_backend(script, backend, capsys):
    import keras

    if keras.backend.backend() == backend:
        pytest.skip(f"the check is for a process whose backend is not {backend}, as this run's is")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--steps", "1"])
    assert exit_info.value.code == 2
    assert "another backend" in capsys.readouterr().err


@pytest.mark.skipif(_cuda_available(), reason="this machine has a CUDA GPU, so --device gpu is valid here")
def test_gpu_device_without_a_gpu_exits_with_a_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_vit.main(["--device", "gpu", "--no-reference"])
    assert exit_info.value.code == 2
    assert "--device gpu needs PyTorch with a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(_cuda_available(), reason="this machine has a CUDA GPU, so --device gpu is valid here")
def test_profile_torch_gpu_device_without_a_gpu_exits_with_a_message(capsys):
    import keras

    if keras.backend.backend() != "torch":
        pytest.skip("profile_torch.py refuses another backend before it looks for a GPU")
    with pytest.raises(SystemExit) as exit_info:
        profile_torch.main(["--device", "gpu"])
    assert exit_info.value.code == 2
    assert "--device gpu: PyTorch sees no CUDA GPU here" in capsys.readouterr().err


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
    assert all("test_benchmarks.py" in frames for _, _, frames in sites)
    assert "3 reads, 0 uploads" in waits.report("first")


def test_norm_worker_times_every_size_norm_and_mode():
    args = argparse.Namespace(batch_size=1, steps=1, warmup=0, repeats=1)
    results = bench_norms.worker_norms(args)
    expected = {f"{size}|{norm}|{mode}" for size in bench_norms.SIZES for norm in ("layernorm", "rmsnorm")
                for mode in ("forward", "forward+backward")}
    assert set(results) == expected
    assert all(seconds > 0 for seconds in results.values())
    table = bench_norms.norms_table({"this backend": results})
    assert len(table) == 2 + len(bench_norms.SIZES)


def test_rounds_combine_to_the_median_step_and_the_first_compile():
    rounds = [{"train": {"compile_s": 9.0, "step_s": step, "faults": faults, "kernel_s": step / 10}}
              for step, faults in ((3.0, 10.0), (1.0, 30.0), (2.0, 20.0))]
    combined = bench_vit.combine_rounds(rounds)
    assert combined["train"]["step_s"] == 2.0
    assert combined["train"]["compile_s"] == 9.0
    assert combined["train"]["round_step_s"] == [3.0, 1.0, 2.0]
    assert combined["train"]["faults"] == 20.0
    assert combined["train"]["kernel_s"] == pytest.approx(0.2)
    failure = {"error": "worker died"}
    assert bench_vit.combine_rounds([rounds[0], failure]) == failure


def test_serving_worker_compiles_first_then_times_each_request_until_quit():
    import io
    import json

    calls = {"inference": 0, "train": 0}
    steps = {mode: (lambda m=mode: calls.__setitem__(m, calls[m] + 1)) for mode in calls}
    replies = io.StringIO()
    bench_vit.serve(steps, warmup=2, count=3, repeats=2, requests=io.StringIO("train\nspeed\nquit\ninference\n"),
                    replies=replies)
    lines = replies.getvalue().splitlines()
    assert [line.split(" ")[0] for line in lines] == ["READY", "TIMED", "ERROR"]
    assert set(json.loads(lines[0][len("READY "):])) == {"inference", "train"}
    assert set(json.loads(lines[1][len("TIMED "):])) == {"step_s", "faults", "kernel_s"}
    assert "'speed'" in lines[2] and "inference, train" in lines[2]
    # Ready: first call, 2 warm-up steps, 1 timed. The request: 1 untimed, 3 x 2 timed. Nothing after quit.
    assert calls == {"inference": 1 + 2 + 1, "train": 1 + 2 + 1 + 1 + 3 * 2}


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
        modes=["inference", "train"], overrides='{"depth": 1, "width": 32, "num_heads": 2, "mlp_dim": 64}')


def test_interleaved_workers_are_timed_once_per_round_and_a_failed_one_is_reported():
    import keras

    good = _tiny_interleave_args()
    runs = [("ours", keras.backend.backend(), "keras")]
    results = bench_vit.interleaved(good, runs)
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
            self.backend, self.compile_s, self.calls = backend, {"inference": 1.0, "train": 2.0}, 0

        def time(self, mode):
            timed.append((self.backend, mode))
            self.calls += 1
            if self.backend == "dies" and self.calls == 3:
                raise RuntimeError("worker died")
            return {"step_s": float(self.calls), "faults": 0.0, "kernel_s": 0.0}

        def close(self):
            timed.append((self.backend, "closed"))

    monkeypatch.setattr(bench_vit, "Worker", FakeWorker)
    runs = [("A", "a", "keras"), ("B", "b", "keras"), ("C", "dies", "keras"), ("D", "broken_at_start", "keras")]
    args = argparse.Namespace(rounds=3, modes=["inference", "train"])
    results = bench_vit.interleaved(args, runs)
    assert list(results) == ["A", "B", "C", "D"]
    assert results["D"] == {"error": "no such backend"} and results["C"] == {"error": "worker died"}
    assert results["A"]["train"]["round_step_s"] == [2.0, 4.0, 6.0]
    assert results["A"]["train"]["compile_s"] == 2.0
    first_rounds = [backend for backend, mode in timed[:10] if mode == "inference"]
    # Round 1: a, b, dies; round 2 starts one later (b, dies fails on its 3rd call, a).
    assert first_rounds[:3] == ["a", "b", "dies"] and first_rounds[3:5] == ["b", "dies"]
    assert timed[-3:] == [("a", "closed"), ("b", "closed"), ("dies", "closed")]


def test_timed_counts_the_page_faults_of_fresh_memory():
    # A fresh 64 MiB bytes object per step: glibc maps it anew each time (unless
    # this process retained freed memory, which the test suite never asks for),
    # and filling it touches every page.
    calls = []
    compile_s, step_s, faults, kernel_s = bench_vit._timed(lambda: calls.append(len(b"\x01" * (64 << 20))),
                                                           warmup=1, steps=2, repeats=2)
    assert len(calls) == 1 + 1 + 2 * 2
    assert compile_s > 0 and step_s > 0 and kernel_s >= 0
    assert faults > (64 << 20) // 4096 // 600  # at least one in 600 pages, even with huge pages


def test_a_failed_backend_gets_a_full_width_row():
    table = bench_norms.norms_table({"jax": {"error": "worker died"}})
    assert table[-1].startswith("| jax | failed: worker died |")
    assert table[-1].count("|") == table[0].count("|")


@pytest.mark.parametrize("change", bench_ab.CHANGES)
def test_ab_worker_times_both_forms_and_they_compute_the_same(change):
    from keras_vitnorm.ops import config as switch

    before = {name: switch.fast_path_enabled(name) for name in switch.FAST_PATHS}
    from keras_vitnorm.models.presets import preset_config

    config = {**preset_config("s16"), "image_size": 32, "patch_size": 8, "width": 32, "depth": 1, "num_heads": 2,
              "mlp_dim": 64, "num_classes": 10}
    result = bench_ab.worker_ab(change, ["inference", "train"], config, batch_size=2, rounds=2, steps=1)
    assert result["max_abs_diff"] < 1e-5
    for mode in ("inference", "train"):
        assert all(len(result[mode][form]) == 2 and min(result[mode][form]) > 0 for form in ("library", "other"))
    assert {name: switch.fast_path_enabled(name) for name in switch.FAST_PATHS} == before  # switched back
    table = bench_ab.ab_table({("this backend", change): result, ("other", change): {"error": "worker died"}})
    assert len(table) == 2 + 2 + 1
    assert table[-1].count("|") == table[0].count("|")


def test_ab_changes_are_the_librarys_fast_paths_and_flip_only_their_own_switch():
    from keras_vitnorm.ops import config as switch

    # Every fast path of the model step; the input pipeline's is bench_randaugment's.
    assert bench_ab.FAST_PATHS == tuple(name for name in switch.FAST_PATHS
                                        if name != "bincount_histogram")
    with switch.fast_paths(True):
        for change in bench_ab.FAST_PATHS:
            with bench_ab.other_form(change):
                assert [name for name in switch.FAST_PATHS if not switch.fast_path_enabled(name)] == [change]
            assert all(switch.fast_path_enabled(name) for name in switch.FAST_PATHS)
    with pytest.raises(ValueError, match="unknown change 'attend'"):
        with bench_ab.other_form("attend"):
            pass


@pytest.mark.skipif(__import__("keras").backend.backend() != "tensorflow",
                    reason="Keras' jit_compile='auto' choice for TensorFlow; this run's backend is another")
def test_tensorflow_micro_benchmarks_take_the_path_keras_picks_for_fit():
    import keras

    from _common import tensorflow_steps_use_xla

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")  # jit_compile="auto"
    assert model.jit_compile is tensorflow_steps_use_xla()


def test_ab_tf_xla_compiles_only_the_other_form_with_xla_on_tensorflow():
    import keras

    from _common import tensorflow_steps_use_xla

    from keras_vitnorm.models.presets import preset_config

    config = {**preset_config("s16"), "image_size": 16, "patch_size": 8, "width": 16, "depth": 1, "num_heads": 2,
              "mlp_dim": 32, "num_classes": 10}
    result = bench_ab.worker_ab("tf_xla", ["inference"], config, batch_size=2, rounds=1, steps=1)
    if keras.backend.backend() == "tensorflow":
        assert result["jit_compile"] == {"library": tensorflow_steps_use_xla(), "other": True}
    else:  # both forms take Keras' choice
        assert result["jit_compile"]["library"] == result["jit_compile"]["other"]
    assert result["max_abs_diff"] < 1e-5


@pytest.mark.parametrize("op_name, expected", [
    ("vit_1/block_4_1/mlp_1/fc1_1/Tensordot/MatMul", ("mlp", "forward")),
    ("gradient_tape/vit_1/block_0_1/attention_1/MatMul_1/MatMul", ("attention", "backward")),
    ("gradient_tape/vit_1/block_2_1/mlp_norm_1/mul_2/Mul", ("norm", "backward")),
    ("vit_1/stem_1/projection_1/Tensordot/MatMul", ("stem", "forward")),
    ("adam_w/Sqrt_17", ("optimizer", "forward")),
    ("AddN_4/tmp_var_initializer", ("unscoped", "forward")),
    ("mul_28", ("unscoped", "forward")),
    ("vit_1/Cast", ("other", "forward")),
])
def test_tensorflow_profile_assigns_ops_to_model_parts(op_name, expected):
    assert profile_tensorflow.part_of(op_name, "vit") == expected


@pytest.mark.skipif(__import__("keras").backend.backend() != "tensorflow",
                    reason="profiles TensorFlow kernels; this run's backend is another")
def test_tensorflow_profile_of_a_training_step_finds_the_model_parts_and_the_optimizer(tmp_path):
    from _common import compile_like_fit

    from keras_vitnorm import ViT

    model = compile_like_fit(ViT(image_size=16, patch_size=8, width=16, depth=1, num_heads=2, mlp_dim=32,
                                 num_classes=10))
    x = np.random.default_rng(0).uniform(-1, 1, (2, 16, 16, 3)).astype("float32")
    y = np.array([1, 2])
    model.train_on_batch(x, y)
    wall, path = profile_tensorflow.profile_steps(lambda: model.train_on_batch(x, y), 2, str(tmp_path))
    by_kernel, by_part = profile_tensorflow.summarize(path, 2, model.name)
    assert wall > 0
    if model.jit_compile:
        pytest.skip("Keras compiles TensorFlow with XLA on this machine: no per-kernel events to check")
    assert any("MatMul" in kernel for kernel in by_kernel)
    # Per step: the block's six forward matmuls (q, k, v, out, two in the MLP) and their backward.
    assert sum(calls for kernel, (_, calls) in by_kernel.items() if kernel.endswith("MatMul")) >= 3 * 4
    for part in ("attention", "mlp", "norm"):
        assert by_part[(part, "forward")] > 0 and by_part[(part, "backward")] > 0
    assert by_part[("optimizer", "forward")] > 0
    lines = profile_tensorflow.tables(by_kernel, by_part, rows=5)
    assert lines[0].startswith("| kernel |") and len(lines) >= 2 + 5


def test_variant_worker_times_every_variant_in_every_round(monkeypatch):
    import keras

    # The worker's bookkeeping is the same for any model; a one-block one compiles quickly.
    monkeypatch.setitem(bench_variants.MODELS, "study", dict(
        image_size=16, patch_size=4, width=32, depth=1, num_heads=2, mlp_dim=64, num_classes=10))
    args = argparse.Namespace(model="study", batch_size=2, rounds=2, steps=1, warmup=1,
                              mixed_precision="float32", device="cpu")
    result = bench_variants.worker(args)
    assert list(result["seconds"]) == list(bench_variants.VARIANTS)
    assert all(len(times) == 2 and min(times) > 0 for times in result["seconds"].values())
    summary = bench_variants.summarize(result)
    ratio, low, high, seconds = summary["layernorm (baseline)"]
    assert ratio == low == high == 1.0 and seconds > 0
    table = bench_variants.markdown({keras.backend.backend(): result}, argparse.Namespace(
        model="study", batch_size=2, mixed_precision="float32", rounds=2, steps=1, device="cpu"))
    assert "| conv stem | " in table and table.count("\n|") == 2 + len(bench_variants.VARIANTS)


def test_variant_worker_refuses_a_gpu_run_where_the_backend_has_no_gpu():
    import _common

    if _common.keras_backend_device() == "gpu":
        pytest.skip("this backend computes on a GPU here; the check is for one without")
    args = argparse.Namespace(model="study", batch_size=2, rounds=1, steps=1, warmup=0,
                              mixed_precision="float32", device="gpu")
    with pytest.raises(RuntimeError, match="--device gpu"):
        bench_variants.worker(args)


def test_variant_ratios_pair_each_round_with_the_baseline_of_that_round():
    result = {"seconds": {name: [2.0, 4.0] for name in bench_variants.VARIANTS}}
    result["seconds"]["rmsnorm"] = [1.0, 4.0]  # faster in round 1 only, as its baseline drifted
    ratio, low, high, _ = bench_variants.summarize(result)["rmsnorm"]
    assert (low, high) == (0.5, 1.0) and ratio == 0.75


@pytest.mark.one_backend
def test_randaugment_benchmark_times_each_histogram_count_against_bincount(capsys, monkeypatch):
    """One row per count asked for, each against `bincount`; `keras` builds the stream
    without the replacement. The script's bookkeeping is the same under every backend,
    and under JAX Keras' count takes most of a minute to build."""
    from keras_vitnorm.training import data as data_lib
    from keras_vitnorm.training.data import tf_pipeline

    replaced = []
    count = tf_pipeline.count_histograms_with_bincount
    monkeypatch.setattr(tf_pipeline, "count_histograms_with_bincount",
                        lambda layer: replaced.append(layer) or count(layer))
    bench_randaugment.main(["--image-size", "8", "--batch-size", "2", "--batches", "1", "--rounds", "1",
                            "--randaugment-ops", "1", "--counts", "bincount"])
    table = capsys.readouterr().out
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")]
    assert rows == ["histogram count", "bincount"]
    assert "| 1.00x | 1.00x |" in table and len(replaced) == 1
    first, rate = bench_randaugment.time_stream(data_lib.load_dataset("digits"), (8, 8), 2, 1, 1, "keras")
    assert first > 0 and rate > 0 and len(replaced) == 1


def test_input_benchmark_times_each_pipeline_against_the_training_step(capsys):
    import importlib.util

    bench_input.main(["--dataset", "digits", "--image-size", "8", "--batch-size", "4",
                      "--batches", "2", "--rounds", "1"])
    table = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    expected = ["python input, first read", "python input, images kept decoded",
                "training step (study model)"]
    if importlib.util.find_spec("tensorflow"):
        expected.append("tf.data input")
    assert sorted(set(rows) - {"what"}) == sorted(expected)
    assert rows["training step (study model)"].endswith("| 1.0x |")


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


@pytest.mark.parametrize("script", [bench_ab, bench_parallel, bench_vit, profile_tensorflow])
def test_host_memory_setting_is_one_helper_that_retains_only_when_asked(script, monkeypatch):
    import _common

    from keras_vitnorm import host_memory

    calls = []
    monkeypatch.setattr(host_memory, "retain_freed_memory", lambda: calls.append(True))
    assert script.apply_host_memory is _common.apply_host_memory
    _common.apply_host_memory("default")
    assert calls == []
    _common.apply_host_memory("retain")
    assert calls == [True]
    with pytest.raises(ValueError, match="'keep'.*retain, default"):
        _common.apply_host_memory("keep")
    parser = argparse.ArgumentParser()
    _common.add_host_memory_argument(parser, "who retains")
    assert parser.parse_args([]).host_memory == "retain"
    assert parser.parse_args(["--host-memory", "default"]).host_memory == "default"
