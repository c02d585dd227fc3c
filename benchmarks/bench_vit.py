"""Throughput of keras_vitnorm's ViT on every Keras backend, side by side with the
reference PyTorch ViT (Hugging Face transformers, eager), timm's ViT and keras-hub's ViT.

    python benchmarks/bench_vit.py --preset s16 --batch-size 16 --interleave --rounds 10 \
        --steps 2 --repeats 1                                   # docs/performance.md's CPU table
    python benchmarks/bench_vit.py --preset b16 --batch-size 64 --mixed-precision mixed_bfloat16
    python benchmarks/bench_vit.py --device gpu --preset b16 --batch-size 256 \
        --mixed-precision mixed_bfloat16 --backends jax torch --timm eager compiled \
        --interleave --rounds 3
    python benchmarks/bench_vit.py --no-reference --backends torch --other-forms linear \
        --interleave --rounds 5 --steps 2 --repeats 1

Each implementation runs in its own subprocess with the same thread count. Keras
models run through `predict_on_batch` and `train_on_batch` (the compiled functions of
`predict` and `fit`; AdamW, cross-entropy), the reference and timm as PyTorch users
run them (`model(x)` under `inference_mode`; forward, backward, `AdamW.step()`;
`--timm compiled` under `torch.compile`; timm needs torchvision, and its rows say
where it does not import). Per implementation and mode the table gives:

- images/s: the median of `--repeats` runs of `--steps` steps after `--warmup`
  steps; the first call (tracing, compilation) is the "compile" column;
- the ratio to the reference. With `--rounds N` every implementation runs N times
  in turn (a fresh process each); the ratio is the median of the per-round ratios,
  with their range, so a drifting machine slows both alike. `--interleave` starts
  each process once (one at a time, so compilations do not compete) and each round
  times every implementation in turn, in a rotating order: rounds seconds apart;
- with `--other-forms`, keras_vitnorm on each backend with a fast path of
  `keras_vitnorm.ops` switched off (`linear`, `split_qkv`, `attention`,
  `residual_fence`; where it does not apply, the same code), or `tf_xla`, TensorFlow
  compiled with XLA; its ratio is the library form's step time over its own, round
  by round: what a fast path must bring below 0.95;
- model FLOP utilization: the analytic FLOPs (`model_flops`) per second over the
  machine's float32 matmul rate (the best of NumPy, PyTorch and each backend's
  library); with `--device gpu`, over PyTorch's CUDA matmul rate in the compute
  dtype, and over the datasheet's dense bfloat16 peak (`DATASHEET_BF16_TFLOPS`);
- peak memory (`_memory.WorkerMemory`): on a GPU the device memory the framework's
  allocator held, on the CPU the worker's peak resident memory. Each
  implementation's largest training batch is tools/gpu/largest_batch.py's;
- page faults and kernel time per step: every process, the reference's too, first
  calls `keras_vitnorm.host_memory.retain_freed_memory()` unless `--host-memory
  default`.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np
from _common import add_host_memory_argument
from _common import apply_host_memory
from _common import check_positive_ints
from _common import failure_row
from _common import keras_steps
from _common import reference_steps
from _common import run_worker
from _common import timed
from _common import timm_steps
from _common import worker_env
from _memory import WorkerMemory

KERAS_BACKENDS = ("jax", "tensorflow", "torch")


def model_flops(width, depth, mlp_dim, patch_size, image_size, channels, num_classes, tokens_extra=1):
    """Forward FLOPs per image (2 per multiply-add; norms, softmax and GELU left out)."""
    patches = (image_size // patch_size) ** 2
    tokens = patches + tokens_extra
    embed = patches * patch_size * patch_size * channels * width
    per_block = tokens * (3 * width * width + width * width + 2 * width * mlp_dim) + 2 * tokens * tokens * width
    return 2 * (embed + depth * per_block + width * num_classes)


#: How each Keras backend's library runs one float32 `m @ m` to completion, for `matmul_rate`.
_BACKEND_MATMUL = {
    "jax": "import jax, jax.numpy as jnp\n"
           "product = jax.jit(lambda m: m @ m)\n"
           "run = lambda m: product(m).block_until_ready()\n"
           "matrix = jnp.asarray(matrix)\n",
    "tensorflow": "import tensorflow as tf\n"
                  "run = lambda m: tf.linalg.matmul(m, m)\n"
                  "matrix = tf.constant(matrix)\n",
}


def _rate(run, matrix, size, repeats):
    """Best GFLOP/s of `run(matrix)`, one `size x size` matmul, over `repeats` timed calls after a warm-up."""
    return 2 * size**3 / min(timed(lambda: run(matrix), 1, repeats, warmup=1)["runs"]) / 1e9


def matmul_rate(threads, backends=(), size=2048, repeats=5):
    """`(best, {library: GFLOP/s})`: float32 `size x size` matmul rates on the CPU.

    NumPy and PyTorch (if present) are timed here, with PyTorch at `threads`
    threads; each of `backends` other than `torch` (JAX, TensorFlow) in a child
    process with its benchmark worker's environment. The libraries' CPU matmul
    kernels differ (docs/performance.md lists them for its host), so the machine's
    rate is the best of them: a model cannot use more, whichever library runs it.
    A library that fails to run is left out.
    """
    matrix = np.random.default_rng(0).standard_normal((size, size)).astype("float32")
    rates = {"numpy": _rate(lambda m: m @ m, matrix, size, repeats)}
    try:
        import torch

        torch.set_num_threads(threads)
        rates["torch"] = _rate(lambda m: m @ m, torch.from_numpy(matrix), size, repeats)
    except ImportError:
        pass
    for backend in backends:
        if backend not in _BACKEND_MATMUL:
            continue
        code = ("import numpy as np, sys\nsys.path.insert(0, %r)\nfrom bench_vit import _rate\n"
                "matrix = np.random.default_rng(0).standard_normal((%d, %d)).astype('float32')\n%s"
                "print('RATE', _rate(run, matrix, %d, %d))\n"
                % (os.path.dirname(os.path.abspath(__file__)), size, size, _BACKEND_MATMUL[backend], size, repeats))
        done = subprocess.run([sys.executable, "-c", code], env=worker_env(backend, threads),
                              capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RATE ")]
        if done.returncode == 0 and lines:
            rates[backend] = float(lines[-1].split()[1])
    return max(rates.values()), rates


def gpu_matmul_rate(dtype, size=8192, repeats=10):
    """GFLOP/s of a size x size matmul on the GPU through PyTorch (CUDA), in `dtype`.

    float32 is timed as PyTorch runs it by default: true float32, no TF32.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("PyTorch sees no CUDA GPU on this machine")
    a = torch.randn(size, size, device="cuda", dtype=getattr(torch, dtype))
    seconds = timed(lambda m=a: m @ m, repeats, warmup=3, wait=torch.cuda.synchronize)["step_s"]
    del a
    torch.cuda.empty_cache()  # the workers get the GPU's memory
    return 2 * size**3 / seconds / 1e9


