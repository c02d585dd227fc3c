"""Where the JAX backend's training step spends its device time, by part of the model.

    KERAS_BACKEND=jax python benchmarks/profile_jax.py --preset s16 --batch-size 8
    KERAS_BACKEND=jax python benchmarks/profile_jax.py --device gpu --preset b16 \
        --batch-size 256 --mixed-precision mixed_bfloat16

The step is Keras' `train_step` of `fit` for the model compiled as `bench_vit.py`
times it (AdamW, cross-entropy on logits), under `jax.jit` with the batch on the
device. `--steps` steps run under `jax.profiler`; each XLA operation the device ran
(a GPU kernel, or a CPU thunk) is matched by its `hlo_op` to the compiled program's
instruction and so to the JAX name scope it came from: Keras names them after the
layers, `jvp(...)` for the forward pass and `transpose(jvp(...))` for the backward
pass. A fused operation counts where XLA's metadata puts it (its root's scope).

The table gives the device time per step of each part (the norms, the attention's
softmax(q k^T) v, its projections, the MLP, the stem, the head and the loss, the
optimizer's update, the rest) forward and backward, and its share. Above it: the
step's wall time, the device's busy time per step (on a GPU, what is left is time
the GPU waited for the host), the step's FLOPs by XLA's cost analysis and their rate
against the datasheet's dense bfloat16 peak (`bench_vit.py`'s table of GPU names),
and the same step fed a NumPy batch each time (the input's copy to the device). On a
CPU, XLA runs operations on several threads at once, so the parts' times add up to
more than the wall time.

The issue this serves: JAX at 40% of the datasheet's peak at B/16; the profile says
which part to work on. With no `hlo_op` in the trace, the script lists what the
trace holds instead of a table, so a lent GPU's call still brings that back.
"""

import argparse
import collections
import glob
import json
import os
import re
import tempfile
import time

from _common import check_positive_ints
from _common import compile_like_fit
from _common import jax_training
from _common import require_jax_backend
from _common import require_jax_device
from _common import synthetic_batch

#: The parts of the table, in its order; `part_of` names each operation's.
PARTS = ("norms", "attention: softmax(q k^T) v", "attention: projections", "MLP", "stem",
         "head and loss", "optimizer update", "other")
#: Scope names of the attention's projections (`keras_vitnorm.layers.attention`).
PROJECTIONS = re.compile(r"/attention/(qkv|query|key|value|q|k|v|out|proj)\b")


def part_of(op_name):
    """`(part, pass)` of an operation from its JAX name scope: pass is "forward",
    "backward" or "" (neither: the optimizer's update, the metrics)."""
    backward = "transpose(" in op_name
    phase = "backward" if backward else "forward" if "jvp(" in op_name else ""
    # Each scope without the transformations around it: "transpose(jvp(final_norm))".
    scopes = [re.sub(r"^(?:\w+\()+|\)+$", "", scope) for scope in op_name.split("/")]
    if any(scope.startswith(("adam", "optimizer")) for scope in scopes):
        return "optimizer update", ""
    if any(scope.endswith("norm") or "norm_" in scope or "normalization" in scope
           for scope in scopes[1:]):
        return "norms", phase
    if "/attention/" in op_name + "/":
        return ("attention: projections" if PROJECTIONS.search(op_name)
                else "attention: softmax(q k^T) v"), phase
    if re.search(r"/mlp(/|$)", op_name):
        return "MLP", phase
    if re.search(r"\bstem\b|patch", op_name):
        return "stem", phase
    if re.search(r"\bhead\b|compile_loss|crossentropy|pool", op_name):
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
    """`[(hlo_op, nanoseconds)]` of the trace's operations of `module`: from the device
    planes (a GPU's), else the host's (a CPU's thunks); on a plane, the line whose
    operations add up to most (a GPU trace repeats them on its "XLA Ops" and stream
    lines)."""
    def stats(event):
        return dict(event.stats)

    planes = [p for p in profile.planes if p.name.startswith("/device:")]
    planes = planes or [p for p in profile.planes if p.name.startswith("/host:CPU")]
    found = []
    for plane in planes:
        lines = []
        for line in plane.lines:
            events = []
            for event in line.events:
                s = stats(event)
                if s.get("hlo_module", module) == module and "hlo_op" in s:
                    events.append((s["hlo_op"], event.duration_ns))
            lines.append(events)
        if plane.name.startswith("/host:CPU"):  # thunks of several threads: all of them
            found += [e for events in lines for e in events]
        elif lines:
            found += max(lines, key=lambda events: sum(ns for _, ns in events))
    return found


def trace_contents(profile, limit=12):
    """What a trace holds, where it has no `hlo_op` to match: its planes and lines and
    their most frequent event names."""
    rows = []
    for plane in profile.planes:
        for line in plane.lines:
            names = collections.Counter(event.name for event in line.events)
            if names:
                rows.append(f"{plane.name} / {line.name}: "
                            + ", ".join(f"{n} x{c}" for n, c in names.most_common(limit)))
    return rows


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="s16")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="profiled (and timed) steps")
    parser.add_argument("--mixed-precision", default="float32",
                        choices=("float32", "mixed_bfloat16", "mixed_float16"))
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--overrides", default="{}",
                        help="JSON of ViT settings over the preset's (e.g. a tiny model for tests)")
    parser.add_argument("--json", help="write the parts' times to this file")
    args = parser.parse_args(argv)
    check_positive_ints(parser, args, ("image_size", "batch_size", "steps"))
    try:
        args.overrides = json.loads(args.overrides)
    except json.JSONDecodeError as error:
        parser.error(f"--overrides is not JSON ({error}): {args.overrides!r}")
    return args


