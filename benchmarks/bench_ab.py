"""A/B timing of one library code path against its alternative, in one process per backend.

    python benchmarks/bench_ab.py --changes linear --backends torch --modes inference train
    python benchmarks/bench_ab.py --changes split_qkv --rounds 6
    python benchmarks/bench_ab.py --changes attention --backends jax torch --device gpu \
        --preset b16 --batch-size 256 --mixed-precision mixed_bfloat16 --steps 5
    python benchmarks/bench_ab.py --changes residual_fence --backends jax --modes train

On a shared host the speed drifts by more than the few percent a code-path choice
is worth, so two separate benchmark runs cannot settle it. Here both forms of the
model are built in the same process (same seed, same weights), compiled once each,
and timed in alternation: `--rounds` times, `--steps` steps each, so drift hits both
alike. The table gives the median seconds per step of each form and their ratio.

Changes:

- each fast path of the model step (`linear`, `split_qkv`, `attention`,
  `residual_fence`; what each does and on which backend is in `keras_vitnorm/ops/switch.py`): the
  library with the fast path on against the same library with it switched off
  (`keras_vitnorm.ops.fast_paths`).
  On a backend where a fast path does not apply, the two forms are the same code.
- `tf_xla`: Keras' own choice for TensorFlow (`jit_compile="auto"`, which on a
  CPU-only machine means a graph of TensorFlow kernels without XLA) against
  `jit_compile=True` (XLA). On JAX and PyTorch both forms take Keras' choice.

A fast path stays in the library where it shortens a whole training or inference
step by at least 5% on some backend and device.

With `--device gpu` both forms, and the batch, are on the GPU; `--mixed-precision
mixed_bfloat16` sets Keras' dtype policy in the worker.

Each worker first calls `keras_vitnorm.host_memory.retain_freed_memory()` (as `bench_vit.py`
does) unless `--host-memory default`.

Steps run through `predict_on_batch` and `train_on_batch` (AdamW, cross-entropy),
as in `bench_vit.py`. The two forms' logits on the batch (after a random head, the
same for both) are compared too; "max abs output diff" should be float32 round-off.
"""

import argparse
import contextlib
import json
import os
import statistics
import sys

import numpy as np
from _common import add_host_memory_argument
from _common import apply_host_memory
from _common import batch_on
from _common import check_positive_ints
from _common import compile_like_fit
from _common import failure_row
from _common import require_keras_device
from _common import run_worker
from _common import timed

KERAS_BACKENDS = ("jax", "tensorflow", "torch")
FAST_PATHS = ("linear", "split_qkv", "attention", "residual_fence")  # keras_vitnorm.ops.FAST_PATHS of the model step (tested)
CHANGES = (*FAST_PATHS, "tf_xla")
MODES = ("inference", "train")


@contextlib.contextmanager
def other_form(change):
    """Within this context the library takes the alternative to its code path for `change`."""
    from keras_vitnorm import ops

    if change == "tf_xla":  # a compile argument, not a library path: see `_jit_compile`
        yield
        return
    if change not in FAST_PATHS:
        raise ValueError(f"unknown change {change!r}; valid: {', '.join(CHANGES)}")
    with ops.fast_paths(False, [change]):
        yield


def worker_ab(change, modes, config, batch_size, rounds, steps, device="cpu", dtype_policy="float32"):
    """`{mode: {"library": [s/step per round], "other": [...]}, "max_abs_diff": float,
    "jit_compile": {form: bool}}`."""
    import keras

    from keras_vitnorm import ViT

    require_keras_device(device)
    keras.config.set_dtype_policy(dtype_policy)
    rng = np.random.default_rng(0)
    size = config["image_size"]
    x = rng.uniform(-1, 1, (batch_size, size, size, 3)).astype("float32")
    y = rng.integers(0, config["num_classes"], (batch_size,))
    x, y = batch_on(device, x, y)
    forms = {"library": contextlib.nullcontext, "other": lambda: other_form(change)}
    models, outputs = {}, {}
    for form, context in forms.items():
        with context():
            keras.utils.set_random_seed(0)
            model = ViT(**config)
            # The head starts at zero (as in the paper), which would make every
            # output 0 and the comparison below empty: give both forms the same
            # random head. It does not change the time of a step.
            head = model.get_layer("head").kernel
            head.assign(np.random.default_rng(1).normal(0, 0.05, head.shape).astype("float32"))
            compile_like_fit(model, jit_compile=_jit_compile(change, form))
            outputs[form] = keras.ops.convert_to_numpy(keras.ops.cast(model.predict_on_batch(x), "float32"))
        models[form] = model
    results = {"max_abs_diff": float(np.max(np.abs(outputs["library"] - outputs["other"]))),
               "jit_compile": {form: bool(model.jit_compile) for form, model in models.items()}}
    for mode in modes:
        times = {form: [] for form in forms}
        for form, context in forms.items():  # first call: compile; second: warm-up
            with context():
                for _ in range(2):
                    _step(models[form], mode, x, y)
        for _ in range(rounds):
            for form, context in forms.items():
                with context():
                    seconds = timed(lambda f=form: _step(models[f], mode, x, y), steps)["step_s"]
                times[form].append(seconds)
        results[mode] = times
    return results


