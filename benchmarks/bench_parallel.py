"""Several study runs at once against one run with every thread: training throughput.

    python benchmarks/bench_parallel.py --processes 2 --mixed-precision mixed_bfloat16

What `keras-vitnorm ablate --parallel N` relies on. Per backend and round, first one
worker with N threads times training steps (`train_on_batch`: forward, backward, AdamW)
of the study's ViT (`bench_variants.py --model study`); then N workers with one thread
each time the same steps at the same moment (they wait for each other after warm-up).
Throughput is images per second, summed over the workers; the ratio is the N workers'
throughput over the single worker's in the same round, median and range over rounds.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _common import add_host_memory_argument
from _common import apply_host_memory
from _common import check_positive_ints
from _common import compile_like_fit
from _common import synthetic_batch
from _common import timed
from _common import wait_at_barrier
from _common import worker_result
from bench_variants import MODELS

from keras_vitnorm.study.workers import thread_environment

KERAS_BACKENDS = ("jax", "tensorflow", "torch")


def worker(args):
    apply_host_memory(args.host_memory)  # as the workers of `ablate --parallel` do
    import keras

    from keras_vitnorm import ViT

    keras.config.set_dtype_policy(args.mixed_precision)
    config = MODELS[args.model]
    x, y = synthetic_batch(config, args.batch_size)
    keras.utils.set_random_seed(0)
    model = compile_like_fit(ViT(**config))
    for _ in range(args.warmup):
        model.train_on_batch(x, y)
    if args.barrier:  # every worker of a round starts timing together
        wait_at_barrier(args.barrier, args.barrier_count)
    seconds = timed(lambda: model.train_on_batch(x, y), args.steps)["step_s"]
    return {"images_per_second": args.batch_size / seconds}


def _start(arguments, backend, threads, barrier=None, count=1):
    extra = ["--barrier", barrier, "--barrier-count", str(count)] if barrier else []
    command = [sys.executable, os.path.abspath(__file__), "--worker", *arguments,
               "--threads", str(threads), *extra]
    # The environment `ablate --parallel` gives its workers, on the CPU.
    env = dict(thread_environment(threads), KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2",
               CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _result(process):
    out, err = process.communicate()
    result = worker_result(out)
    if process.returncode or result is None:
        raise RuntimeError(" | ".join((err or out).strip().splitlines()[-5:]))
    return result["images_per_second"]


def measure(backend, arguments, processes, rounds):
    """`{"single": [img/s per round], "parallel": [summed img/s per round]}`."""
    single, parallel = [], []
    for _ in range(rounds):
        single.append(_result(_start(arguments, backend, processes)))
        with tempfile.TemporaryDirectory() as barrier:
            children = [_start(arguments, backend, 1, barrier, processes) for _ in range(processes)]
            parallel.append(sum(_result(child) for child in children))
    return {"single": single, "parallel": parallel}


def markdown(results, args):
    lines = [
        f"Training throughput of the {args.model} model, batch {args.batch_size}, "
        f"{args.mixed_precision}: one process with {args.processes} threads against "
        f"{args.processes} processes with 1 thread each ({args.rounds} rounds of {args.steps} "
        f"steps; median, range of the ratio over rounds; host memory: {args.host_memory}).",
        "",
        f"| backend | 1 process x {args.processes} threads (img/s) "
        f"| {args.processes} processes x 1 thread (img/s, summed) | ratio |",
        "|---|---|---|---|",
    ]
    for backend, result in results.items():
        if "error" in result:
            lines.append(f"| {backend} | failed: {result['error'][:120]} | | |")
            continue
        ratios = [p / s for p, s in zip(result["parallel"], result["single"])]
        lines.append(
            f"| {backend} | {statistics.median(result['single']):.0f} "
            f"| {statistics.median(result['parallel']):.0f} "
            f"| {statistics.median(ratios):.2f} ({min(ratios):.2f} to {max(ratios):.2f}) |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="study")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--backends", nargs="+", choices=KERAS_BACKENDS, default=list(KERAS_BACKENDS))
    parser.add_argument("--mixed-precision", default="float32",
                        choices=("float32", "mixed_bfloat16", "mixed_float16"))
    add_host_memory_argument(parser, "retain (default): every worker calls keras_vitnorm."
                                     "host_memory.retain_freed_memory() first, as the workers "
                                     "of `ablate --parallel` do; default: glibc's own settings")
    parser.add_argument("--json", help="write the per-round throughputs to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--barrier", help=argparse.SUPPRESS)
    parser.add_argument("--barrier-count", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_positive_ints(parser, args, ("batch_size", "processes", "rounds", "steps"))
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    arguments = ["--model", args.model, "--batch-size", str(args.batch_size), "--steps",
                 str(args.steps), "--warmup", str(args.warmup), "--mixed-precision",
                 args.mixed_precision, "--host-memory", args.host_memory]
    results = {}
    for backend in args.backends:
        print(f"{backend}: {args.rounds} rounds ...", file=sys.stderr, flush=True)
        try:
            results[backend] = measure(backend, arguments, args.processes, args.rounds)
        except RuntimeError as error:
            results[backend] = {"error": str(error)}
    print(markdown(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arguments": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
