"""Micro-benchmarks: RMSNorm against LayerNorm, and the cost of the Dual PatchNorm stem.

    python benchmarks/bench_norms.py                      # both parts, every backend
    python benchmarks/bench_norms.py --part norms --json norms.json

Part `norms` times the library's `layernorm` and `rmsnorm` layers (the layers
`make_norm` returns, as the models use them) on `(batch x tokens, width)`
activations of S/16 (width 384) and B/16 (width 768) at 224 px: forward, and
forward + backward (gradients of the input and the weights). Each backend runs the
path `fit` takes: `jax.jit` under JAX; under TensorFlow a `tf.function` graph,
with XLA only where TensorFlow sees a GPU or TPU (Keras' `jit_compile="auto"`
turns XLA off on CPU-only machines); eager autograd under PyTorch.

Part `stem` measures the Dual PatchNorm stem's cost on S/16 in two ways:

- directly: forward + backward of the `dual_patchnorm` stem minus the plain `patch`
  stem (the two extra LayerNorms), as a fraction of one full `s16_dpn` training
  step (`train_on_batch`, AdamW);
- end to end: `s16_dpn` against `s16` training steps, timed in alternation so
  machine drift hits both alike. This difference is the honest total but is only
  resolvable above the run-to-run noise, which is reported next to it.

Every figure is the median of `--repeats` timed runs after warm-up; each backend
runs in its own subprocess with the same thread count.
"""

import argparse
import json
import os
import statistics
import sys

import numpy as np
from _common import check_positive_ints
from _common import compile_like_fit
from _common import failure_row
from _common import run_worker
from _common import tensorflow_steps_use_xla
from _common import timed

KERAS_BACKENDS = ("jax", "tensorflow", "torch")
SIZES = {"S/16": 384, "B/16": 768}
TOKENS = 197  # 14 x 14 patches + class token at 224 px


