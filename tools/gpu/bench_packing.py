"""Several runs of one small model sharing a device: trained as one program, as
processes side by side, or as processes under CUDA MPS; what each would give a study.

    KERAS_BACKEND=jax python tools/gpu/bench_packing.py --model study --batch-size 256 \
        --mixed-precision mixed_bfloat16 --packs 1 2 4 8
    KERAS_BACKEND=jax python tools/gpu/bench_packing.py --model ti16 --batch-size 256 \
        --mixed-precision mixed_bfloat16 --packs 1 2 4
    KERAS_BACKEND=jax python tools/gpu/bench_packing.py --device gpu --packs 1 8 \
        --sharing program processes mps

A study's runs are small: the CIFAR-10 study's ViT (1.2M parameters, 64 tokens) is a
few hundred kernels per step, each too small to fill a GPU, and runs that share a GPU
as processes take turns on it. Under JAX this times K runs trained as one program:
the training step of `fit` (Keras' `train_step` on the model's state: forward,
backward, AdamW on the recipes' warm-up and cosine schedule with kernel-only weight
decay, global-norm clipping, label smoothing) mapped over K stacked states and K
batches with `jax.vmap`, under `jax.jit`, the batches already on the device (the input
pipeline is `benchmarks/bench_input.py`'s). K = 1 is the step as `fit` runs it, not
mapped. Per K: the step's time (median over `--rounds` rounds of `--steps` steps) and
the images per second of all K runs together, against K = 1.

`--sharing` adds the other ways K runs can share the device, each timed on the same
step of one run: `processes`, K processes side by side (as `ablate --parallel K` trains
a study), each compiling its own step and starting its timed rounds when all are
ready; `mps`, the same under NVIDIA's Multi-Process Service (GPU only), whose server
runs the processes' kernels at the same time where without it the GPU switches
between them. The script starts MPS's control daemon for those rows, with its pipe
and log folders in a temporary folder, and quits it after them; the GPU's settings
(its compute mode) stay as they are. Where the daemon is missing or its server does
not start, the row says why. For processes, the step is the median of each process's
own step time, and the images per second are summed over the processes. Each of
these rows is printed as soon as it is measured, with the time its slowest process
took to compile its step, and again in the table at the end.

`--runs-per-process R` makes each of those processes train R runs as one program, as
a study would if each variant's process trained its R rates or seeds together: the
rows then count K x R runs. Against K processes of one run each, it says what such
packing would add to processes sharing the GPU.

The fast path `residual_fence` (JAX on a CPU only) is off for every K: JAX cannot map
its custom gradient over runs.

`--check` first trains each packed run for 2 steps on its own batches and compares
its weights and optimizer state with the same run trained alone, in float32 with
full-precision matmuls (the largest difference is printed; above 1e-4 of a
variable's scale the script exits with an error after its table). In bfloat16, or
TensorFloat-32 on a GPU, a mapped matmul rounds differently from the one it maps,
and Adam's second moments move by percents after 2 steps: rounding, not another
computation.

Models (`--model`): `study` (recipes/cifar10_study.sh's: 32 px, patch 4, width 128,
depth 6, 10 classes), `ti16` (recipes/imagenette_study.sh's: 224 px, patch 16, width
192, depth 12, 10 classes), `tiny` (a one-block model for tests).
"""

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                                "benchmarks"))
from _common import check_positive_ints  # noqa: E402
from _common import jax_training  # noqa: E402
from _common import wait_at_barrier  # noqa: E402
from _common import worker_result  # noqa: E402


def require_jax_backend(script, does):
    """Exits unless this process's Keras backend is JAX (or not set), and sets it: for
    the scripts that build JAX programs themselves (`does`: what the script does)."""
    found = os.environ.get("KERAS_BACKEND", "jax")
    if found != "jax":
        raise SystemExit(f"{script} {does}: run it with KERAS_BACKEND=jax (this process has "
                         f"KERAS_BACKEND={found}).")
    os.environ["KERAS_BACKEND"] = "jax"


