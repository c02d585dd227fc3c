"""Operator profile of keras_vitnorm on the PyTorch backend next to the transformers ViT.

    python benchmarks/profile_torch.py --mode inference
    python benchmarks/profile_torch.py --mode train --steps 2 --rows 30
    python benchmarks/profile_torch.py --mode train --device gpu --preset b16 --batch-size 256 \
        --mixed-precision mixed_bfloat16

Both models (same size, random weights) run `--steps` steps under
`torch.profiler` after two warm-up steps, in this process: Keras through
`predict_on_batch` / `train_on_batch` (AdamW), the reference as in `bench_vit.py`.
For each, the table lists the ATen operators by self CPU time, so kernels that
differ between the two (matmul forms, copies, attention kernels) show side by side.
A line above it gives, for the same profiled steps, the wall time per step, the ATen
operators' self time per step, and the difference: time spent outside ATen
operators (Python, Keras' layer and optimizer code, the profiler's own overhead).
Run it with the allocator settings you want to compare (for example
`MALLOC_MMAP_THRESHOLD_=1000000000 MALLOC_TRIM_THRESHOLD_=1000000000`).

With `--device gpu` both models and the batch are on the GPU, the profile records
CUDA kernels too (a second table, by GPU time, and the GPU kernel time per step),
and `--mixed-precision mixed_bfloat16` runs Keras under that policy and the
reference under `torch.autocast`. Where each step makes the host wait for the GPU is
tools/gpu/host_waits.py's (`--reference` lists the reference's too).
"""

import argparse
import os
import sys
import time

from _common import check_positive_ints
from _common import keras_steps
from _common import reference_steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--mode", choices=("inference", "train"), default="inference")
    parser.add_argument("--preset", default="s16")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per model")
    parser.add_argument("--rows", type=int, default=20, help="operators listed per model")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--mixed-precision", default="float32", choices=("float32", "mixed_bfloat16"))
    args = parser.parse_args(argv)
    check_positive_ints(parser, args, ("batch_size", "steps", "rows", "threads"))
    if "keras" in sys.modules and sys.modules["keras"].backend.backend() != "torch":
        parser.error("Keras is already imported with another backend; run this script on its own")
    os.environ["KERAS_BACKEND"] = "torch"
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile

    from keras_vitnorm.models.presets import preset_config

    try:
        config = {**preset_config(args.preset), "num_classes": 1000}
    except ValueError as error:
        parser.error(f"--preset: {error}")
    # Keras puts its PyTorch tensors on the GPU whenever there is one.
    if (args.device == "gpu") != torch.cuda.is_available():
        parser.error(f"--device {args.device}: PyTorch {'sees no' if args.device == 'gpu' else 'sees a'} "
                     "CUDA GPU here" + ("" if args.device == "gpu" else
                                        "; to profile the CPU, run with CUDA_VISIBLE_DEVICES= set empty"))
    device = "cuda" if args.device == "gpu" else "cpu"
    keras_step = keras_steps(config, args.batch_size, [args.mode], args.device, args.mixed_precision)[args.mode]
    reference_step = reference_steps(config, args.batch_size, [args.mode], args.threads, args.device,
                                     args.mixed_precision)[args.mode]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    steps = (("transformers ViT (reference)", reference_step), ("keras_vitnorm (torch)", keras_step))
    for name, step in steps:
        step()
        step()
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            if device == "cuda":
                torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / args.steps
        averages = prof.key_averages()
        aten = sum(e.self_cpu_time_total for e in averages if e.key.startswith("aten::")) / 1e6 / args.steps
        print(f"== {name}: {args.preset}, batch {args.batch_size}, {args.mode}, {args.mixed_precision}, "
              f"{args.device}, {args.steps} steps")
        print(f"per step, profiled: {wall:.3f} s wall, {aten:.3f} s self time in ATen operators, "
              f"{wall - aten:.3f} s outside them")
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
        if device == "cuda":
            kernels = sum(e.self_device_time_total for e in averages
                          if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6 / args.steps
            print(f"GPU kernel time per step: {kernels:.3f} s")
            print(averages.table(sort_by="self_device_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