#: Dense (no sparsity) bfloat16 tensor-core peaks in TFLOP/s, from NVIDIA's H100 and H200
#: datasheets (which give twice these, "with sparsity"), by a part of the name PyTorch
#: reports for the GPU; the first match counts.
DATASHEET_BF16_TFLOPS = (("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0),
                         ("H200 NVL", 835.0), ("H200", 989.0))


def datasheet_tflops(gpu_name, dtype):
    """The datasheet's dense peak of `gpu_name` in `dtype` ("bfloat16"), or None if not listed."""
    if dtype != "bfloat16":
        return None
    return next((tflops for part, tflops in DATASHEET_BF16_TFLOPS if part in gpu_name), None)


#: What `--implementation` names: Keras models, the transformers reference, timm eager
#: and under `torch.compile`.
IMPLEMENTATIONS = ("keras", "keras_hub", "reference", "timm", "timm_compiled")
#: The fast paths of the model's step (`keras_vitnorm.ops.FAST_PATHS` less the input
#: pipelines'), each an `--other-forms` form with it off, and XLA for TensorFlow.
MODEL_FAST_PATHS = ("linear", "split_qkv", "attention", "residual_fence")
OTHER_FORMS = (*MODEL_FAST_PATHS, "tf_xla")


def apply_form(form):
    """Puts this worker's library in `form` (an `OTHER_FORMS` name, or None for the
    library's own); returns the `jit_compile` its models compile with."""
    if form == "tf_xla":
        return True
    if form is not None:
        from keras_vitnorm import ops

        ops.set_fast_paths(False, [form])
    return "auto"


def form_label(backend, form):
    """The table's label of keras_vitnorm in `form` on `backend`."""
    return f"keras_vitnorm ({backend}), " + ("XLA" if form == "tf_xla" else f"{form} off")


def worker_main(args):
    # before the first computation, for every implementation alike
    apply_host_memory(args.host_memory)
    from keras_vitnorm.models.presets import preset_config

    config = {**preset_config(args.preset), "image_size": args.image_size, **json.loads(args.overrides)}
    config.setdefault("num_classes", 1000)
    if args.implementation in ("keras", "keras_hub"):
        steps = keras_steps(config, args.batch_size, args.modes, args.device, args.mixed_precision,
                            args.implementation, jit_compile=apply_form(args.form))
        import keras

        framework = keras.backend.backend()
    elif args.implementation == "reference":
        steps = reference_steps(config, args.batch_size, args.modes, args.threads, args.device,
                                args.mixed_precision)
        framework = "torch"
    else:
        steps = timm_steps(config, args.batch_size, args.modes, args.threads, args.device,
                           args.mixed_precision, compiled=args.implementation == "timm_compiled")
        framework = "torch"
    memory = WorkerMemory(framework, args.device)
    if args.serve:
        return serve(steps, args.warmup, args.steps, args.repeats, sys.stdin, sys.stdout, memory)
    results = {mode: timed(step, args.steps, args.repeats, args.warmup, first_call=True,
                           memory=memory) for mode, step in steps.items()}
    print("RESULT " + json.dumps(results))


def serve(steps, warmup, count, repeats, requests, replies, memory=None):
    """The worker's side of `--interleave`: compile and warm up every mode, print `READY
    {mode: {"compile_s", "peak_bytes", "capacity_bytes"}}`, then answer each line `<mode>`
    of `requests` with `TIMED {"step_s", "faults", "kernel_s"}` (one untimed step, as the
    process may have sat idle, then `repeats` runs of `count` steps) until `quit`. After
    each reply it releases what `memory` can (`WorkerMemory.release`) for the others."""
    ready = {}
    for mode, step in steps.items():
        timing = timed(step, warmup=warmup, first_call=True, memory=memory)  # and one timed step
        ready[mode] = {key: timing[key] for key in ("compile_s", "peak_bytes", "capacity_bytes")
                       if key in timing}
    print("READY " + json.dumps(ready), file=replies, flush=True)
    release = memory.release if memory is not None else (lambda: None)
    release()
    for line in requests:
        mode = line.strip()
        if mode == "quit":
            break
        if mode not in steps:
            print("ERROR " + json.dumps(f"unknown mode {mode!r}; valid: {', '.join(steps)}"), file=replies,
                  flush=True)
            continue
        timing = timed(steps[mode], count, repeats, warmup=1)
        print("TIMED " + json.dumps({key: timing[key] for key in ("step_s", "faults", "kernel_s")}),
              file=replies, flush=True)
        release()
    return 0


def combine_rounds(measured):
    """One result from several rounds: the median step time, the first round's compile time
    and capacity, and the largest peak memory.

    A round that failed makes the whole result the first failure.
    """
    failed = [result for result in measured if "error" in result]
    if failed:
        return failed[0]
    combined = {}
    for mode in measured[0]:
        combined[mode] = {
            "compile_s": measured[0][mode]["compile_s"],
            "step_s": statistics.median(result[mode]["step_s"] for result in measured),
            "round_step_s": [result[mode]["step_s"] for result in measured],
            "faults": statistics.median(result[mode]["faults"] for result in measured),
            "kernel_s": statistics.median(result[mode]["kernel_s"] for result in measured)}
        if "peak_bytes" in measured[0][mode]:
            combined[mode]["peak_bytes"] = max(result[mode]["peak_bytes"] for result in measured)
            combined[mode]["capacity_bytes"] = measured[0][mode].get("capacity_bytes")
    return combined


def ratio_to_reference(timing, reference):
    """The "vs PyTorch reference" cell: throughput over the reference's, paired round by round.

    With several rounds, each round's ratio compares the two implementations
    timed next to each other, so drift of the machine between rounds cancels;
    the cell gives the median of those ratios and their range. With one round
    it is the ratio of the two step times.
    """
    if not reference:
        return "n/a"
    ours = timing.get("round_step_s", [timing["step_s"]])
    theirs = reference.get("round_step_s", [reference["step_s"]])
    if len(ours) != len(theirs) or len(ours) == 1:
        return f"{reference['step_s'] / timing['step_s']:.2f}x"
    ratios = [t / o for o, t in zip(ours, theirs)]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f} to {max(ratios):.2f})"