def require_jax_device(device):
    """Exits unless JAX computes on `device` ("cpu" or "gpu") here."""
    import jax

    if device == "gpu" and jax.default_backend() != "gpu":
        raise SystemExit(f"--device gpu: JAX has no GPU here (its backend is "
                         f"{jax.default_backend()}).")


MODELS = {
    "study": dict(image_size=32, patch_size=4, width=128, depth=6, num_heads=4, mlp_dim=512),
    "ti16": dict(image_size=224, patch_size=16, width=192, depth=12, num_heads=3, mlp_dim=768),
    "tiny": dict(image_size=16, patch_size=8, width=16, depth=1, num_heads=2, mlp_dim=32),
}
NUM_CLASSES = 10
SHARING = ("program", "processes", "mps")


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="study")
    parser.add_argument("--batch-size", type=int, default=256, help="per run")
    parser.add_argument("--packs", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="numbers of runs per program (K)")
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mixed-precision", default="float32",
                        choices=["float32", "mixed_bfloat16", "mixed_float16"])
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                        help="where JAX computes (gpu: refused where JAX has no GPU)")
    parser.add_argument("--check", action="store_true",
                        help="first check that packed runs train as runs alone do")
    parser.add_argument("--sharing", nargs="+", choices=SHARING, default=["program"],
                        help="how K runs share the device: one program (vmap), K processes, "
                             "K processes under CUDA MPS (--device gpu)")
    parser.add_argument("--runs-per-process", type=int, default=1,
                        help="runs each process of --sharing processes/mps trains as one "
                             "program (a study's variant with its rates packed)")
    parser.add_argument("--process-seconds", type=int, default=120,
                        help="time allowed to K processes, from their start to their result "
                             "(a row that runs out says so and the script goes on)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--barrier", help=argparse.SUPPRESS)
    parser.add_argument("--barrier-count", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_positive_ints(parser, args, ("batch_size", "steps", "rounds", "process_seconds",
                                       "runs_per_process"))
    if any(k < 1 for k in args.packs):
        parser.error(f"--packs takes positive numbers of runs, got {args.packs}")
    if "mps" in args.sharing and args.device != "gpu":
        parser.error("--sharing mps is NVIDIA's Multi-Process Service for a GPU: it needs "
                     "--device gpu")
    return args


def build(model_name, batch_size, seed=0):
    """The model compiled as the study recipes train it, its step built; returns
    `(model, state)`: Keras' JAX training state `(trainable, non-trainable, optimizer,
    metrics)` variables' values."""
    import keras
    import numpy as np

    from keras_vitnorm import ViT
    from keras_vitnorm.training.optimizer import adamw
    from keras_vitnorm.training.optimizer import compile_classifier

    keras.utils.set_random_seed(seed)
    model = ViT(**MODELS[model_name], num_classes=NUM_CLASSES)
    compile_classifier(model, adamw(model, 1000, 1e-3, warmup_steps=100, weight_decay=0.05,
                                    grad_clip=1.0), label_smoothing=0.1)
    x, y = batches(model_name, 1, batch_size, seed)
    model.train_on_batch(np.asarray(x[0]), np.asarray(y[0]))  # builds the optimizer and metrics
    state, _ = jax_training(model)
    return model, state


def batches(model_name, packs, batch_size, seed=0):
    """`packs` different batches on the device: images `(packs, batch, size, size, 3)` in
    [-1, 1] and one-hot labels `(packs, batch, classes)`."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    size = MODELS[model_name]["image_size"]
    x = rng.uniform(-1, 1, (packs, batch_size, size, size, 3)).astype("float32")
    y = np.eye(NUM_CLASSES, dtype="float32")[rng.integers(0, NUM_CLASSES, (packs, batch_size))]
    return jnp.asarray(x), jnp.asarray(y)


def stacked(state, packs):
    """`packs` copies of a state, stacked on a new first axis."""
    import jax
    import jax.numpy as jnp

    return jax.tree_util.tree_map(lambda value: jnp.stack([value] * packs), state)


def step_functions(model):
    """`(one, packed)`: the jitted training step of one run `(state, (x, y)) -> state`,
    and of K runs over stacked states and batches."""
    import jax

    _, one = jax_training(model)
    return jax.jit(one), jax.jit(jax.vmap(one))


def check(model_name, batch_size, packs):
    """The largest difference, relative to each variable's scale, between each of `packs`
    runs trained 2 steps in one program and the same run trained alone."""
    import jax

    # float32 matmuls in full precision: a GPU's default (TensorFloat-32) rounds a
    # mapped matmul differently from the one it maps
    with jax.default_matmul_precision("highest"):
        return _check(model_name, batch_size, packs)


def _check(model_name, batch_size, packs):
    import jax
    import numpy as np

    model, state = build(model_name, batch_size)
    one, packed = step_functions(model)
    x, y = batches(model_name, packs * 2, batch_size, seed=1)
    together = stacked(state, packs)
    for s in range(2):
        together = packed(together, (x[s * packs:(s + 1) * packs], y[s * packs:(s + 1) * packs]))
    worst = 0.0
    for k in range(packs):
        alone = state
        for s in range(2):
            alone = one(alone, (x[s * packs + k], y[s * packs + k]))
        run_k = jax.tree_util.tree_map(lambda v, k=k: v[k], together[:3])
        pairs = zip(jax.tree_util.tree_leaves(alone[:3]), jax.tree_util.tree_leaves(run_k),
                    strict=True)
        for a, b in pairs:
            a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
            scale = max(np.abs(a).max(), 1e-6)
            worst = max(worst, float(np.abs(a - b).max() / scale))
    return worst


def time_pack(model, state, model_name, packs, batch_size, steps, rounds, ready=None):
    """Seconds per step of `packs` runs (one program) in each of `rounds` rounds;
    `ready()`, if given, is called between the warm-up and the timed rounds."""
    import jax

    one, packed = step_functions(model)
    function = one if packs == 1 else packed
    x, y = batches(model_name, packs, batch_size)
    data = (x[0], y[0]) if packs == 1 else (x, y)
    current = state if packs == 1 else stacked(state, packs)
    for _ in range(2):  # compile and warm up
        current = function(current, data)
    jax.block_until_ready(current)
    if ready is not None:
        ready()
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(steps):
            current = function(current, data)
        jax.block_until_ready(current)
        times.append((time.perf_counter() - began) / steps)
    return times


class MPSUnavailable(RuntimeError):
    """NVIDIA's Multi-Process Service could not serve this benchmark's processes."""


@contextlib.contextmanager
def mps_daemon():
    """Runs NVIDIA MPS's control daemon while the block runs, with its pipe and log
    folders in a temporary folder; yields the environment its clients need and quits
    the daemon after. Raises `MPSUnavailable` naming why it cannot start."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        raise MPSUnavailable("nvidia-cuda-mps-control is not on this machine's PATH")
    with tempfile.TemporaryDirectory(prefix="mps-") as folder:
        env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=os.path.join(folder, "pipe"),
                   CUDA_MPS_LOG_DIRECTORY=os.path.join(folder, "log"))
        for name in ("pipe", "log"):
            os.mkdir(os.path.join(folder, name))
        started = subprocess.run([control, "-d"], env=env, capture_output=True, text=True,
                                 timeout=30)
        if started.returncode:
            raise MPSUnavailable(f"nvidia-cuda-mps-control -d exited with {started.returncode}: "
                                 + (started.stderr or started.stdout).strip()[-300:])
        try:
            yield env
        finally:
            subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True,
                           timeout=30)


