"""What the benchmark scripts share: timing and running one backend per subprocess."""

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np


def check_positive_ints(parser, args, names):
    """Exits through `parser.error` naming the first of `names` (argparse dests) set below 1; `None` is unset."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")


#: `--host-memory` settings: "retain" calls `keras_vitnorm.host_memory.retain_freed_memory()`
#: before the first computation (as the study's workers do), "default" leaves glibc's own.
HOST_MEMORY_SETTINGS = ("retain", "default")


def add_host_memory_argument(parser, help_text):
    """Adds `--host-memory` (`HOST_MEMORY_SETTINGS`, "retain" by default) to `parser`."""
    parser.add_argument("--host-memory", default="retain", choices=HOST_MEMORY_SETTINGS, help=help_text)


def apply_host_memory(setting):
    """Applies a `--host-memory` setting in this process; call it before the first computation."""
    if setting not in HOST_MEMORY_SETTINGS:
        valid = ", ".join(HOST_MEMORY_SETTINGS)
        raise ValueError(f"host memory setting {setting!r} is not one of {valid}")
    if setting == "retain":
        from keras_vitnorm.host_memory import retain_freed_memory

        retain_freed_memory()


def compile_like_fit(model, jit_compile="auto"):
    """Compiles a Keras model the way every benchmark times it: AdamW(1e-4), cross-entropy on logits."""
    import keras

    model.compile(optimizer=keras.optimizers.AdamW(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit_compile)
    return model


def synthetic_batch(config, batch_size):
    """A fixed batch for `config` (a ViT config dict): images uniform in [-1, 1] and integer labels."""
    rng = np.random.default_rng(0)
    size = config["image_size"]
    x = rng.uniform(-1, 1, (batch_size, size, size, 3)).astype("float32")
    y = rng.integers(0, config["num_classes"], (batch_size,))
    return x, y


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


def require_keras_device(device):
    """Raises unless the running Keras backend computes on `device` ("cpu" or "gpu")."""
    import keras

    found = keras_backend_device()
    if found != device:
        raise RuntimeError(f"--device {device}: the {keras.backend.backend()} backend runs on {found} here")


def batch_on(device, *arrays):
    """The arrays as Keras tensors on the GPU for `device="gpu"` (so no timed step
    includes a host-to-device copy), unchanged for `"cpu"`."""
    import keras

    if device == "gpu":
        return tuple(keras.ops.convert_to_tensor(a) for a in arrays)
    return arrays


def keras_steps(config, batch_size, modes, device="cpu", dtype_policy="float32", implementation="keras"):
    """`{mode: step function}` for a Keras model (keras_vitnorm or keras-hub), compiled as `fit` would.

    Inference is `predict_on_batch`, training `train_on_batch` (AdamW, cross-entropy),
    on one random batch; with `device="gpu"` the batch is on the GPU, so no step
    times a host-to-device copy.
    """
    import keras

    from keras_vitnorm import ViT

    require_keras_device(device)
    keras.config.set_dtype_policy(dtype_policy)
    if implementation == "keras_hub":
        import keras_hub

        backbone = keras_hub.models.ViTBackbone(
            image_shape=(config["image_size"], config["image_size"], 3),
            patch_size=config["patch_size"], num_layers=config["depth"], num_heads=config["num_heads"],
            hidden_dim=config["width"], mlp_dim=config["mlp_dim"])
        model = keras_hub.models.ViTImageClassifier(backbone=backbone, num_classes=config["num_classes"])
    else:
        model = ViT(**config)
    compile_like_fit(model)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (batch_size, config["image_size"], config["image_size"], 3)).astype("float32")
    y = rng.integers(0, config["num_classes"], (batch_size,))
    x, y = batch_on(device, x, y)
    steps = {}
    if "inference" in modes:
        def predict():
            keras.ops.convert_to_numpy(model.predict_on_batch(x))

        steps["inference"] = predict
    if "train" in modes:
        def train():
            model.train_on_batch(x, y)

        steps["train"] = train
    return steps


def reference_steps(config, batch_size, modes, threads, device="cpu", mixed_precision="float32"):
    """`{mode: step function}` for the transformers ViT, run as PyTorch users run it.

    Inference is `model(x)` under `inference_mode`, training forward, backward and
    `AdamW.step()`, both under `torch.autocast` in bfloat16 with
    `mixed_precision="mixed_bfloat16"`; the batch is on the device.
    """
    import torch

    torch.set_num_threads(threads)
    device = "cuda" if device == "gpu" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device gpu: PyTorch sees no CUDA GPU on this machine")
    model = reference_vit(config).to(device)
    dtype = torch.bfloat16 if mixed_precision == "mixed_bfloat16" else None
    rng = np.random.default_rng(0)
    size = config["image_size"]
    x = torch.from_numpy(rng.uniform(-1, 1, (batch_size, 3, size, size)).astype("float32"))
    y = torch.from_numpy(rng.integers(0, config["num_classes"], (batch_size,)))
    x, y = x.to(device), y.to(device)

    def autocast():
        return torch.autocast(device, dtype=dtype) if dtype else torch.autocast(device, enabled=False)

    steps = {}
    if "inference" in modes:
        def predict():
            model.eval()  # a no-op flag walk, so the two modes can alternate (--interleave)
            with torch.inference_mode(), autocast():
                model(pixel_values=x).logits.float().cpu().numpy()

        steps["inference"] = predict
    if "train" in modes:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loss_fn = torch.nn.CrossEntropyLoss()

        def train():
            model.train()
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                loss = loss_fn(model(pixel_values=x).logits.float(), y)
            loss.backward()
            optimizer.step()
            loss.item()  # Keras' train_on_batch returns the loss as a Python float too

        # AdamW's step counters, which PyTorch keeps on the host whatever the device: reading
        # them waits for no GPU (host_waits.HostWaits leaves them out).
        train.host_tensors = lambda: [state["step"] for state in optimizer.state.values()
                                      if "step" in state]
        steps["train"] = train
    return steps


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