def worker_arguments(args, implementation):
    """A worker's arguments for `implementation` (`IMPLEMENTATIONS`, or "keras:FORM")."""
    implementation, _, form = implementation.partition(":")
    return ["--implementation", implementation, *(["--form", form] if form else []),
            "--preset", args.preset, "--image-size", str(args.image_size),
            "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--repeats", str(args.repeats),
            "--mixed-precision", args.mixed_precision, "--overrides", args.overrides,
            "--device", args.device, "--host-memory", args.host_memory, "--modes", *args.modes]


def spawn(args, implementation, backend):
    return run_worker(__file__, worker_arguments(args, implementation), backend, args.threads, args.device)


class Worker:
    """One implementation's worker process under `--interleave`: started once, timed on request.

    The workers share the machine while they live: on a GPU, JAX takes its memory
    as it needs it ("shared" in `_common.GPU_MEMORY_SETTINGS`) and PyTorch hands
    its cached blocks back after each reply (`WorkerMemory.release`).
    `ready` is the worker's `READY` reply: per mode, its compile time and memory.
    """

    def __init__(self, args, implementation, backend):
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--serve",
                   *worker_arguments(args, implementation), "--threads", str(args.threads)]
        self.log = tempfile.TemporaryFile("w+")  # stderr, read back if the worker fails
        env = worker_env(backend, args.threads, args.device, gpu_memory="shared")
        self.process = subprocess.Popen(command, env=env, text=True, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log)
        self.ready = self._reply("READY")

    def time(self, mode):
        """`{"step_s", "faults", "kernel_s"}` of one timing segment of `mode`."""
        self.process.stdin.write(mode + "\n")
        self.process.stdin.flush()
        return self._reply("TIMED")

    def _reply(self, tag):
        for line in self.process.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
            if line.startswith("ERROR "):
                raise RuntimeError(json.loads(line[len("ERROR "):]))
        self.process.wait()
        self.log.seek(0)
        tail = self.log.read().strip().splitlines()[-5:]
        raise RuntimeError(" | ".join(tail) or f"worker exited with code {self.process.returncode}")

    def close(self):
        if self.process.poll() is None:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.close()
            except BrokenPipeError:  # it ended meanwhile
                pass
            self.process.wait()
        self.log.close()