def mps_servers(env):
    """The process ids of the MPS servers the daemon of `env` started, as text."""
    listed = subprocess.run([shutil.which("nvidia-cuda-mps-control")], input="get_server_list\n",
                            env=env, capture_output=True, text=True, timeout=30)
    return [word for word in listed.stdout.split() if word.isdigit()]


def worker(args):
    """The step of `--runs-per-process` runs (one run's step where that is 1), timed
    after every process of the round is ready: its seconds per step in each round, and
    the seconds from its start to its compiled, warmed-up step (its start-up beside the
    others')."""
    began = time.monotonic()
    _configure(args)
    model, state = build(args.model, args.batch_size)
    compiled = []

    def ready():
        compiled.append(time.monotonic() - began)
        wait_at_barrier(args.barrier, args.barrier_count)

    seconds = time_pack(model, state, args.model, args.runs_per_process, args.batch_size,
                        args.steps, args.rounds, ready)
    return {"seconds": seconds, "compiled": compiled[0]}


def time_processes(args, packs, env=None):
    """Each of `packs` processes training its `--runs-per-process` runs at the same
    moment: `[result]`, with its `seconds` per step in each round and the seconds it
    took to `compiled`."""
    arguments = ["--model", args.model, "--batch-size", str(args.batch_size),
                 "--steps", str(args.steps), "--rounds", str(args.rounds),
                 "--mixed-precision", args.mixed_precision, "--device", args.device,
                 "--runs-per-process", str(args.runs_per_process)]
    child_env = dict(env or os.environ, KERAS_BACKEND="jax")
    child_env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # K processes share it
    if args.device == "cpu":
        child_env["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory() as barrier:
        children = [subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", *arguments,
             "--barrier", barrier, "--barrier-count", str(packs)],
            env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(packs)]
        deadline = time.monotonic() + args.process_seconds
        try:
            results = [child.communicate(timeout=max(1.0, deadline - time.monotonic()))
                       + (child.returncode,) for child in children]
        except subprocess.TimeoutExpired:
            for child in children:
                child.kill()
                child.communicate()
            raise RuntimeError(f"{packs} processes did not finish in {args.process_seconds} s "
                               "(--process-seconds)") from None
    seconds = []
    for out, err, code in results:
        result = worker_result(out)
        if code or result is None:
            raise RuntimeError("a process failed: "
                               + " | ".join((err or out).strip().splitlines()[-3:])[-400:])
        seconds.append(result)
    return seconds


