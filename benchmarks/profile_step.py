"""Where the running Keras backend's training or inference step spends its time.

    KERAS_BACKEND=jax python benchmarks/profile_step.py --preset s16 --batch-size 8
    KERAS_BACKEND=tensorflow python benchmarks/profile_step.py --mode inference
    KERAS_BACKEND=torch python benchmarks/profile_step.py --mode inference --reference
    KERAS_BACKEND=jax python benchmarks/profile_step.py --device gpu --preset b16 \
        --batch-size 256 --mixed-precision mixed_bfloat16

keras_vitnorm's ViT, compiled as `bench_vit.py` times it, runs `--steps` steps on a
batch on the device under the backend's profiler, after two warm-up steps:

- JAX: Keras' `train_step` (or `predict_step`) under `jax.jit` and `jax.profiler`.
  Each operation the device ran (a GPU kernel, a CPU thunk) is matched by its
  `hlo_op` to the compiled program's instruction and so to its name scope (a fused
  one to its root's). Also XLA's FLOP count, its rate against the datasheet's dense
  bfloat16 peak, and the step fed a NumPy batch. A trace without `hlo_op` is listed.
- TensorFlow: `train_on_batch` or `predict_on_batch` as `fit` compiles them (on a
  machine without a GPU, a graph of TensorFlow's kernels) under `tf.profiler`; each
  kernel's op name gives its scope. Also the kernels by time.
- PyTorch: the same steps under `torch.profiler`, the ATen operators by self time
  (and the CUDA kernels by GPU time); `--reference` profiles the transformers ViT
  too, side by side. Where a step makes the host wait for a GPU is
  tools/gpu/host_waits.py's.

For JAX and TensorFlow the table gives the time per step of each part of the model
(`PARTS`), forward (`jvp(...)`) and backward (`transpose(...)`, `gradient_tape/...`).
On a CPU both run operations on several threads at once, so the parts add up to more
than the wall time.
"""
import argparse
import collections
import glob
import json
import os
import re
import tempfile

from _common import add_host_memory_argument
from _common import apply_host_memory
from _common import check_positive_ints
from _common import compile_like_fit
from _common import jax_training
from _common import keras_backend_device
from _common import keras_steps
from _common import reference_steps
from _common import synthetic_batch
from _common import timed

#: The parts of the table, in its order; `part_of` names each operation's.
PARTS = ("norms", "attention: softmax(q k^T) v", "attention: projections", "MLP", "stem",
         "head and loss", "optimizer update", "other")
#: Layer names of the attention's projections (`keras_vitnorm.layers.attention`).
PROJECTIONS = ("qkv", "query", "key", "value", "q", "k", "v", "out", "proj")


def part_of(op_name):
    """`(part, pass)` of an operation from its name scope, JAX's (`jit(step)/jvp(block_3)/
    attn_norm/...`) or TensorFlow's (`gradient_tape/vit_1/block_0_1/attention_1/...`): pass
    is "forward", "backward" or "" (neither: the optimizer's update, JAX's metrics)."""
    backward = "transpose(" in op_name or op_name.startswith("gradient_tape/")
    forward = "jvp(" in op_name or not op_name.startswith("jit(")  # TensorFlow: forward
    phase = "backward" if backward else "forward" if forward else ""
    # Each scope without the transformations around it and TensorFlow's numbering:
    # "transpose(jvp(final_norm))" -> "final_norm", "block_0_1" -> "block".
    scopes = [re.sub(r"(_\d+)+$", "", re.sub(r"^(?:\w+\()+|\)+$", "", scope))
              for scope in op_name.split("/")]
    if any(scope.lower().startswith(("adam", "optimizer", "sgd")) for scope in scopes):
        return "optimizer update", ""
    if any(scope.endswith("norm") or "norm_" in scope or "normalization" in scope
           for scope in scopes[1:]):
        return "norms", phase
    if "attention" in scopes:
        after = scopes[scopes.index("attention") + 1:]
        return ("attention: projections" if after and after[0] in PROJECTIONS
                else "attention: softmax(q k^T) v"), phase
    if "mlp" in scopes:
        return "MLP", phase
    if "stem" in scopes or "patch" in op_name:
        return "stem", phase
    if any(scope in ("head", "compile_loss") or "crossentropy" in scope or "pool" in scope
           for scope in scopes):
        return "head and loss", phase
    return "other", phase


