"""Training and inference speed and training memory of each norm, placement and stem.

    python benchmarks/bench_variants.py --model s16 --batch-size 8
    python benchmarks/bench_variants.py --model b16 --batch-size 4 --measure train memory
    python benchmarks/bench_variants.py --model s16 --batch-size 128 --device gpu \
        --backends jax torch

Every figure is a ratio to the baseline `pre_ln` (pre-LN LayerNorm blocks, plain patch
stem). The variants are the study's `core` group, so that these figures and the
studies' time to accuracy describe the same models; each changes one thing: the
placement (`post_ln`, `peri_ln`, `deepnorm`), the block norm (`rmsnorm`, `dyt`,
`batchnorm`) or the stem (`dual_patchnorm`, `conv_stem`).

`--measure train inference` (the default): per backend, one process builds, compiles
(as `fit` does) and warms up every variant; each round then times `--steps` training
steps (`train_on_batch`) and inference steps (`predict_on_batch`) of every variant in
a rotating order. A variant's ratio is the median over rounds of its step time over
the baseline's in the same round, with the range, so drift of the machine cancels.

`--measure memory`: per backend and variant, a fresh process builds only that
variant and trains `--warmup` + 1 steps, after a one-block model of the same variant
(so that what the libraries load on first use is not counted); its peak memory above
what it held before is the variant's (`_memory.peak_memory`: the device allocator's
peak on a GPU, the peak resident memory on a CPU). `--memory-repeats` processes per
variant, `--memory-parallel` at a time (memory is not timed).

`--model s16` and `b16` are ViT-S/16 and B/16 at 224 px, `study` the converged
study's ViT (32 px, patch 4, width 128, depth 6), `imagenette_cpu` the Imagenette CPU
study's Ti/16 at 112 px. With `--device gpu` the models and the batch are on the GPU;
`cpu` hides any GPU. `--json` writes every round's and process's figure
(`tools/efficiency_table.py` combines such files into one table).
"""
import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

from _common import add_host_memory_argument
from _common import apply_host_memory
from _common import batch_on
from _common import check_positive_ints
from _common import compile_like_fit
from _common import require_keras_device
from _common import run_worker
from _common import synthetic_batch
from _common import timed
from _memory import peak_memory

KERAS_BACKENDS = ("jax", "tensorflow", "torch")
MODELS = {
    "s16": dict(image_size=224, patch_size=16, width=384, depth=12, num_heads=6, mlp_dim=1536,
                num_classes=1000),
    "b16": dict(image_size=224, patch_size=16, width=768, depth=12, num_heads=12, mlp_dim=3072,
                num_classes=1000),
    "study": dict(image_size=32, patch_size=4, width=128, depth=6, num_heads=4, mlp_dim=512,
                  num_classes=10),
    # the Imagenette CPU study's (recipes/imagenette_study.sh, `cpu`): Ti/16 at 112 px
    "imagenette_cpu": dict(image_size=112, patch_size=16, width=192, depth=12, num_heads=3,
                           mlp_dim=768, num_classes=10),
}
#: variant -> ViT config changes against the baseline (first): the model changes of the
#: study's `core` group (the `converged` group's and Peri-LN), written out so that this
#: parent process imports no Keras.
VARIANTS = {
    "pre_ln": {},
    "dual_patchnorm": {"stem": "dual_patchnorm"},
    "post_ln": {"attn_norm": "post", "mlp_norm": "post"},
    "peri_ln": {"attn_norm": "pre_post", "mlp_norm": "pre_post"},
    "deepnorm": {"block_style": "deepnorm"},
    "conv_stem": {"stem": "conv"},
    "rmsnorm": {"norm": "rmsnorm"},
    "dyt": {"norm": "dyt"},
    "batchnorm": {"norm": "batchnorm"},
}
BASELINE = next(iter(VARIANTS))
#: `--measure` of each timed step -> (its key in the results, its name in the tables).
TIMED = {"train": ("seconds", "Training-step"),
         "inference": ("inference_seconds", "Inference-step")}
MEASURES = (*TIMED, "memory")
#: JAX reserves most of a GPU's memory at start unless told not to; memory processes
#: may share the GPU, and its allocator's peak counts what is used, not what is reserved.
MEMORY_GPU_SETTING = "shared"