def processes_row(args, packs, how, env=None):
    """A table row for `packs` processes of `--runs-per-process` runs each: `(runs, how,
    seconds per step, img/s)`. Prints it at once, with the slowest process's start-up, so
    that a call cut short keeps it."""
    results = time_processes(args, packs, env)
    seconds = [result["seconds"] for result in results]
    images = args.runs_per_process * args.batch_size  # per step of a process
    per_round = [sum(images / run[r] for run in seconds) for r in range(args.rounds)]
    step = statistics.median(statistics.median(run) for run in seconds)
    rate = statistics.median(per_round)
    started = max(result["compiled"] for result in results)
    runs = packs * args.runs_per_process
    print(f"{runs} {how}: {1000 * step:.2f} ms per step, {rate:,.0f} images/s in all "
          f"(the last compiled its step {started:.0f} s after its start)", flush=True)
    return runs, how, step, rate


def sharing_label(args, kind):
    """The table's name for `kind` ("processes" or "processes under MPS") of
    `--runs-per-process` runs each."""
    if args.runs_per_process == 1:
        return kind
    return kind.replace("processes", f"processes of {args.runs_per_process} runs in one "
                                     "program each")


def _configure(args):
    """The process's JAX device check and fast paths, as every row times them."""
    require_jax_device(args.device)
    from keras_vitnorm import ops

    # JAX has no batching rule for the fast path's custom gradient: off for every K.
    ops.set_fast_paths(False, ["residual_fence"])
    import keras

    keras.config.set_dtype_policy(args.mixed_precision)