def _compiled_steps(layer, x, upstream):
    """(forward, forward+backward) callables that block until their result is ready."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        weights = [v.value for v in layer.trainable_variables]
        others = [v.value for v in layer.non_trainable_variables]

        def forward(weights, x):
            return layer.stateless_call(weights, others, x)[0]

        def objective(weights, x):
            return jax.numpy.sum(forward(weights, x) * upstream)

        jit_forward = jax.jit(forward)
        jit_gradient = jax.jit(jax.grad(objective, argnums=(0, 1)))
        return (lambda: jax.block_until_ready(jit_forward(weights, x)),
                lambda: jax.block_until_ready(jit_gradient(weights, x)))
    if backend == "tensorflow":
        import tensorflow as tf

        xla = tensorflow_steps_use_xla()

        @tf.function(jit_compile=xla)
        def tf_forward(x):
            return layer(x)

        @tf.function(jit_compile=xla)
        def tf_gradient(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(layer(x) * upstream)
            return tape.gradient(loss, [x, *layer.trainable_variables])

        # TensorFlow on CPU returns from a function call only once it has run.
        return (lambda: tf_forward(x), lambda: tf_gradient(x))
    import torch

    x = x.detach().requires_grad_(True)

    def fwd():
        with torch.no_grad():
            layer(x)

    def grad():
        x.grad = None
        for variable in layer.trainable_variables:
            variable.value.grad = None
        (layer(x) * upstream).sum().backward()

    return fwd, grad


def worker_norms(args):
    import keras

    from keras_vitnorm.layers.normalization import make_norm

    rng = np.random.default_rng(0)
    results = {}
    for size, width in SIZES.items():
        shape = (args.batch_size, TOKENS, width)
        x = keras.ops.convert_to_tensor(rng.standard_normal(shape).astype("float32"))
        upstream = keras.ops.convert_to_tensor(rng.standard_normal(shape).astype("float32"))
        for norm in ("layernorm", "rmsnorm"):
            layer = make_norm(norm, epsilon=1e-6)
            layer.build(shape)
            fwd, grad = _compiled_steps(layer, x, upstream)
            for mode, step in (("forward", fwd), ("forward+backward", grad)):
                step()  # compile
                results[f"{size}|{norm}|{mode}"] = timed(step, args.steps, args.repeats,
                                                           args.warmup)["step_s"]
    return results


def worker_stem(args):
    import keras

    from keras_vitnorm import ViT
    from keras_vitnorm.layers.patch_stem import PatchStem
    from keras_vitnorm.models.presets import preset_config

    config = {**preset_config("s16"), "num_classes": 1000}
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (args.batch_size, 224, 224, 3)).astype("float32")
    labels = rng.integers(0, 1000, (args.batch_size,))
    results = {}
    tokens = (args.batch_size, TOKENS, config["width"])
    upstream = keras.ops.convert_to_tensor(rng.standard_normal(tokens).astype("float32"))
    x = keras.ops.convert_to_tensor(images)
    for stem in ("patch", "dual_patchnorm"):
        layer = PatchStem(patch_size=16, width=config["width"], stem=stem)
        layer.build(images.shape)
        _, grad = _compiled_steps(layer, x, upstream)
        grad()
        results[f"stem|{stem}"] = timed(grad, args.steps, args.repeats, args.warmup)["step_s"]

    models = {}
    for stem in ("patch", "dual_patchnorm"):
        model = ViT(**{**config, "stem": stem})
        compile_like_fit(model)
        model.train_on_batch(images, labels)  # compile
        for _ in range(args.warmup):
            model.train_on_batch(images, labels)
        models[stem] = model
    runs = {stem: [] for stem in models}
    for _ in range(args.step_repeats):
        for stem, model in models.items():
            runs[stem].append(timed(lambda: model.train_on_batch(images, labels))["step_s"])
    for stem, times in runs.items():
        results[f"train|{stem}"] = statistics.median(times)
        results[f"train|{stem}|runs"] = times
    return results


def spawn(args, part, backend):
    arguments = [part, "--batch-size", str(args.batch_size), "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--repeats", str(args.repeats),
                 "--step-repeats", str(args.step_repeats)]
    return run_worker(__file__, arguments, backend, args.threads)


def norms_table(results):
    lines = ["| backend | activations | LayerNorm fwd (ms) | RMSNorm fwd (ms) | speed-up fwd "
             "| LayerNorm fwd+bwd (ms) | RMSNorm fwd+bwd (ms) | speed-up fwd+bwd |",
             "|---|---|---|---|---|---|---|---|"]
    for backend, result in results.items():
        if "error" in result:
            lines.append(failure_row(backend, result, 8))
            continue
        for size, width in SIZES.items():
            cells = []
            for mode in ("forward", "forward+backward"):
                ln = result[f"{size}|layernorm|{mode}"]
                rms = result[f"{size}|rmsnorm|{mode}"]
                cells += [f"{ln * 1e3:.2f}", f"{rms * 1e3:.2f}", f"{ln / rms:.2f}x"]
            lines.append(f"| {backend} | {size} ({TOKENS} tokens x {width}) | " + " | ".join(cells) + " |")
    return lines


def stem_table(results):
    lines = ["| backend | DPN stem extra fwd+bwd (ms) | s16_dpn train step (ms) | stem overhead, direct "
             "| s16 train step (ms) | overhead, end to end | step noise (IQR/median) |",
             "|---|---|---|---|---|---|---|"]
    for backend, result in results.items():
        if "error" in result:
            lines.append(failure_row(backend, result, 7))
            continue
        extra = result["stem|dual_patchnorm"] - result["stem|patch"]
        dpn, plain = result["train|dual_patchnorm"], result["train|patch"]
        noise = max(np.subtract(*np.percentile(result[f"train|{s}|runs"], [75, 25])) / result[f"train|{s}"]
                    for s in ("patch", "dual_patchnorm"))
        lines.append(f"| {backend} | {extra * 1e3:.1f} | {dpn * 1e3:.0f} | {extra / dpn:.2%} | {plain * 1e3:.0f} "
                     f"| {(dpn - plain) / plain:+.2%} | {noise:.1%} |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--part", nargs="+", default=["norms", "stem"], choices=("norms", "stem"))
    parser.add_argument("--backends", nargs="+", default=list(KERAS_BACKENDS), choices=KERAS_BACKENDS)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="calls per timed run (micro-benchmarks)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls after compilation")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs; the median is reported")
    parser.add_argument("--step-repeats", type=int, default=6,
                        help="alternating timed training steps per model (part stem)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--worker", choices=("norms", "stem"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_positive_ints(parser, args, ("batch_size", "steps", "repeats", "step_repeats", "threads"))
    if args.warmup < 0:
        parser.error(f"--warmup must be 0 or more, got {args.warmup}")
    if args.worker:
        results = worker_norms(args) if args.worker == "norms" else worker_stem(args)
        print("RESULT " + json.dumps(results))
        return 0
    report, output = {}, []
    header = f"batch {args.batch_size}, float32, {args.threads} threads, median of {args.repeats} runs"
    for part in args.part:
        report[part] = {}
        for backend in args.backends:
            print(f"timing {part} on {backend} ...", file=sys.stderr, flush=True)
            report[part][backend] = spawn(args, part, backend)
        table = norms_table(report[part]) if part == "norms" else stem_table(report[part])
        output += [f"## {part} ({header})", "", *table, ""]
    print("\n".join(output))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "results": report}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