def interleaved(args, runs):
    """`{label: result}` as `combine_rounds` gives it, from workers kept running and timed in
    turn: they start (and compile) one at a time, then each round times one segment of
    every implementation per mode, in an order that rotates from round to round. A worker
    that fails, at its start or in a round, gets `{"error": ...}` and the others go on."""
    workers, results = {}, {}
    try:
        for label, backend, implementation in runs:
            print(f"starting {label} ...", file=sys.stderr, flush=True)
            try:
                workers[label] = Worker(args, implementation, backend)
            except RuntimeError as error:
                results[label] = {"error": str(error)}
        labels = list(workers)
        rounds = {label: [] for label in labels}
        for round_index in range(args.rounds):
            print(f"round {round_index + 1} of {args.rounds} ...", file=sys.stderr, flush=True)
            shift = round_index % max(len(labels), 1)
            order = labels[shift:] + labels[:shift]
            measured = {label: {} for label in labels}
            for mode in args.modes:
                for label in order:
                    if label in results:  # failed earlier in this round
                        continue
                    try:
                        measured[label][mode] = workers[label].time(mode)
                    except RuntimeError as error:
                        results[label] = {"error": str(error)}
            labels = [label for label in labels if label not in results]
            for label in labels:
                rounds[label].append({mode: {**timing, **workers[label].ready[mode]}
                                      for mode, timing in measured[label].items()})
        for label in labels:
            results[label] = combine_rounds(rounds[label])
    finally:
        for worker in workers.values():
            worker.close()
    return {label: results[label] for label, _, _ in runs if label in results}


