"""`keras-vitnorm segment`: a linear segmentation head per seed, `training.train_segmenter`."""

import argparse
import dataclasses

from keras_vitnorm.choices import PRECISIONS
from keras_vitnorm.cli.arguments import add_model_overrides
from keras_vitnorm.cli.arguments import add_seed_run_arguments
from keras_vitnorm.cli.arguments import model_overrides
from keras_vitnorm.cli.arguments import one_of
from keras_vitnorm.cli.seeds import run_seeds

NAME = "segment"
EXTRA = "study"
INTERRUPTED = "Finished seeds are kept and the same command runs the rest."

EXAMPLES = """examples:
  keras-vitnorm segment --stem dual_patchnorm --seeds 0 1 2 --output-dir runs/seg-dpn
  keras-vitnorm segment --dataset folder:/data/scenes --num-classes 5 --preset s16_dpn \\
      --image-size 224 --output-dir runs/scenes

The default dataset, digit_scenes, is composed offline from scikit-learn's digits; see
docs/segmentation.md.
"""


def add_parser(commands):
    parser = commands.add_parser(
        NAME,
        allow_abbrev=False,
        help="train a ViT with a linear segmentation head (mean IoU), one run per seed",
        description="Put a linear per-patch head on a ViT encoder (any preset or checkpoint), "
        "upsample its logits to the pixels, train with per-pixel cross-entropy through "
        "model.fit and report the test mean IoU of each seed and their mean with a 95% CI.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dataset", default="digit_scenes",
                        help="digit_scenes (default, offline) | tfds:<name> | folder:<path>")
    parser.add_argument("--num-classes", type=int,
                        help="pixel classes (tfds and folder datasets)")
    parser.add_argument("--preset", default="ti16",
                        help="encoder: preset name, preset directory or checkpoint (default ti16)")
    parser.add_argument("--scenes", type=int, nargs=3, default=(2000, 400, 400),
                        metavar=("TRAIN", "VAL", "TEST"),
                        help="digit_scenes split sizes (default 2000 400 400)")
    model = parser.add_argument_group("model overrides (on top of the preset)")
    add_model_overrides(model, qk_norm=False, set_help="any other ViT config value")
    schedule = parser.add_argument_group("optimization")
    schedule.add_argument("--epochs", type=int, default=10)
    schedule.add_argument("--batch-size", type=int, default=32)
    schedule.add_argument("--lr", "--learning-rate", dest="learning_rate", type=float, default=1e-3)
    schedule.add_argument("--warmup-steps", type=int, default=100)
    schedule.add_argument("--weight-decay", type=float, default=0.05)
    schedule.add_argument("--mixed-precision", **one_of(PRECISIONS), default="float32")
    schedule.add_argument("--seeds", nargs="+", type=int, default=[0])
    add_seed_run_arguments(parser)


def segmentation_config(args):
    """The `SegmentationConfig` of the parsed arguments (the seed is each run's)."""
    from keras_vitnorm.training.segmentation import SegmentationConfig

    model = model_overrides(args)
    return SegmentationConfig(
        dataset=args.dataset, preset=args.preset, image_size=model.pop("image_size", None) or 32,
        num_classes=args.num_classes, model=model, epochs=args.epochs, batch_size=args.batch_size,
        learning_rate=args.learning_rate, warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay, mixed_precision=args.mixed_precision,
        scenes=tuple(args.scenes),
    )


def run(args):
    from keras_vitnorm.training.segmentation import train_segmenter
    from keras_vitnorm.training.segmentation_data import load_segmentation_data

    config = segmentation_config(args)
    data = load_segmentation_data(config.dataset, config.image_size, config.num_classes,
                                  config.scenes)
    if args.verbose:
        print(data.describe())
    run_seeds(
        args,
        lambda seed, run_dir: train_segmenter(dataclasses.replace(config, seed=seed), run_dir,
                                              overwrite=args.overwrite, verbose=args.verbose,
                                              data=data, take_over_lock=args.take_over_lock),
        "test_mean_iou",
        lambda m: (f"test mean IoU {m['test_mean_iou']:.4f}, pixel accuracy "
                   f"{m['test_pixel_accuracy']:.4f}"),
    )