def instruction_scopes(hlo_text):
    """`{instruction name: op_name}` of a compiled program's text. A fusion's own line
    often has no metadata: it takes its fused computation's (the root's, else the
    first instruction's that has one). An instruction the compiler added with none
    (a layout copy, a bias gradient's reduction) takes that of the first of its
    operands that has one: it is counted with the operation whose output it reads."""
    own, calls, roots, firsts, operands = {}, {}, {}, {}, {}
    computation = None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            computation = header.group(1)
            continue
        instruction = re.match(r"^\s*(ROOT )?%?([\w.\-]+) = ", line)
        if not instruction:
            continue
        name = instruction.group(2)
        scope = re.search(r'op_name="([^"]*)"', line)
        called = re.search(r"\bcalls=%?([\w.\-]+)", line)
        if scope:
            own[name] = scope.group(1)
            firsts.setdefault(computation, scope.group(1))
            if instruction.group(1):
                roots[computation] = scope.group(1)
        if called:
            calls[name] = called.group(1)
        arguments = re.search(r"= [^(]*\(([^)]*)\)", line)
        operands[name] = re.findall(r"%([\w.\-]+)", arguments.group(1)) if arguments else []
    scopes = dict(own)
    for name, called in calls.items():
        if name not in scopes:
            scope = roots.get(called) or firsts.get(called)
            if scope:
                scopes[name] = scope
    for _ in range(8):  # chains of added instructions, a few deep
        for name, names in operands.items():
            if name not in scopes:
                scope = next((scopes[n] for n in names if n in scopes), None)
                if scope:
                    scopes[name] = scope
    return scopes


def device_events(profile, module):
    """`[(hlo_op, nanoseconds)]` of a JAX trace's operations of `module`: from the device
    planes (a GPU's), else the host's (a CPU's thunks, every thread's); on a device
    plane, the line whose operations add up to most (a GPU trace repeats them on its
    "XLA Ops" and stream lines)."""
    planes = [p for p in profile.planes if p.name.startswith("/device:")]
    planes = planes or [p for p in profile.planes if p.name.startswith("/host:CPU")]
    found = []
    for plane in planes:
        lines = []
        for line in plane.lines:
            events = []
            for event in line.events:
                stats = dict(event.stats)
                if stats.get("hlo_module", module) == module and "hlo_op" in stats:
                    events.append((stats["hlo_op"], event.duration_ns))
            lines.append(events)
        if plane.name.startswith("/host:CPU"):
            found += [e for events in lines for e in events]
        elif lines:
            found += max(lines, key=lambda events: sum(ns for _, ns in events))
    return found


def trace_contents(profile, limit=12):
    """What a JAX trace holds, where it has no `hlo_op` to match: its planes and lines and
    their most frequent event names."""
    rows = []
    for plane in profile.planes:
        for line in plane.lines:
            names = collections.Counter(event.name for event in line.events)
            if names:
                rows.append(f"{plane.name} / {line.name}: "
                            + ", ".join(f"{n} x{c}" for n, c in names.most_common(limit)))
    return rows


def traced(start, stop, run):
    """`(run(), the serialized XSpace of its trace)`, `run` between `start(folder)` and
    `stop()` of JAX's or TensorFlow's profiler."""
    with tempfile.TemporaryDirectory() as folder:
        start(folder)
        result = run()
        stop()
        paths = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            raise RuntimeError(f"the profiler wrote no .xplane.pb file under {folder}")
        with open(max(paths, key=os.path.getmtime), "rb") as f:
            return result, f.read()


def by_part(named_seconds):
    """`{"part|pass": seconds}` summed from `(op_name, seconds)` pairs."""
    parts = collections.defaultdict(float)
    for op_name, seconds in named_seconds:
        parts["|".join(part_of(op_name))] += seconds
    return dict(parts)


