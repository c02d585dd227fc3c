"""What the benchmark scripts share: timing and running one backend per subprocess."""

import json
import os
import statistics
import subprocess
import sys
import time


def check_positive_ints(parser, args, names):
    """Exits through `parser.error` naming the first of `names` (argparse dests) set below 1; `None` is unset."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")


def compile_like_fit(model, jit_compile="auto"):
    """Compiles a Keras model the way every benchmark times it: AdamW(1e-4), cross-entropy on logits."""
    import keras

    model.compile(optimizer=keras.optimizers.AdamW(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit_compile)
    return model


def keras_backend_device():
    """"gpu" if the running Keras backend computes on a GPU, else "cpu"."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return "gpu" if jax.default_backend() == "gpu" else "cpu"
    if backend == "torch":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    import tensorflow as tf

    return "gpu" if tf.config.list_physical_devices("GPU") else "cpu"


def tensorflow_steps_use_xla():
    """Whether Keras' `jit_compile="auto"` compiles TensorFlow's steps with XLA on this machine.

    Keras turns XLA off for TensorFlow on machines with no device but the CPU,
    and runs the step as a graph of TensorFlow's own kernels (oneDNN on x86).
    Micro-benchmarks take the same path as `fit` by asking this.
    """
    import tensorflow as tf

    return any(device.device_type != "CPU" for device in tf.config.list_physical_devices())


def reference_vit(config):
    """The transformers `ViTForImageClassification` (random weights) of the size of a keras_vitnorm config."""
    import transformers

    return transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=config["width"], num_hidden_layers=config["depth"], num_attention_heads=config["num_heads"],
        intermediate_size=config["mlp_dim"], image_size=config["image_size"], patch_size=config["patch_size"],
        num_labels=config["num_classes"], layer_norm_eps=1e-6))


def median_seconds(step, warmup, steps, repeats):
    """Median seconds per call of `step` over `repeats` runs of `steps` calls, after `warmup` calls.

    Returns:
        `(median, per-run seconds)`.
    """
    for _ in range(warmup):
        step()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        runs.append((time.perf_counter() - start) / steps)
    return statistics.median(runs), runs


def worker_env(backend, threads, device="cpu"):
    """The environment of a benchmark worker: its Keras backend and thread count, GPUs hidden for "cpu"."""
    env = dict(os.environ, KERAS_BACKEND=backend, OMP_NUM_THREADS=str(threads),
               TF_NUM_INTRAOP_THREADS=str(threads), TF_CPP_MIN_LOG_LEVEL="2")
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
    return env


def run_worker(script, arguments, backend, threads, device="cpu"):
    """Runs `script --worker ...` under a Keras backend and returns its `RESULT` JSON.

    With `device="cpu"` the child sees no GPU (so a GPU machine can still be
    benchmarked on its CPU); with `"gpu"` it sees what the machine has.
    The child prints one line `RESULT <json>`. A failure returns `{"error": ...}`
    with the last lines of its output, so one broken backend does not stop a table.
    """
    command = [sys.executable, os.path.abspath(script), "--worker", *arguments, "--threads", str(threads)]
    done = subprocess.run(command, env=worker_env(backend, threads, device), capture_output=True, text=True)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if done.returncode or line is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return {"error": " | ".join(tail)}
    return json.loads(line[len("RESULT "):])


def failure_row(label, result, columns):
    """A markdown table row for an implementation whose worker failed, padded to `columns` cells."""
    return f"| {label} | failed: {result['error'][:150]} |" + " |" * (columns - 2)
