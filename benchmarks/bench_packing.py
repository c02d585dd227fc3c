"""Several runs of one small model trained as one program: what packing a study's runs
into one process would give on this device.

    KERAS_BACKEND=jax python benchmarks/bench_packing.py --model study --batch-size 256 \
        --mixed-precision mixed_bfloat16 --packs 1 2 4 8
    KERAS_BACKEND=jax python benchmarks/bench_packing.py --model ti16 --batch-size 256 \
        --mixed-precision mixed_bfloat16 --packs 1 2 4

A study's runs are small: the CIFAR-10 study's ViT (1.2M parameters, 64 tokens) is a
few hundred kernels per step, each too small to fill a GPU, and runs that share a GPU
as processes take turns on it. Under JAX this times K runs trained as one program:
the training step of `fit` (Keras' `train_step` on the model's state: forward,
backward, AdamW on the recipes' warm-up and cosine schedule with kernel-only weight
decay, global-norm clipping, label smoothing) mapped over K stacked states and K
batches with `jax.vmap`, under `jax.jit`, the batches already on the device (the input
pipeline is `bench_input.py`'s). K = 1 is the step as `fit` runs it, not mapped. Per
K: the step's time (median over `--rounds` rounds of `--steps` steps) and the images
per second of all K runs together, against K = 1.

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
import statistics
import time

from _common import check_positive_ints

MODELS = {
    "study": dict(image_size=32, patch_size=4, width=128, depth=6, num_heads=4, mlp_dim=512),
    "ti16": dict(image_size=224, patch_size=16, width=192, depth=12, num_heads=3, mlp_dim=768),
    "tiny": dict(image_size=16, patch_size=8, width=16, depth=1, num_heads=2, mlp_dim=32),
}
NUM_CLASSES = 10


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
    args = parser.parse_args(argv)
    check_positive_ints(parser, args, ("batch_size", "steps", "rounds"))
    if any(k < 1 for k in args.packs):
        parser.error(f"--packs takes positive numbers of runs, got {args.packs}")
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
    state = ([v.value for v in model.trainable_variables],
             [v.value for v in model.non_trainable_variables],
             [v.value for v in model.optimizer.variables],
             [v.value for v in model.metrics_variables])
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

    def one(state, data):
        _, state = model.train_step(state, data)
        return state

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


def time_pack(model, state, model_name, packs, batch_size, steps, rounds):
    """Median seconds per step of `packs` runs (one program), over `rounds` rounds."""
    import jax

    one, packed = step_functions(model)
    function = one if packs == 1 else packed
    x, y = batches(model_name, packs, batch_size)
    data = (x[0], y[0]) if packs == 1 else (x, y)
    current = state if packs == 1 else stacked(state, packs)
    for _ in range(2):  # compile and warm up
        current = function(current, data)
    jax.block_until_ready(current)
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(steps):
            current = function(current, data)
        jax.block_until_ready(current)
        times.append((time.perf_counter() - began) / steps)
    return statistics.median(times)


def main(argv=None):
    args = parse_arguments(argv)
    import os

    if os.environ.get("KERAS_BACKEND", "jax") != "jax":
        raise SystemExit("bench_packing.py times JAX programs: run it with KERAS_BACKEND=jax "
                         f"(this process has KERAS_BACKEND={os.environ['KERAS_BACKEND']}).")
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import keras

    if args.device == "gpu" and jax.default_backend() != "gpu":
        raise SystemExit(f"--device gpu: JAX has no GPU here (its backend is "
                         f"{jax.default_backend()}).")
    from keras_vitnorm import ops

    # JAX has no batching rule for the fast path's custom gradient: off for every K.
    ops.set_fast_paths(False, ["residual_fence"])
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
    rows = []
    for packs in args.packs:
        seconds = time_pack(model, state, args.model, packs, args.batch_size, args.steps,
                            args.rounds)
        rows.append((packs, seconds, packs * args.batch_size / seconds))
    device = jax.devices()[0].device_kind
    print(f"\n{args.model} model, batch {args.batch_size} per run, {args.mixed_precision}, "
          f"{device}; median of {args.rounds} rounds of {args.steps} steps\n")
    print("| runs in one program | step (ms) | images/s, all runs | vs one run |")
    print("|---|---|---|---|")
    base = next((rate for packs, _, rate in rows if packs == 1), rows[0][2])
    for packs, seconds, rate in rows:
        print(f"| {packs} | {1000 * seconds:.2f} | {rate:,.0f} | {rate / base:.2f}x |")
    if failed:  # after the table, which a lent GPU's minutes paid for
        raise SystemExit("the check failed: packed runs differ from runs alone by more than "
                         "1e-4 of a variable's scale (" + "; ".join(failed) + ")")
    return rows


if __name__ == "__main__":
    main()