def profile_jax(args, config):
    import jax

    from keras_vitnorm import ViT

    model = compile_like_fit(ViT(**config))
    x, y = synthetic_batch(config, args.batch_size)
    model.train_on_batch(x, y)  # builds the optimizer and the metrics
    state, train_step = jax_training(model)
    if args.mode == "inference":
        state = state[:2]
        function = jax.jit(lambda state, data: model.predict_step(state, data)[0])
    else:
        function = jax.jit(train_step)
    data, host_data = (jax.device_put(x), jax.device_put(y)), (x, y)
    compiled = function.lower(state, data).compile()
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, list) else costs
    held = [state, None]  # a training step's state, or inference's output

    def run(data):
        def step():
            held[args.mode == "inference"] = function(held[0], data)
        return timed(step, args.steps, warmup=2, wait=lambda: jax.block_until_ready(held))

    seconds = run(data)["step_s"]
    host_seconds = run(host_data)["step_s"]
    profiled, xspace = traced(jax.profiler.start_trace, jax.profiler.stop_trace,
                              lambda: run(data)["step_s"])
    trace = jax.profiler.ProfileData.from_serialized_xspace(xspace)
    module = compiled.as_text().split("\n", 1)[0].split()[1].rstrip(",")
    events = device_events(trace, module)
    contents = [] if events else trace_contents(trace)
    scopes = instruction_scopes(compiled.as_text())
    unmatched = sum(ns for op, ns in events if op not in scopes) / 1e9 / args.steps
    return {"seconds": profiled, "untraced_seconds": seconds, "host_batch_seconds": host_seconds,
            "flops": float(costs.get("flops", 0.0)) if costs else 0.0,
            "device": jax.devices()[0].device_kind, "trace_contents": contents,
            "parts": by_part((scopes.get(op, ""), ns / 1e9 / args.steps) for op, ns in events),
            "unmatched_seconds": unmatched}


def profile_tensorflow(args, config):
    import tensorflow as tf

    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError:  # where TensorFlow does not re-export tsl
        from tsl.profiler.protobuf import xplane_pb2

    step = keras_steps(config, args.batch_size, [args.mode], args.device,
                       args.mixed_precision)[args.mode]
    timed(step, warmup=2)
    seconds, xspace = traced(tf.profiler.experimental.start, tf.profiler.experimental.stop,
                             lambda: timed(step, args.steps)["step_s"])
    space = xplane_pb2.XSpace()
    space.ParseFromString(xspace)
    ops, kernels = [], collections.defaultdict(lambda: [0.0, 0.0])  # on the executor threads
    for plane in space.planes:
        for line in plane.lines:
            if line.name.startswith("tf_Compute"):
                for event in line.events:
                    name = plane.event_metadata[event.metadata_id].name
                    if ":" in name and not name.startswith("ExecutorState"):
                        op_name, kernel = name.rsplit(":", 1)
                        ops.append((op_name, event.duration_ps / 1e12 / args.steps))
                        kernels[kernel][0] += ops[-1][1]
                        kernels[kernel][1] += 1 / args.steps
    return {"seconds": seconds, "parts": by_part(ops), "kernels": dict(kernels)}


