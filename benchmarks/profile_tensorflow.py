"""Operator profile of keras_vitnorm's training or inference step on the TensorFlow backend.

    python benchmarks/profile_tensorflow.py --mode train
    python benchmarks/profile_tensorflow.py --mode inference --steps 2 --rows 30

The model (random weights) runs `--steps` steps of `train_on_batch` (AdamW,
cross-entropy) or `predict_on_batch` under `tf.profiler` after two warm-up
steps, compiled as `fit` compiles it (Keras' `jit_compile="auto"`: on a machine
without a GPU or TPU, a graph of TensorFlow's kernels and no XLA). The profile
is read back from its XSpace file and summed per step:

- by kernel (`_MklMatMul`, `Mul`, ...), with the number of calls;
- by part of the model: the `attention`, `mlp`, norm, stem and head layers, the
  optimizer's update, the model's other ops (`other`), and ops outside any layer
  (`unscoped`: the backward pass of a custom gradient, such as the exact GELU's
  on TensorFlow, the loss, gradient sums); each split into forward and backward
  (ops under `gradient_tape/`; unscoped ops count as forward).

TensorFlow runs independent kernels at the same time on its inter-op threads,
so kernel times add up to more than the wall time of a step; compare them with
each other, not with the wall time.
"""

import argparse
import collections
import glob
import os
import sys
import tempfile
import time

import numpy as np
from _common import add_host_memory_argument
from _common import apply_host_memory
from _common import check_positive_ints
from _common import compile_like_fit

# Within one name segment "norm" wins: `mlp_norm` and `attn_norm` are the block's norms.
PARTS = ("norm", "attention", "mlp", "stem", "head")


def part_of(op_name, model_name):
    """`(part, "forward" | "backward")` of a TensorFlow op name such as `gradient_tape/vit/block_0/mlp/...`."""
    segments = op_name.split("/")
    direction = "forward"
    if segments[0] == "gradient_tape":
        segments, direction = segments[1:], "backward"
    if not segments[0].startswith(model_name):
        optimizer_like = segments[0].lower().replace("_", "").startswith(("adam", "sgd", "lamb", "lion", "rmsprop"))
        return ("optimizer" if optimizer_like else "unscoped"), direction
    for segment in segments[1:-1]:
        for part in PARTS:
            if part in segment:
                return part, direction
    return "other", direction


def summarize(xspace_path, steps, model_name):
    """Kernel time per step from a `tf.profiler` XSpace file.

    Returns:
        `(by_kernel, by_part)`: `{kernel: (ms per step, calls per step)}` and
        `{(part, direction): ms per step}`, over the executor threads' kernel events.
    """
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError:  # where TensorFlow does not re-export tsl
        from tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(xspace_path, "rb") as f:
        space.ParseFromString(f.read())
    kernel_ms, kernel_calls = collections.defaultdict(float), collections.Counter()
    part_ms = collections.defaultdict(float)
    for plane in space.planes:
        metadata = plane.event_metadata
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            for event in line.events:
                name = metadata[event.metadata_id].name
                if ":" not in name or name.startswith("ExecutorState"):
                    continue
                op_name, kernel = name.rsplit(":", 1)
                ms = event.duration_ps / 1e9 / steps
                kernel_ms[kernel] += ms
                kernel_calls[kernel] += 1
                part_ms[part_of(op_name, model_name)] += ms
    by_kernel = {k: (kernel_ms[k], kernel_calls[k] / steps) for k in kernel_ms}
    return by_kernel, dict(part_ms)


def profile_steps(step, steps, logdir):
    """Runs `step` `steps` times under `tf.profiler`; returns (wall seconds per step, XSpace path)."""
    import tensorflow as tf

    tf.profiler.experimental.start(logdir)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    wall = (time.perf_counter() - start) / steps
    tf.profiler.experimental.stop()
    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not paths:
        raise RuntimeError(f"tf.profiler wrote no .xplane.pb file under {logdir}")
    return wall, paths[-1]


def tables(by_kernel, by_part, rows):
    """Markdown lines: kernels by time per step, then parts by forward and backward time."""
    lines = ["| kernel | ms per step | calls per step |", "|---|---|---|"]
    for kernel, (ms, calls) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"| {kernel} | {ms:.1f} | {calls:g} |")
    lines += ["", "| part | forward ms per step | backward ms per step | total |", "|---|---|---|---|"]
    parts = sorted({part for part, _ in by_part}, key=lambda p: -by_part.get((p, "forward"), 0)
                   - by_part.get((p, "backward"), 0))
    for part in parts:
        forward, backward = by_part.get((part, "forward"), 0.0), by_part.get((part, "backward"), 0.0)
        lines.append(f"| {part} | {forward:.1f} | {backward:.1f} | {forward + backward:.1f} |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--mode", choices=("inference", "train"), default="train")
    parser.add_argument("--preset", default="s16")
    parser.add_argument("--image-size", type=int, help="default: the preset's")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2, help="profiled steps")
    parser.add_argument("--rows", type=int, default=25, help="kernels listed")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    add_host_memory_argument(parser, "retain (default): call keras_vitnorm.host_memory."
                                     "retain_freed_memory() first, as bench_vit.py does")
    args = parser.parse_args(argv)
    check_positive_ints(parser, args, ("batch_size", "steps", "rows", "threads", "image_size"))
    if "keras" in sys.modules and sys.modules["keras"].backend.backend() != "tensorflow":
        parser.error("Keras is already imported with another backend; run this script on its own")
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", str(args.threads))
    import keras_vitnorm

    apply_host_memory(args.host_memory)
    from keras_vitnorm.models.presets import preset_config

    try:
        config = {**preset_config(args.preset), "num_classes": 1000}
    except ValueError as error:
        parser.error(f"--preset: {error}")
    if args.image_size is not None:
        config["image_size"] = args.image_size
    rng = np.random.default_rng(0)
    size = config["image_size"]
    x = rng.uniform(-1, 1, (args.batch_size, size, size, 3)).astype("float32")
    y = rng.integers(0, 1000, (args.batch_size,))
    model = compile_like_fit(keras_vitnorm.ViT(**config))

    def step():
        if args.mode == "train":
            model.train_on_batch(x, y)
        else:
            np.asarray(model.predict_on_batch(x))

    step()
    step()
    with tempfile.TemporaryDirectory() as logdir:
        wall, path = profile_steps(step, args.steps, logdir)
        by_kernel, by_part = summarize(path, args.steps, model.name)
    kernel_total = sum(ms for ms, _ in by_kernel.values())
    print(f"== keras_vitnorm (tensorflow, jit_compile={model.jit_compile}): {args.preset} at {size} px, "
          f"batch {args.batch_size}, {args.mode}, {args.steps} profiled steps")
    print(f"per step: {wall:.3f} s wall, {kernel_total / 1e3:.3f} s of kernel time on the executor threads")
    print("\n".join(tables(by_kernel, by_part, args.rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