def _jit_compile(change, form):
    """The `jit_compile` argument of `compile`: `True` only for `tf_xla`'s other form on TensorFlow."""
    import keras

    return True if change == "tf_xla" and form == "other" and keras.backend.backend() == "tensorflow" else "auto"


def _step(model, mode, x, y):
    import keras

    if mode == "train":
        model.train_on_batch(x, y)
    else:
        keras.ops.convert_to_numpy(model.predict_on_batch(x))


def ab_table(results):
    """Markdown rows: backend, change, mode, both medians, ratio, and the output difference."""
    header = ["| backend | change | mode | library form (s/step) | other form (s/step) | library / other "
              "| rounds (library; other) | max abs output diff |", "|---|---|---|---|---|---|---|---|"]
    rows = []
    for (backend, change), result in results.items():
        if "error" in result:
            rows.append(failure_row(f"{backend} | {change}", result, 7))
            continue
        for mode in MODES:
            if mode not in result:
                continue
            lib, other = result[mode]["library"], result[mode]["other"]
            ratio = statistics.median(lib) / statistics.median(other)
            spread = f"{' '.join(f'{t:.3f}' for t in lib)}; {' '.join(f'{t:.3f}' for t in other)}"
            rows.append(f"| {backend} | {change} | {mode} | {statistics.median(lib):.3f} | "
                        f"{statistics.median(other):.3f} | {ratio:.3f} | {spread} | {result['max_abs_diff']:.1e} |")
    return header + rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--changes", nargs="+", default=list(CHANGES), choices=CHANGES)
    parser.add_argument("--backends", nargs="+", default=list(KERAS_BACKENDS), choices=KERAS_BACKENDS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--preset", default="s16")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--overrides", default="{}",
                        help="JSON ViT overrides, e.g. '{\"norm\": \"rmsnorm\"}'")
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the two forms; the median is reported")
    parser.add_argument("--steps", type=int, default=2, help="steps per form per round")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"),
                        help="cpu: GPUs hidden from the workers (default); gpu: models and batch on the GPU")
    parser.add_argument("--mixed-precision", default="float32", choices=("float32", "mixed_bfloat16"),
                        help="Keras dtype policy in the workers")
    add_host_memory_argument(parser, "retain (default): each worker calls "
                                     "keras_vitnorm.host_memory.retain_freed_memory() first")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--worker", choices=CHANGES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_positive_ints(parser, args, ("image_size", "batch_size", "rounds", "steps", "threads"))
    # Importing keras_vitnorm imports Keras: in the driver, use a backend that was asked for.
    os.environ.setdefault("KERAS_BACKEND", args.backends[0])
    from keras_vitnorm.models.presets import preset_config  # after parsing: --help needs no Keras

    try:
        overrides = json.loads(args.overrides)
    except json.JSONDecodeError as error:
        parser.error(f"--overrides is not JSON ({error}): {args.overrides!r}")
    if not isinstance(overrides, dict):
        parser.error(f"--overrides must be a JSON object, got {args.overrides!r}")
    try:
        config = {**preset_config(args.preset), "image_size": args.image_size, "num_classes": 1000, **overrides}
    except ValueError as error:
        parser.error(f"--preset: {error}")
    if args.worker:
        apply_host_memory(args.host_memory)
        result = worker_ab(args.worker, args.modes, config, args.batch_size, args.rounds, args.steps,
                           args.device, args.mixed_precision)
        print("RESULT " + json.dumps(result))
        return 0
    results = {}
    for backend in args.backends:
        for change in args.changes:
            print(f"timing {change} on {backend} ...", file=sys.stderr, flush=True)
            worker_args = [change, "--modes", *args.modes, "--preset", args.preset, "--overrides", args.overrides,
                           "--image-size", str(args.image_size), "--batch-size", str(args.batch_size),
                           "--rounds", str(args.rounds), "--steps", str(args.steps),
                           "--host-memory", args.host_memory, "--device", args.device,
                           "--mixed-precision", args.mixed_precision]
            results[(backend, change)] = run_worker(__file__, worker_args, backend, args.threads, args.device)
    where = "GPU" if args.device == "gpu" else f"CPU, {args.threads} threads"
    print(f"{args.preset} {overrides or ''} at {args.image_size}x{args.image_size}, batch {args.batch_size}, "
          f"{args.mixed_precision}, {where}; {args.rounds} alternating rounds of {args.steps} steps per "
          f"form; host memory: {args.host_memory}\n")
    print("\n".join(ab_table(results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{b}|{c}": r for (b, c), r in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