def profile_torch(args, config):
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile

    steps = [("keras_vitnorm (torch)", keras_steps(config, args.batch_size, [args.mode],
                                                   args.device, args.mixed_precision)[args.mode])]
    if args.reference:
        steps.insert(0, ("transformers ViT (reference)", reference_steps(
            config, args.batch_size, [args.mode], os.cpu_count(), args.device,
            args.mixed_precision)[args.mode]))
    gpu = args.device == "gpu"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    tables = []
    for name, step in steps:
        timed(step, warmup=2)
        with profile(activities=activities) as traced:
            seconds = timed(step, args.steps, wait=torch.cuda.synchronize if gpu else None)
        averages = traced.key_averages()
        aten = sum(e.self_cpu_time_total for e in averages
                   if e.key.startswith("aten::")) / 1e6 / args.steps
        lines = [f"== {name}: {seconds['step_s']:.3f} s per step, {aten:.3f} s of it self time "
                 f"in ATen operators, {seconds['step_s'] - aten:.3f} s outside them",
                 averages.table(sort_by="self_cpu_time_total", row_limit=args.rows)]
        if gpu:
            kernels = sum(e.self_device_time_total for e in averages
                          if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6 / args.steps
            lines += [f"GPU kernel time per step: {kernels:.3f} s",
                      averages.table(sort_by="self_device_time_total", row_limit=args.rows)]
        tables.append("\n".join(lines))
    return {"tables": tables}


def report(result, args, config):
    """The profile as text: the step, then a table by part of the model (JAX, TensorFlow),
    the kernels (TensorFlow) or the operators (PyTorch)."""
    lines = [f"{args.backend}: {args.preset} ({config['image_size']} px), batch {args.batch_size}, "
             f"{args.mode}, {args.mixed_precision}, {result.get('device', args.device)}; "
             f"{args.steps} steps"]
    if "tables" in result:
        return "\n".join(lines + result["tables"])
    seconds = result["seconds"]
    lines.append(f"- step, profiled: {1000 * seconds:.2f} ms ({args.batch_size / seconds:,.1f} "
                 "img/s)")
    if "host_batch_seconds" in result:
        lines.append(f"- not profiled: {1000 * result['untraced_seconds']:.2f} ms; fed a NumPy "
                     f"batch each step: {1000 * result['host_batch_seconds']:.2f} ms")
    if result.get("flops"):
        from bench_vit import datasheet_tflops

        rate = result["flops"] / seconds / 1e12
        peak = datasheet_tflops(result["device"], "bfloat16")
        share = f", {100 * rate / peak:.1f}% of the datasheet's dense bfloat16 peak" if peak else ""
        lines.append(f"- XLA's cost analysis: {result['flops'] / 1e9:,.1f} GFLOP per step, "
                     f"{rate:,.2f} TFLOP/s{share}")
    if result.get("trace_contents"):
        lines.append("- the trace has no operation with an `hlo_op` of this program; it holds:")
        return "\n".join(lines + [f"  - {row}" for row in result["trace_contents"]])
    parts = result["parts"]
    busy = sum(parts.values())
    lines.append(f"- time of its operations: {1000 * busy:.2f} ms per step"
                 + (f", {1000 * result['unmatched_seconds']:.2f} ms of it not matched to an "
                    "instruction" if "unmatched_seconds" in result else ""))
    lines += ["", "| part | forward (ms) | backward (ms) | other (ms) | total (ms) | share |",
              "|---|---|---|---|---|---|"]
    for part in PARTS:
        times = [parts.get(f"{part}|{phase}", 0.0) for phase in ("forward", "backward", "")]
        if sum(times):
            lines.append(f"| {part} | " + " | ".join(f"{1000 * t:.2f}" for t in times)
                         + f" | {1000 * sum(times):.2f} | {100 * sum(times) / busy:.1f}% |")
    if "kernels" in result:
        lines += ["", "| kernel | ms per step | calls per step |", "|---|---|---|"]
        ranked = sorted(result["kernels"].items(), key=lambda item: -item[1][0])
        lines += [f"| {kernel} | {1000 * s:.1f} | {calls:g} |" for kernel, (s, calls)
                  in ranked[:args.rows]]
    return "\n".join(lines)


PROFILERS = {"jax": profile_jax, "tensorflow": profile_tensorflow, "torch": profile_torch}


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--mode", choices=("train", "inference"), default="train")
    parser.add_argument("--preset", default="s16")
    parser.add_argument("--image-size", type=int, help="default: the preset's")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--rows", type=int, default=20,
                        help="kernels (TensorFlow) or operators (PyTorch) listed")
    parser.add_argument("--mixed-precision", default="float32",
                        choices=("float32", "mixed_bfloat16", "mixed_float16"))
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--overrides", default="{}",
                        help="JSON of ViT settings over the preset's (e.g. a tiny model for tests)")
    parser.add_argument("--reference", action="store_true",
                        help="PyTorch: profile the transformers ViT too")
    add_host_memory_argument(parser, "retain (default): call keras_vitnorm.host_memory."
                                     "retain_freed_memory() first, as bench_vit.py does")
    parser.add_argument("--json", help="write the profile to this file")
    args = parser.parse_args(argv)
    check_positive_ints(parser, args, ("image_size", "batch_size", "steps", "rows"))
    try:
        args.overrides = json.loads(args.overrides)
    except json.JSONDecodeError as error:
        parser.error(f"--overrides is not JSON ({error}): {args.overrides!r}")
    return args


def main(argv=None):
    args = parse_arguments(argv)
    import keras

    args.backend = keras.backend.backend()
    if args.reference and args.backend != "torch":
        raise SystemExit(f"--reference: the transformers ViT is PyTorch's; run with "
                         f"KERAS_BACKEND=torch (this process has {args.backend})")
    if keras_backend_device() != args.device:
        raise SystemExit(f"--device {args.device}: the {args.backend} backend computes on "
                         f"{keras_backend_device()} here")
    apply_host_memory(args.host_memory)

    from keras_vitnorm.models.presets import preset_config

    keras.config.set_dtype_policy(args.mixed_precision)
    config = {**preset_config(args.preset), "num_classes": 1000, **args.overrides}
    config["image_size"] = args.image_size or config["image_size"]
    keras.utils.set_random_seed(0)
    result = PROFILERS[args.backend](args, config)
    print(report(result, args, config))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": config, **result}, f, indent=2)
    return result


if __name__ == "__main__":
    main()
