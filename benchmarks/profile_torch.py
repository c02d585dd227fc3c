"""Operator profile of keras_vitnorm on the PyTorch backend next to the transformers ViT.

    python benchmarks/profile_torch.py --mode inference
    python benchmarks/profile_torch.py --mode train --steps 2 --rows 30

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
"""

import argparse
import os
import sys
import time

import numpy as np
from _common import check_positive_ints
from _common import compile_like_fit
from _common import reference_vit


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--mode", choices=("inference", "train"), default="inference")
    parser.add_argument("--preset", default="s16")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per model")
    parser.add_argument("--rows", type=int, default=20, help="operators listed per model")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)
    check_positive_ints(parser, args, ("batch_size", "steps", "rows", "threads"))
    if "keras" in sys.modules and sys.modules["keras"].backend.backend() != "torch":
        parser.error("Keras is already imported with another backend; run this script on its own")
    os.environ["KERAS_BACKEND"] = "torch"
    import keras
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile

    from keras_vitnorm import ViT
    from keras_vitnorm.models.presets import preset_config

    try:
        config = {**preset_config(args.preset), "num_classes": 1000}
    except ValueError as error:
        parser.error(f"--preset: {error}")
    torch.set_num_threads(args.threads)
    size = config["image_size"]
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (args.batch_size, size, size, 3)).astype("float32")
    y = rng.integers(0, 1000, (args.batch_size,))
    ours = ViT(**config)
    compile_like_fit(ours)
    reference = reference_vit(config)
    x_nchw, y_torch = torch.from_numpy(x.transpose(0, 3, 1, 2).copy()), torch.from_numpy(y)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    if args.mode == "inference":
        reference.eval()

        def reference_step():
            with torch.inference_mode():
                reference(pixel_values=x_nchw).logits.numpy()

        def keras_step():
            keras.ops.convert_to_numpy(ours.predict_on_batch(x))
    else:
        def reference_step():
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(reference(pixel_values=x_nchw).logits, y_torch)
            loss.backward()
            optimizer.step()
            loss.item()

        def keras_step():
            ours.train_on_batch(x, y)
    for name, step in (("transformers ViT (reference)", reference_step), ("keras_vitnorm (torch)", keras_step)):
        step()
        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            wall = (time.perf_counter() - start) / args.steps
        averages = prof.key_averages()
        aten = sum(e.self_cpu_time_total for e in averages if e.key.startswith("aten::")) / 1e6 / args.steps
        print(f"== {name}: {args.preset}, batch {args.batch_size}, {args.mode}, {args.steps} steps")
        print(f"per step, profiled: {wall:.3f} s wall, {aten:.3f} s self time in ATen operators, "
              f"{wall - aten:.3f} s outside them")
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
