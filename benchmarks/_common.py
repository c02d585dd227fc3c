"""What the benchmark scripts share: the timer, the models' steps and one backend per subprocess."""

import json
import os
import resource
import signal
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


def jax_training(model):
    """`(state, step)` of a compiled Keras model under JAX, whose optimizer and metrics
    are built: Keras' training state `(trainable, non-trainable, optimizer, metrics)`
    variables' values, and the training step of `fit` on it, `step(state, (x, y))`
    returning the next state (Keras' `train_step`, not yet under `jax.jit`)."""
    state = ([v.value for v in model.trainable_variables],
             [v.value for v in model.non_trainable_variables],
             [v.value for v in model.optimizer.variables],
             [v.value for v in model.metrics_variables])

    def step(state, data):
        _, state = model.train_step(state, data)
        return state

    return state, step


def wait_at_barrier(folder, count):
    """Announces this worker in `folder` and waits until `count` workers have: the
    workers of a round then start timing together."""
    open(os.path.join(folder, f"ready-{os.getpid()}"), "w").close()
    while len(os.listdir(folder)) < count:
        time.sleep(0.02)


def worker_result(stdout):
    """The JSON of a worker's `RESULT <json>` line in `stdout`, or None if it printed none."""
    line = next((l for l in stdout.splitlines() if l.startswith("RESULT ")), None)
    return None if line is None else json.loads(line[len("RESULT "):])


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


def keras_steps(config, batch_size, modes, device="cpu", dtype_policy="float32", implementation="keras",
                jit_compile="auto"):
    """`{mode: step function}` for a Keras model (keras_vitnorm or keras-hub), compiled as `fit` would
    (with `jit_compile`).

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
    compile_like_fit(model, jit_compile)
    x, y = batch_on(device, *synthetic_batch(config, batch_size))
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
    """`{mode: step function}` for the transformers ViT, run as PyTorch users run it
    (`torch_steps`)."""
    return torch_steps(reference_vit(config), lambda model, x: model(pixel_values=x).logits, config,
                       batch_size, modes, threads, device, mixed_precision)


def timm_steps(config, batch_size, modes, threads, device="cpu", mixed_precision="float32",
               compiled=False):
    """`{mode: step function}` for timm's ViT (`timm_vit`), eager or under `torch.compile`."""
    return torch_steps(timm_vit(config), lambda model, x: model(x), config, batch_size, modes,
                       threads, device, mixed_precision, compiled)


def torch_steps(model, logits_of, config, batch_size, modes, threads, device="cpu",
                mixed_precision="float32", compiled=False):
    """`{mode: step function}` for a PyTorch classifier (`model`, taking `(batch, 3, size,
    size)` images; `logits_of(forward, x)` its logits through the model or its compiled
    form), run as PyTorch users run it: inference is the forward pass under
    `inference_mode`, training forward, backward and `AdamW.step()`, both under
    `torch.autocast` in bfloat16 with `mixed_precision="mixed_bfloat16"`, the batch on
    the device. `compiled=True` runs the forward pass through `torch.compile(model)`.
    """
    import torch

    torch.set_num_threads(threads)
    device = "cuda" if device == "gpu" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device gpu: PyTorch sees no CUDA GPU on this machine")
    model = model.to(device)
    forward = torch.compile(model) if compiled else model
    dtype = torch.bfloat16 if mixed_precision == "mixed_bfloat16" else None
    x, y = synthetic_batch(config, batch_size)
    x, y = torch.from_numpy(x.transpose(0, 3, 1, 2).copy()).to(device), torch.from_numpy(y).to(device)

    def autocast():
        return torch.autocast(device, dtype=dtype) if dtype else torch.autocast(device, enabled=False)

    steps = {}
    if "inference" in modes:
        def predict():
            model.eval()  # a no-op flag walk, so the two modes can alternate (--interleave)
            with torch.inference_mode(), autocast():
                logits_of(forward, x).float().cpu().numpy()

        steps["inference"] = predict
    if "train" in modes:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loss_fn = torch.nn.CrossEntropyLoss()

        def train():
            model.train()
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                loss = loss_fn(logits_of(forward, x).float(), y)
            loss.backward()
            optimizer.step()
            loss.item()  # Keras' train_on_batch returns the loss as a Python float too

        # AdamW's step counters, which PyTorch keeps on the host whatever the device: reading
        # them waits for no GPU (tools/gpu/host_waits.py leaves them out).
        train.host_tensors = lambda: [state["step"] for state in optimizer.state.values()
                                      if "step" in state]
        steps["train"] = train
    return steps