def build_step(args):
    """`(jitted step, state, device batch, NumPy batch, model config)`."""
    import jax
    import keras

    from keras_vitnorm import ViT
    from keras_vitnorm.models.presets import preset_config

    keras.config.set_dtype_policy(args.mixed_precision)
    config = {**preset_config(args.preset), "image_size": args.image_size, **args.overrides}
    keras.utils.set_random_seed(0)
    model = compile_like_fit(ViT(**config))
    x, y = synthetic_batch(config, args.batch_size)
    model.train_on_batch(x, y)  # builds the optimizer and the metrics
    state, step = jax_training(model)
    return jax.jit(step), state, (jax.device_put(x), jax.device_put(y)), (x, y), config


def timed(step, state, data, steps):
    """`(state, seconds per step)` of `steps` steps after `step` has run once."""
    import jax

    began = time.perf_counter()
    for _ in range(steps):
        state = step(state, data)
    jax.block_until_ready(state)
    return state, (time.perf_counter() - began) / steps


def profile(args):
    import jax

    step, state, data, host_data, config = build_step(args)
    state = step(state, data)  # compiles
    jax.block_until_ready(state)
    compiled = step.lower(state, data).compile()
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, list) else costs
    flops = float(costs.get("flops", 0.0)) if costs else 0.0
    state, seconds = timed(step, state, data, args.steps)
    state, host_seconds = timed(step, state, host_data, args.steps)
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        state, traced_seconds = timed(step, state, data, args.steps)
        jax.profiler.stop_trace()
        path = max(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True),
                   key=os.path.getmtime)
        trace = jax.profiler.ProfileData.from_file(path)
        module = compiled.as_text().split("\n", 1)[0].split()[1].rstrip(",")
        events = device_events(trace, module)
        contents = [] if events else trace_contents(trace)
    scopes = instruction_scopes(compiled.as_text())
    parts = collections.defaultdict(float)
    unmatched = 0.0
    for hlo_op, nanoseconds in events:
        op_name = scopes.get(hlo_op)
        if op_name is None:
            unmatched += nanoseconds
            op_name = ""
        parts[part_of(op_name)] += nanoseconds / 1e9 / args.steps
    return {"config": config, "seconds": seconds, "host_batch_seconds": host_seconds,
            "traced_seconds": traced_seconds, "flops": flops,
            "device": jax.devices()[0].device_kind,
            "parts": {f"{part}|{phase}": s for (part, phase), s in parts.items()},
            "unmatched_seconds": unmatched / 1e9 / args.steps, "trace_contents": contents}


def report(result, args):
    from bench_vit import datasheet_tflops

    lines = [f"{args.preset} ({result['config']['image_size']} px), batch {args.batch_size}, "
             f"{args.mixed_precision}, {result['device']}; {args.steps} steps"]
    seconds = result["seconds"]
    lines.append(f"- step: {1000 * seconds:.2f} ms ({args.batch_size / seconds:,.1f} img/s); "
                 f"fed a NumPy batch each step: {1000 * result['host_batch_seconds']:.2f} ms")
    if result["flops"]:
        rate = result["flops"] / seconds / 1e12
        peak = datasheet_tflops(result["device"], "bfloat16")
        share = f", {100 * rate / peak:.1f}% of the datasheet's dense bfloat16 peak" if peak else ""
        lines.append(f"- XLA's cost analysis: {result['flops'] / 1e9:,.1f} GFLOP per step, "
                     f"{rate:,.2f} TFLOP/s{share}")
    if result["trace_contents"]:
        lines.append("- the trace has no operation with an `hlo_op` of this program; it holds:")
        lines += [f"  - {row}" for row in result["trace_contents"]]
        return "\n".join(lines)
    parts = result["parts"]
    busy = sum(parts.values())
    lines.append(f"- device time of its operations: {1000 * busy:.2f} ms per step (the traced "
                 f"steps took {1000 * result['traced_seconds']:.2f} ms each); "
                 f"{1000 * result['unmatched_seconds']:.2f} ms not matched to an instruction")
    lines += ["", "| part | forward (ms) | backward (ms) | other (ms) | total (ms) | share |",
              "|---|---|---|---|---|---|"]
    for part in PARTS:
        times = [parts.get(f"{part}|{phase}", 0.0) for phase in ("forward", "backward", "")]
        if sum(times):
            lines.append(f"| {part} | " + " | ".join(f"{1000 * t:.2f}" for t in times)
                         + f" | {1000 * sum(times):.2f} | {100 * sum(times) / busy:.1f}% |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_arguments(argv)
    require_jax_backend("profile_jax.py", "profiles JAX programs")
    require_jax_device(args.device)
    result = profile(args)
    print(report(result, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
