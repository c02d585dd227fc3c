"""RandAugment in the tf.data training stream, with each histogram count of Equalization.

    KERAS_BACKEND=jax python benchmarks/bench_randaugment.py --dataset folder:/data/cifar10

Under the running Keras backend, builds the training stream with RandAugment
(`--randaugment-ops` operations per image) and times, in alternating rounds, each
way of counting Equalization's histogram (`--counts`):

- `bincount`: the stream as training builds it, the fast path `bincount_histogram` on
  (`keras_vitnorm.training.data.augmentation.count_histograms_with_bincount`);
- `keras`: that fast path off, the layer as Keras 3.15 makes it, which under JAX
  counts with a Python loop over the 256 bins even inside tf.data.

For each: the seconds to build the stream and read its first batch (tf.data builds
the graph then), and images per second over the next `--batches` batches; the median
over `--rounds` rounds, and each against `bincount`.
"""

import argparse
import contextlib
import statistics
import time

from _common import check_positive_ints

COUNTS = ("bincount", "keras")


def time_stream(data, size, batch_size, batches, ops, count):
    """`(seconds to the first batch, images per second after it)` of one stream."""
    from keras_vitnorm.ops import fast_paths
    from keras_vitnorm.training import data as data_lib

    augmentation = data_lib.Augmentation(crop="pad", crop_padding=4, flip=True, randaugment_ops=ops)
    keep_keras_count = (fast_paths(False, ["bincount_histogram"]) if count == "keras"
                        else contextlib.nullcontext())
    began = time.perf_counter()
    with keep_keras_count:
        stream = data_lib.train_stream(data, size, 3, batch_size, 0, augmentation, end_step=batches + 1)
    iterator = iter(stream)
    next(iterator)
    first = time.perf_counter() - began
    began = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return first, batch_size * batches / (time.perf_counter() - began)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="digits", help="digits or folder:<path>; streamed as RGB")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--batches", type=int, default=10, help="batches read after the first, per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--randaugment-ops", type=int, default=2)
    parser.add_argument("--counts", nargs="+", choices=COUNTS, default=list(COUNTS),
                        help="histogram counts to time (default: both)")
    args = parser.parse_args(argv)
    check_positive_ints(parser, args, ("image_size", "batch_size", "batches", "rounds", "randaugment_ops"))

    import keras

    from keras_vitnorm.training import data as data_lib

    data = data_lib.load_dataset(args.dataset, pipeline="tf.data")
    size = (args.image_size, args.image_size)
    results = {count: [] for count in args.counts}
    for _ in range(args.rounds):
        for count in args.counts:
            results[count].append(time_stream(data, size, args.batch_size, args.batches,
                                              args.randaugment_ops, count))

    print(f"{keras.backend.backend()} backend, {args.dataset} at {size[0]}x{size[1]}, batch "
          f"{args.batch_size}, RandAugment with {args.randaugment_ops} operations; "
          f"median of {args.rounds} rounds\n")
    print("| histogram count | to the first batch (s) | images/s after it | first batch vs bincount "
          "| images/s vs bincount |\n|---|---|---|---|---|")
    medians = {count: tuple(statistics.median(column) for column in zip(*rounds))
               for count, rounds in results.items()}
    base = medians.get("bincount")
    for count, (first, rate) in medians.items():
        against = f"{first / base[0]:.2f}x | {rate / base[1]:.2f}x" if base else "n/a | n/a"
        print(f"| {count} | {first:.2f} | {rate:,.0f} | {against} |")


if __name__ == "__main__":
    main()