def main(argv=None):
    args = parse_arguments(argv)
    require_jax_backend("bench_packing.py", "times JAX programs")
    if set(args.sharing) & {"processes", "mps"}:  # K processes share the device's memory
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return None
    several = [packs for packs in args.packs if packs > 1]
    # The processes first, while this one holds no context on the GPU (an MPS server
    # may not start beside a context that is not its client's).
    shared = []
    if "processes" in args.sharing:
        how = sharing_label(args, "processes")
        shared += [_guarded(lambda p=packs: processes_row(args, p, how),
                            packs * args.runs_per_process, how) for packs in several]
    if "mps" in args.sharing:
        shared += _mps_rows(args, several)
    import jax
    import keras

    _configure(args)
    failed = []
    if args.check:
        keras.config.set_dtype_policy("float32")
        for packs in sorted(set(args.packs) - {1}):
            worst = check(args.model, args.batch_size, packs)
            print(f"check, {packs} runs in one program against each alone after 2 steps "
                  f"(float32): largest difference {worst:.2e} of the variables' scale")
            if worst > 1e-4:
                failed.append(f"{packs} runs: {worst:.2e}")
    keras.config.set_dtype_policy(args.mixed_precision)
    model, state = build(args.model, args.batch_size)
    rows = []  # (runs, how, seconds per step, images per second; or None and why)
    base = time_pack(model, state, args.model, 1, args.batch_size, args.steps, args.rounds)
    base = statistics.median(base)
    rows.append((1, "one run", base, args.batch_size / base))
    if "program" in args.sharing:
        for packs in several:
            seconds = statistics.median(time_pack(model, state, args.model, packs,
                                                  args.batch_size, args.steps, args.rounds))
            rows.append((packs, "one program", seconds, packs * args.batch_size / seconds))
    rows += shared
    device = jax.devices()[0].device_kind
    print(f"\n{args.model} model, batch {args.batch_size} per run, {args.mixed_precision}, "
          f"{device}; median of {args.rounds} rounds of {args.steps} steps\n")
    print("| runs | how they share the device | step (ms) | images/s, all runs | vs one run |")
    print("|---|---|---|---|---|")
    for packs, how, seconds, rate in rows:
        if seconds is None:
            print(f"| {packs} | {how} | did not run: {rate} | | |")
        else:
            print(f"| {packs} | {how} | {1000 * seconds:.2f} | {rate:,.0f} | "
                  f"{rate * base / args.batch_size:.2f}x |")
    if failed:  # after the table, which a lent GPU's minutes paid for
        raise SystemExit("the check failed: packed runs differ from runs alone by more than "
                         "1e-4 of a variable's scale (" + "; ".join(failed) + ")")
    return rows


def _guarded(row, packs, how):
    """`row()`, or a row that says why it did not run (a lent GPU's call keeps the rest)."""
    try:
        return row()
    except RuntimeError as error:
        print(f"{packs} {how}: did not run: {error}", flush=True)
        return packs, how, None, str(error)


def _mps_rows(args, several):
    how = sharing_label(args, "processes under MPS")
    try:
        with mps_daemon() as env:
            rows = [_guarded(lambda p=packs: processes_row(args, p, how, env),
                             packs * args.runs_per_process, how) for packs in several]
            servers = mps_servers(env)
    except MPSUnavailable as error:
        print(f"{how}: did not run: {error}", flush=True)
        return [(packs * args.runs_per_process, how, None, str(error)) for packs in several]
    if not servers:  # the clients ran without the daemon's server: time-sliced, not MPS
        print("the MPS daemon started no server: the rows above ran without it", flush=True)
        return [row if row[2] is None else
                (row[0], row[1], None, "the MPS daemon started no server; the processes ran "
                                       "without it") for row in rows]
    return rows


if __name__ == "__main__":
    main()