def _gib(count):
    return "n/a" if count is None else f"{count / 2**30:.1f}"


def table(args, results, flops, peak, peak_sources, matmul_dtype, datasheet):
    """The markdown report: a header line, then one row per implementation and mode."""
    where = "GPU" if args.device == "gpu" else f"CPU, {args.threads} threads"
    memory = ("device memory its allocator held" if args.device == "gpu"
              else "the worker's resident host memory")
    header = (f"{args.preset} at {args.image_size}x{args.image_size}, batch {args.batch_size}, "
              f"{args.mixed_precision}, {where}; {flops / 1e9:.2f} GFLOPs/image forward "
              f"(x3 for a training step); measured {matmul_dtype} matmul rate {peak:.0f} GFLOP/s "
              f"(best of {', '.join(f'{name} {rate:.0f}' for name, rate in peak_sources.items())})"
              + (f"; datasheet peak {datasheet[1]:.0f} TFLOP/s ({datasheet[0]})"
                 if datasheet else "")
              + f"; peak memory: {memory}; host memory: {args.host_memory}")
    columns = ["implementation", "mode", "img/s", "vs PyTorch reference", "fraction of matmul peak"]
    columns += ["MFU (datasheet)"] if datasheet else []
    columns += ["compile (s)", "peak memory (GiB)", "page faults / step", "kernel s / step"]
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    reference = results.get("transformers ViT (PyTorch eager)", {})
    for label, result in results.items():
        if "error" in result:
            lines.append(failure_row(label, result, len(columns)))
            continue
        library = label.partition(", ")[0] if label.startswith("keras_vitnorm (") else None
        for mode, timing in result.items():
            rate = args.batch_size / timing["step_s"]
            flop_rate = rate * flops * (3 if mode == "train" else 1)
            if library and library != label:  # another form: against the library's
                ratio = ratio_to_reference(timing, results.get(library, {}).get(mode))
                ratio = f"{ratio} vs library form"
            else:
                ratio = ratio_to_reference(timing, reference.get(mode))
            cells = [label, mode, f"{rate:.1f}", ratio, f"{flop_rate / (peak * 1e9):.1%}"]
            cells += [f"{flop_rate / (datasheet[1] * 1e12):.1%}"] if datasheet else []
            cells += [f"{timing['compile_s']:.1f}", _gib(timing.get("peak_bytes")),
                      f"{timing['faults']:,.0f}", f"{timing['kernel_s']:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def argument_parser(description=None):
    """The parser of this script's options (and its workers'); tools/gpu/largest_batch.py adds
    its own to it."""
    parser = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--preset", default="s16", help="built-in plain or _dpn preset (default s16)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the first call")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs; the median is reported")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for every implementation")
    parser.add_argument("--backends", nargs="+", default=list(KERAS_BACKENDS), choices=KERAS_BACKENDS)
    parser.add_argument("--modes", nargs="+", default=["inference", "train"], choices=("inference", "train"))
    parser.add_argument("--mixed-precision", default="float32", choices=("float32", "mixed_bfloat16"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"),
                        help="cpu: every implementation on the CPU, GPUs hidden (default); gpu: every "
                             "implementation on the GPU, which each backend must see")
    parser.add_argument("--overrides", default="{}", help='JSON ViT overrides, e.g. \'{"norm": "rmsnorm"}\'')
    parser.add_argument("--no-reference", action="store_true", help="skip the transformers reference")
    parser.add_argument("--keras-hub", action="store_true", help="also time keras-hub's ViT (each backend)")
    parser.add_argument("--timm", nargs="+", default=[], choices=("eager", "compiled"),
                        help="also time timm's ViT of the same size (PyTorch, AdamW, as the "
                             "reference): eager, and/or its forward pass under torch.compile")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every implementation this many times in turn and report the median "
                             "across rounds, so drift of a shared machine hits all alike (default 1)")
    parser.add_argument("--interleave", action="store_true",
                        help="start every implementation once and keep it running; each of --rounds rounds "
                             "times --repeats runs of --steps steps of every implementation in turn")
    parser.add_argument("--other-forms", nargs="+", default=[], choices=OTHER_FORMS,
                        help="also time keras_vitnorm with each of these fast paths off (or, "
                             "tf_xla, TensorFlow compiled with XLA), against its library form")
    add_host_memory_argument(parser, "retain: every implementation's process (the reference "
                                     "too) calls keras_vitnorm.host_memory.retain_freed_memory() "
                                     "first; default: glibc's own settings")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--implementation", default="keras", choices=IMPLEMENTATIONS,
                        help=argparse.SUPPRESS)
    parser.add_argument("--form", choices=OTHER_FORMS, help=argparse.SUPPRESS)
    return parser