def chosen_variants(names):
    """The variants to measure, in `VARIANTS` order, the baseline always among them."""
    wanted = set(names or VARIANTS) | {BASELINE}
    return [name for name in VARIANTS if name in wanted]


def prepare(args):
    """Sets the process up as every worker needs; returns `(config, x, y)`."""
    import keras

    apply_host_memory(args.host_memory)
    require_keras_device(args.device)
    keras.config.set_dtype_policy(args.mixed_precision)
    config = MODELS[args.model]
    x, y = batch_on(args.device, *synthetic_batch(config, args.batch_size))
    return config, x, y


def build(config, name):
    """The variant's ViT, seeded and compiled as every benchmark times it."""
    import keras

    from keras_vitnorm import ViT

    keras.utils.set_random_seed(0)
    return compile_like_fit(ViT(**config, **VARIANTS[name]))


def worker(args):
    """Per-round seconds per training and per inference step of every variant, in one process."""
    config, x, y = prepare(args)
    names = chosen_variants(args.variants)
    keys = [TIMED[mode][0] for mode in TIMED if mode in args.measure]
    calls = {}
    for name in names:
        model = build(config, name)
        steps = {"seconds": lambda model=model: model.train_on_batch(x, y),
                 "inference_seconds": lambda model=model: model.predict_on_batch(x)}
        calls[name] = {key: steps[key] for key in keys}
        for _ in range(args.warmup):
            for call in calls[name].values():
                call()
    result = {key: {name: [] for name in names} for key in keys}
    for index in range(args.rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            for key, call in calls[name].items():
                result[key][name].append(timed(call, args.steps)["step_s"])
    return result


#: A one-block ViT trained before the measured one, so that the libraries' own first-use
#: memory (modules loaded on first call, thread pools, kernel caches) is not counted.
WARM_UP_MODEL = dict(image_size=16, patch_size=4, width=32, depth=1, num_heads=2, mlp_dim=64,
                     num_classes=10)


def memory_worker(args):
    """`{"bytes", "what"}`: the peak memory of building and training one variant."""
    config, x, y = prepare(args)
    small_x, small_y = batch_on(args.device, *synthetic_batch(WARM_UP_MODEL, 2))
    build(WARM_UP_MODEL, args.memory_of).train_on_batch(small_x, small_y)

    def train():
        model = build(config, args.memory_of)
        for _ in range(args.warmup + 1):
            model.train_on_batch(x, y)

    peak, what = peak_memory(train, args.device)
    return {"bytes": peak, "what": what}


def measure_memory(args, backend, arguments):
    """`{"peak_bytes": {variant: [bytes per process]}, "memory": what}` for one backend,
    with `"memory_errors": {variant: message}` for the processes that failed."""
    jobs = [name for _ in range(args.memory_repeats) for name in chosen_variants(args.variants)]

    def one(name):
        return name, run_worker(__file__, arguments + ["--memory-of", name], backend,
                                args.threads, args.device, gpu_memory=MEMORY_GPU_SETTING)

    result = {"peak_bytes": {name: [] for name in chosen_variants(args.variants)}, "memory": None}
    with ThreadPoolExecutor(args.memory_parallel) as pool:
        for name, found in pool.map(one, jobs):
            if "error" in found:
                result.setdefault("memory_errors", {})[name] = found["error"]
                continue
            result["peak_bytes"][name].append(found["bytes"])
            result["memory"] = found["what"]
    result["peak_bytes"] = {name: peaks for name, peaks in result["peak_bytes"].items() if peaks}
    return result


def summarize(result, key="seconds"):
    """`{variant: (median ratio, low, high, median seconds)}` from per-round seconds."""
    seconds = result[key]
    baseline = seconds[BASELINE]
    table = {}
    for name, times in seconds.items():
        ratios = [t / b for t, b in zip(times, baseline)]
        table[name] = (statistics.median(ratios), min(ratios), max(ratios),
                       statistics.median(times))
    return table


def _header(backends):
    return ["", "| variant | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]


def time_table(results, args, mode):
    """One timed step's markdown table: the baseline's seconds, each variant's ratio."""
    key, title = TIMED[mode]
    backends = list(results)
    where = "GPU" if args.device == "gpu" else "CPU"
    lines = [f"{title} time against pre-LN LayerNorm: {args.model}, {where}, batch "
             f"{args.batch_size}, {args.mixed_precision}, {args.rounds} rounds of {args.steps} "
             "steps (median ratio, range over rounds; baseline seconds per step in the first row).",
             *_header(backends)]
    summaries = {b: summarize(r, key) for b, r in results.items() if key in r}
    for name in chosen_variants(args.variants):
        cells = []
        for backend in backends:
            if backend not in summaries:
                cells.append(f"failed: {results[backend].get('error', 'no result')[:80]}")
                continue
            ratio, low, high, seconds = summaries[backend][name]
            cells.append(f"{seconds:.3f} s" if name == BASELINE
                         else f"{ratio:.3f} ({low:.3f} to {high:.3f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_table(results, args):
    """Peak training memory per variant (MiB, median over processes) and its ratio to the
    baseline's."""
    backends = list(results)
    what = "; ".join(dict.fromkeys(r["memory"] for r in results.values() if r.get("memory")))
    lines = [f"Peak memory of building and training one variant ({what or 'not measured'}) "
             f"above the process's before: {args.model}, batch {args.batch_size}, "
             f"{args.mixed_precision}, median over {args.memory_repeats} process(es) per variant.",
             *_header(backends)]
    for name in chosen_variants(args.variants):
        cells = []
        for backend in backends:
            peaks = results[backend].get("peak_bytes", {})
            if name not in peaks or BASELINE not in peaks:
                error = results[backend].get("memory_errors", {}).get(name, "no result")
                cells.append(f"failed: {error[:80]}")
                continue
            mib = statistics.median(peaks[name]) / 2 ** 20
            ratio = statistics.median(peaks[name]) / statistics.median(peaks[BASELINE])
            cells.append(f"{mib:,.0f} MiB" + ("" if name == BASELINE else f" ({ratio:.3f})"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(results, args):
    """The tables of what was measured: training and inference time, peak memory."""
    tables = [time_table(results, args, mode) for mode in TIMED if mode in args.measure]
    if "memory" in args.measure:
        tables.append(memory_table(results, args))
    return "\n\n".join(tables)


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="s16")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backends", nargs="+", choices=KERAS_BACKENDS,
                        default=list(KERAS_BACKENDS))
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS),
                        help=f"the variants to measure (default: all; {BASELINE} always)")
    parser.add_argument("--measure", nargs="+", choices=MEASURES, default=list(TIMED),
                        help="train, inference: the time of that step in rotating rounds; "
                             "memory: peak training memory, one process per variant")
    parser.add_argument("--memory-repeats", type=int, default=1,
                        help="processes per variant for --measure memory")
    parser.add_argument("--memory-parallel", type=int, default=1,
                        help="memory processes at a time")
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"),
                        help="where the models and the batch live "
                             "(cpu hides any GPU from the workers)")
    parser.add_argument("--mixed-precision", default="float32",
                        choices=("float32", "mixed_bfloat16", "mixed_float16"))
    add_host_memory_argument(parser, "allocator setting of every worker (as training has it)")
    parser.add_argument("--json", help="write every round's and process's figures to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-of", choices=tuple(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_positive_ints(parser, args, ("batch_size", "rounds", "steps", "threads",
                                       "memory_repeats", "memory_parallel"))
    if args.warmup < 0:
        parser.error(f"--warmup must be 0 or more, got {args.warmup}")
    return args


def main(argv=None):
    args = parse_arguments(argv)
    if args.worker:
        result = memory_worker(args) if args.memory_of else worker(args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    arguments = ["--model", args.model, "--batch-size", str(args.batch_size), "--rounds",
                 str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup),
                 "--mixed-precision", args.mixed_precision, "--device", args.device,
                 "--host-memory", args.host_memory, "--measure", *args.measure,
                 "--variants", *chosen_variants(args.variants)]
    results = {}
    for backend in args.backends:
        results[backend] = {}
        if set(TIMED) & set(args.measure):
            print(f"{backend}: timing {len(chosen_variants(args.variants))} variants ...",
                  file=sys.stderr, flush=True)
            results[backend].update(run_worker(__file__, arguments, backend, args.threads,
                                               args.device))
        if "memory" in args.measure:
            print(f"{backend}: peak memory, one process per variant ...", file=sys.stderr,
                  flush=True)
            results[backend].update(measure_memory(args, backend, arguments))
    print(markdown(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arguments": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
