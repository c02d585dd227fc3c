"""Images per second of the input pipelines against the model's training step.

    KERAS_BACKEND=jax python benchmarks/bench_input.py --dataset folder:/data/cifar10
    KERAS_BACKEND=torch python benchmarks/bench_input.py --dataset digits --image-size 32
    KERAS_BACKEND=jax python benchmarks/bench_input.py --dataset folder:/data/cifar10 \
        --recipe regularized --batch-size 256 --pipelines python

Under the running Keras backend, times (1) reading `--batches` training batches of
`--batch-size` from each input pipeline that can read the dataset (`python`, Keras'
PyDataset without TensorFlow, and `tf.data` where TensorFlow is installed; or those
`--pipelines` names), with the augmentation of `--recipe`, one batch after another
in this process as `fit` reads them (the `python` pipeline twice: decoding the files,
then again from the decoded images it keeps, as in every pass after the first); and
(2) the training step (`train_on_batch`: forward, backward, AdamW) of the recipe's
model on one batch already on the device (as tf.data's prefetch gives it), in
`--mixed-precision` (the study recipes train in `mixed_bfloat16`). Each is the median
over `--rounds` rounds. The input is not the bottleneck while a pipeline's images per
second stay well above the step's: the table gives the ratio, and the input's share
of the time where input and step take turns on one core (a study run's one thread).

Recipes (those of recipes/cifar10_study.sh and recipes/imagenette_study.sh):

- `crops`: pad-4 crops and flips; the CIFAR study's model (patch 4, width 128, depth 6).
- `regularized`: the same with RandAugment (2 operations, strength 0.5) and MixUp 0.2,
  the `regularized` study's augmentation.
- `imagenette`: zoom-in crops (up to 0.75) and flips, RandAugment and MixUp as above;
  Ti/16's model (patch 16, width 192, 3 heads, depth 12). Give `--image-size 224`.
- `imagenette_cpu`: the same without RandAugment, the CPU study's augmentation
  (recipes/imagenette_study.sh, `cpu`). Give `--image-size 112`.
"""

import argparse
import statistics
import time

from _common import check_positive_ints
from _common import compile_like_fit

MODEL = dict(patch_size=4, width=128, depth=6, num_heads=4, mlp_dim=512)
REGULARIZATION = dict(randaugment_ops=2, randaugment_factor=0.5, mixup=0.2)
#: `--recipe`: (the augmentation, the model of the training step, the model's name)
RECIPES = {
    "crops": (dict(crop="pad", crop_padding=4, flip=True), MODEL, "study model"),
    "regularized": (dict(crop="pad", crop_padding=4, flip=True, **REGULARIZATION), MODEL,
                    "study model"),
    "imagenette": (dict(crop="zoom", zoom=0.75, flip=True, **REGULARIZATION),
                   dict(patch_size=16, width=192, depth=12, num_heads=3, mlp_dim=768), "Ti/16"),
    "imagenette_cpu": (dict(crop="zoom", zoom=0.75, flip=True, mixup=0.2),
                       dict(patch_size=16, width=192, depth=12, num_heads=3, mlp_dim=768), "Ti/16"),
}
PIPELINES = ("python", "tf.data")


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="digits", help="digits or folder:<path>")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--batches", type=int, default=20, help="batches read per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="crops",
                        help="the augmentation and model (module docstring)")
    parser.add_argument("--mixed-precision", default="float32",
                        choices=["float32", "mixed_bfloat16", "mixed_float16"],
                        help="the training step's precision (the study recipes': mixed_bfloat16)")
    parser.add_argument("--pipelines", nargs="+", choices=PIPELINES,
                        help="the input pipelines to time (default: python, and tf.data "
                             "where TensorFlow is installed)")
    args = parser.parse_args(argv)
    check_positive_ints(parser, args, ("image_size", "batch_size", "batches", "rounds"))
    return args


def main(argv=None):
    args = parse_arguments(argv)
    import importlib.util

    import keras
    import numpy as np

    from keras_vitnorm import ViT
    from keras_vitnorm.study.workers import usable_cores
    from keras_vitnorm.training import data as data_lib

    size = (args.image_size, args.image_size)
    augmentation_options, model_options, model_name = RECIPES[args.recipe]
    augmentation = data_lib.Augmentation(**augmentation_options)
    pipelines = args.pipelines or (
        ["python"] + (["tf.data"] if importlib.util.find_spec("tensorflow") else []))
    rows = []
    for pipeline in pipelines:
        data = data_lib.load_dataset(args.dataset, pipeline=pipeline)
        channels = data.channels
        times, again = [], []
        for round_index in range(args.rounds):
            start = round_index * args.batches
            stream = data_lib.train_stream(data, size, channels, args.batch_size, 0, augmentation,
                                           start_step=start, end_step=start + args.batches)
            began = time.perf_counter()
            if pipeline == "python":
                for index in range(args.batches):
                    stream[index]
            else:
                for _ in stream:
                    pass
            times.append(time.perf_counter() - began)
            if pipeline == "python":  # the same batches again: decoded images are kept
                began = time.perf_counter()
                for index in range(args.batches):
                    stream[index]
                again.append(time.perf_counter() - began)
        rate = args.batch_size * args.batches / statistics.median(times)
        rows.append((f"{pipeline} input" + (", first read" if again else ""), rate))
        if again:
            rows.append((f"{pipeline} input, images kept decoded",
                         args.batch_size * args.batches / statistics.median(again)))

    keras.utils.set_random_seed(0)
    keras.config.set_dtype_policy(args.mixed_precision)
    model = compile_like_fit(ViT(image_size=args.image_size, num_channels=channels, num_classes=10,
                                 **model_options))
    rng = np.random.default_rng(0)
    # on the device once, as the input pipelines hand batches to fit
    x = keras.ops.convert_to_tensor(
        rng.uniform(-1, 1, (args.batch_size, *size, channels)).astype("float32"))
    y = keras.ops.convert_to_tensor(rng.integers(0, 10, (args.batch_size,)))
    for _ in range(2):
        model.train_on_batch(x, y)  # compile and warm up
    steps = []
    for _ in range(args.rounds):
        began = time.perf_counter()
        for _ in range(3):
            model.train_on_batch(x, y)
        steps.append((time.perf_counter() - began) / 3)
    step_rate = args.batch_size / statistics.median(steps)

    cores = usable_cores()
    print(f"{keras.backend.backend()} backend, {args.dataset} at {size[0]}x{size[1]}, batch "
          f"{args.batch_size}, recipe {args.recipe}, {cores} CPU core(s) for this process; "
          f"median of {args.rounds} rounds\n")
    print("| what | images/s | vs the training step | input's share of one core's time |\n"
          "|---|---|---|---|")
    for name, rate in rows:
        print(f"| {name} | {rate:,.0f} | {rate / step_rate:.1f}x | "
              f"{input_share(rate, step_rate):.0%} |")
    print(f"| training step ({model_name}, {args.mixed_precision}) | {step_rate:,.0f} | 1.0x "
          "| |")


def input_share(input_rate, step_rate):
    """The input's share of the time when input and step take turns on one core.

    Reading an image takes 1/input_rate seconds and training on it 1/step_rate, so the
    input's share of the two is step_rate / (input_rate + step_rate): the part of a
    run's time its one core spends feeding it.
    """
    return step_rate / (input_rate + step_rate)


if __name__ == "__main__":
    main()
