"""Training-step time of each block norm and stem, as a ratio to pre-LN LayerNorm.

    python benchmarks/bench_variants.py --model s16 --batch-size 8
    python benchmarks/bench_variants.py --model study --batch-size 128
    python benchmarks/bench_variants.py --model s16 --batch-size 128 --device gpu --backends jax torch

Every variant changes one thing against the baseline (pre-LN LayerNorm blocks, plain
patch stem): the block norm (`rmsnorm`, `dyt`, `batchnorm`) or the stem
(`dual_patchnorm`, `conv`). Per backend, one process builds every variant's model,
compiles it as `fit` does and warms it up; then rounds time one training step
(`train_on_batch`: forward, backward, AdamW update) of each model in turn, in a
rotating order, seconds apart. A variant's ratio is the median over rounds of its
step time divided by the baseline's step time in the same round, with the range over
rounds; so drift of the machine between rounds cancels.

`--model s16` is ViT-S/16 at 224 px; `--model study` the converged CIFAR-10 study's
ViT (32 px, patch 4, width 128, depth 6, 4 heads, MLP 512). With `--device gpu` the
models and the batch are on the GPU (no step times a host-to-device copy); the
default `cpu` hides any GPU from the workers. Results are printed as a markdown table
and, with `--json`, written to a file.
"""

import argparse
import json
import statistics
import sys
import time

from _common import batch_on
from _common import check_positive_ints
from _common import compile_like_fit
from _common import require_keras_device
from _common import run_worker
from _common import synthetic_batch

KERAS_BACKENDS = ("jax", "tensorflow", "torch")
MODELS = {
    "s16": dict(image_size=224, patch_size=16, width=384, depth=12, num_heads=6, mlp_dim=1536,
                num_classes=1000),
    "study": dict(image_size=32, patch_size=4, width=128, depth=6, num_heads=4, mlp_dim=512,
                  num_classes=10),
}
#: variant -> ViT config changes against the baseline (first).
VARIANTS = {
    "layernorm (baseline)": {},
    "rmsnorm": {"norm": "rmsnorm"},
    "dyt": {"norm": "dyt"},
    "batchnorm": {"norm": "batchnorm"},
    "dual_patchnorm stem": {"stem": "dual_patchnorm"},
    "conv stem": {"stem": "conv"},
}


def worker(args):
    import keras

    from keras_vitnorm import ViT

    require_keras_device(args.device)
    keras.config.set_dtype_policy(args.mixed_precision)
    config = MODELS[args.model]
    x, y = synthetic_batch(config, args.batch_size)
    x, y = batch_on(args.device, x, y)
    steps = {}
    for name, change in VARIANTS.items():
        keras.utils.set_random_seed(0)
        model = compile_like_fit(ViT(**config, **change))
        for _ in range(args.warmup):
            model.train_on_batch(x, y)
        steps[name] = model
    names = list(VARIANTS)
    rounds = {name: [] for name in names}
    for index in range(args.rounds):
        order = names[index % len(names):] + names[:index % len(names)]
        for name in order:
            start = time.perf_counter()
            for _ in range(args.steps):
                steps[name].train_on_batch(x, y)
            rounds[name].append((time.perf_counter() - start) / args.steps)
    return {"seconds": rounds}


def summarize(result):
    """`{variant: (median ratio, low, high, median seconds)}` from per-round seconds."""
    seconds = result["seconds"]
    baseline = seconds[next(iter(VARIANTS))]
    table = {}
    for name, times in seconds.items():
        ratios = [t / b for t, b in zip(times, baseline)]
        table[name] = (statistics.median(ratios), min(ratios), max(ratios), statistics.median(times))
    return table


def markdown(results, args):
    backends = list(results)
    where = "GPU" if args.device == "gpu" else "CPU"
    lines = [
        f"Training-step time against pre-LN LayerNorm: {args.model}, {where}, batch {args.batch_size}, "
        f"{args.mixed_precision}, {args.rounds} rounds of {args.steps} steps (median ratio, range "
        "over rounds; baseline seconds per step in the first row).",
        "",
        "| variant | " + " | ".join(backends) + " |",
        "|---|" + "---|" * len(backends),
    ]
    summaries = {b: summarize(r) for b, r in results.items() if "error" not in r}
    for name in VARIANTS:
        cells = []
        for backend in backends:
            if backend not in summaries:
                cells.append(f"failed: {results[backend]['error'][:80]}")
                continue
            ratio, low, high, seconds = summaries[backend][name]
            cells.append(f"{seconds:.3f} s" if name == next(iter(VARIANTS))
                         else f"{ratio:.3f} ({low:.3f} to {high:.3f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="s16")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backends", nargs="+", choices=KERAS_BACKENDS, default=list(KERAS_BACKENDS))
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"),
                        help="where the models and the batch live (cpu hides any GPU from the workers)")
    parser.add_argument("--mixed-precision", default="float32",
                        choices=("float32", "mixed_bfloat16", "mixed_float16"))
    parser.add_argument("--json", help="write the per-round seconds to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_positive_ints(parser, args, ("batch_size", "rounds", "steps", "threads"))
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    arguments = ["--model", args.model, "--batch-size", str(args.batch_size), "--rounds",
                 str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup),
                 "--mixed-precision", args.mixed_precision, "--device", args.device]
    results = {}
    for backend in args.backends:
        print(f"{backend}: timing {len(VARIANTS)} variants ...", file=sys.stderr, flush=True)
        results[backend] = run_worker(__file__, arguments, backend, args.threads, args.device)
    print(markdown(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arguments": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