def tensorflow_steps_use_xla():
    """Whether Keras' `jit_compile="auto"` compiles TensorFlow's steps with XLA here: not on a
    machine with no device but the CPU, where a step is a graph of TensorFlow's kernels."""
    import tensorflow as tf

    return any(device.device_type != "CPU" for device in tf.config.list_physical_devices())


def reference_vit(config):
    """The transformers `ViTForImageClassification` (random weights) of the size of a keras_vitnorm config."""
    import transformers

    return transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=config["width"], num_hidden_layers=config["depth"], num_attention_heads=config["num_heads"],
        intermediate_size=config["mlp_dim"], image_size=config["image_size"], patch_size=config["patch_size"],
        num_labels=config["num_classes"], layer_norm_eps=1e-6))


#: timm's names of the standard ViT widths; `timm_vit` gives timm every size anyway.
TIMM_SIZE_NAMES = {192: "tiny", 384: "small", 768: "base", 1024: "large"}


def timm_vit(config):
    """timm's `VisionTransformer` (random weights) of the size of a keras_vitnorm config:
    `timm.create_model` under the standard name of its size (`vit_base_patch16_224` for
    B/16), every size given explicitly, so that another size builds the same kind of model.

    Raises:
        ImportError: timm does not import here (it needs torchvision built for this PyTorch).
        ValueError: the MLP width is not one timm can express as `mlp_ratio * width`.
    """
    try:
        import timm
    except ImportError as error:
        raise ImportError(f"timm does not import here: {error}") from error

    width, patch_size = config["width"], config["patch_size"]
    name = f"vit_{TIMM_SIZE_NAMES.get(width, 'base')}_patch{patch_size}_224"
    if not timm.is_model(name):
        name = "vit_base_patch16_224"
    model = timm.create_model(
        name, pretrained=False, img_size=config["image_size"], patch_size=patch_size,
        embed_dim=width, depth=config["depth"], num_heads=config["num_heads"],
        mlp_ratio=config["mlp_dim"] / width, num_classes=config["num_classes"])
    hidden = model.blocks[0].mlp.fc1.out_features
    if hidden != config["mlp_dim"]:
        raise ValueError(f"timm builds an MLP width of {hidden} for mlp_dim={config['mlp_dim']} "
                         f"at width {width}: use an mlp_dim that is a whole multiple of the width")
    return model


def timed(step, steps=1, repeats=1, warmup=0, first_call=False, memory=None, wait=None):
    """Times `repeats` runs of `steps` calls of `step()` after `warmup` calls: the one timer
    of every benchmark here.

    `first_call` times the first call (tracing, compilation) on its own, before the
    warm-up; a `_memory.WorkerMemory` `memory` is reset after the warm-up and read after
    the runs; `wait()` runs after the warm-up and ends each timed run, for steps that
    return before their work is done (JAX's asynchronous dispatch, CUDA). Returns a dict:
    `step_s`, the median seconds per call; `runs`, each run's; `faults` and `kernel_s`,
    minor page faults and system CPU seconds per call (`getrusage`: the cost of memory
    the allocator maps afresh); `compile_s` with `first_call`; `peak_bytes` and
    `capacity_bytes` with `memory`.
    """
    wait = wait or (lambda: None)
    result = {}
    if first_call:
        start = time.perf_counter()
        step()
        wait()
        result["compile_s"] = time.perf_counter() - start
    for _ in range(warmup):
        step()
    wait()
    if memory is not None:
        memory.reset()
    before = resource.getrusage(resource.RUSAGE_SELF)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wait()
        runs.append((time.perf_counter() - start) / steps)
    after = resource.getrusage(resource.RUSAGE_SELF)
    result.update(step_s=statistics.median(runs), runs=runs,
                  faults=(after.ru_minflt - before.ru_minflt) / (steps * repeats),
                  kernel_s=(after.ru_stime - before.ru_stime) / (steps * repeats))
    if memory is not None:
        result.update(peak_bytes=memory.peak(), capacity_bytes=memory.capacity())
    return result