def model_config(parser, args):
    """The checked arguments' ViT config; exits through `parser.error` on a bad argument."""
    check_positive_ints(parser, args, ("batch_size", "steps", "repeats", "threads", "image_size",
                                       "rounds"))
    if args.warmup < 0:
        parser.error(f"--warmup must be 0 or more, got {args.warmup}")
    # This process only reads the preset: it must not need TensorFlow (Keras'
    # default backend) on a machine that runs only the other backends.
    os.environ.setdefault("KERAS_BACKEND", args.backends[0])
    from keras_vitnorm.models.presets import preset_config

    try:
        config = {**preset_config(args.preset), "image_size": args.image_size, **json.loads(args.overrides)}
    except ValueError as error:
        parser.error(str(error))
    if config["image_size"] != args.image_size:
        parser.error(f"--overrides sets image_size {config['image_size']}: give it as --image-size")
    return config


def implementations(args):
    """`(label, backend, implementation)` of each implementation the arguments ask for."""
    runs = []
    if not args.no_reference:
        runs.append(("transformers ViT (PyTorch eager)", "torch", "reference"))
    runs += [(TIMM_LABELS[kind], "torch", TIMM_IMPLEMENTATIONS[kind]) for kind in args.timm]
    for b in args.backends:
        runs.append((f"keras_vitnorm ({b})", b, "keras"))
        runs += [(form_label(b, form), b, f"keras:{form}") for form in args.other_forms
                 if form != "tf_xla" or b == "tensorflow"]
    if args.keras_hub:
        runs += [(f"keras-hub ViT ({b})", b, "keras_hub") for b in args.backends]
    return runs


def main(argv=None):
    parser = argument_parser()
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args)
    config = model_config(parser, args)
    flops = model_flops(config["width"], config["depth"], config["mlp_dim"], config["patch_size"],
                        args.image_size, 3, config.get("num_classes", 1000))
    datasheet = None
    if args.device == "gpu":
        matmul_dtype = "bfloat16" if args.mixed_precision == "mixed_bfloat16" else "float32"
        try:
            peak = gpu_matmul_rate(matmul_dtype)
            peak_sources = {"torch (GPU)": peak}
        except (ImportError, RuntimeError) as error:
            parser.error(f"--device gpu needs PyTorch with a CUDA GPU to measure the matmul rate: {error}")
        import torch

        gpu_name = torch.cuda.get_device_name()
        tflops = datasheet_tflops(gpu_name, matmul_dtype)
        datasheet = (gpu_name, tflops) if tflops else None
    else:
        matmul_dtype = "float32"
        peak, peak_sources = matmul_rate(args.threads, args.backends)
    runs = implementations(args)
    if args.interleave:
        results = interleaved(args, runs)
    else:
        rounds = {label: [] for label, _, _ in runs}
        for round_index in range(args.rounds):
            for label, backend, implementation in runs:
                print(f"timing {label} (round {round_index + 1} of {args.rounds}) ...", file=sys.stderr,
                      flush=True)
                rounds[label].append(spawn(args, implementation, backend))
        results = {label: combine_rounds(measured) for label, measured in rounds.items()}
    lines = table(args, results, flops, peak, peak_sources, matmul_dtype, datasheet)
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "flops_per_image": flops, "matmul_gflops": peak,
                       "matmul_gflops_by_library": peak_sources, "matmul_dtype": matmul_dtype,
                       "datasheet": datasheet and {"gpu": datasheet[0], "tflops": datasheet[1]},
                       "results": results}, f, indent=2)
    return 0


#: The table's labels and the workers' `--implementation` of each `--timm` kind.
TIMM_LABELS = {"eager": "timm ViT (PyTorch eager)", "compiled": "timm ViT (torch.compile)"}
TIMM_IMPLEMENTATIONS = {"eager": "timm", "compiled": "timm_compiled"}


if __name__ == "__main__":
    sys.exit(main())