#: `worker_env`'s GPU memory settings for JAX: "default" leaves JAX's own (75% of the GPU
#: at its first computation); "shared": as it needs it, for workers sharing the GPU
#: (`--interleave`); "whole": 95%, for tools/gpu/largest_batch.py's tries.
GPU_MEMORY_SETTINGS = ("default", "shared", "whole")


def worker_env(backend, threads, device="cpu", gpu_memory="default"):
    """The environment of a benchmark worker: its Keras backend and thread count, GPUs
    hidden for "cpu", and with "gpu" JAX's memory setting `gpu_memory`
    (`GPU_MEMORY_SETTINGS`)."""
    if gpu_memory not in GPU_MEMORY_SETTINGS:
        raise ValueError(f"GPU memory setting {gpu_memory!r} is not one of "
                         f"{', '.join(GPU_MEMORY_SETTINGS)}")
    env = dict(os.environ, KERAS_BACKEND=backend, OMP_NUM_THREADS=str(threads),
               TF_NUM_INTRAOP_THREADS=str(threads), TF_CPP_MIN_LOG_LEVEL="2")
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
    elif gpu_memory == "shared":
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    elif gpu_memory == "whole":
        # JAX's CUDA plugin refuses the GPU if both spellings are set: keep the one in use.
        new_name = "XLA_CLIENT_MEM_FRACTION"
        env[new_name if new_name in env else "XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.95"
    return env


def run_worker(script, arguments, backend, threads, device="cpu", gpu_memory="default",
               timeout=None):
    """Runs `script --worker ...` in the environment `worker_env` gives it and returns the
    JSON of its `RESULT <json>` line. A failure returns `{"error": ...}` with the last
    lines of its output, so that one broken backend does not stop a table, with
    `"out_of_memory": True` where it ran out of memory (`is_out_of_memory`); a child still
    running after `timeout` seconds is killed: `{"error": ..., "timed_out": True}`."""
    command = [sys.executable, os.path.abspath(script), "--worker", *arguments, "--threads", str(threads)]
    try:
        done = subprocess.run(
            command, env=worker_env(backend, threads, device, gpu_memory),
            capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"still running after {timeout:.0f} s, stopped", "timed_out": True}
    result = worker_result(done.stdout)
    if done.returncode or result is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        failure = {"error": " | ".join(tail) or f"worker exited with code {done.returncode}"}
        if is_out_of_memory(done.stderr + done.stdout, done.returncode):
            failure["out_of_memory"] = True
        return failure
    return result


#: How PyTorch, XLA, TensorFlow, cuDNN and cuBLAS, and Python say that memory ran out.
OUT_OF_MEMORY_MARKERS = ("out of memory", "outofmemoryerror", "resource_exhausted",
                         "resourceexhaustederror", "oom when allocating", "alloc_failed",
                         "memoryerror", "cannot allocate memory")


def is_out_of_memory(output, returncode=0):
    """Whether a failed worker's `output` (stderr and stdout) or its `returncode` says it
    ran out of memory: one of `OUT_OF_MEMORY_MARKERS`, or killed by SIGKILL, as Linux's
    out-of-memory killer ends a process."""
    return returncode == -signal.SIGKILL or any(marker in output.lower()
                                                 for marker in OUT_OF_MEMORY_MARKERS)


def failure_row(label, result, columns):
    """A markdown table row for an implementation whose worker failed, padded to `columns` cells.

    It shows the error's last line (`run_worker` joins lines with " | "), where a
    traceback names the exception, with no "|" left to split the row.
    """
    shown = result["error"].split(" | ")[-1].replace("|", "/")[:150]
    return f"| {label} | failed: {shown} |" + " |" * (columns - 2)
