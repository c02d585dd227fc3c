"""`keras-vitnorm segment`: a linear segmentation head per seed, `training.train_segmenter`."""

from keras_vitnorm.cli.arguments import add_model_overrides
from keras_vitnorm.cli.arguments import add_seed_run_arguments
from keras_vitnorm.cli.arguments import model_overrides
from keras_vitnorm.cli.seeds import config_from_args
from keras_vitnorm.cli.seeds import run_seeds

NAME = "segment"
EXTRA = "study"
INTERRUPTED = "Finished seeds are kept and the same command runs the rest."
HELP = "train a ViT with a linear segmentation head (mean IoU), one run per seed"
DESCRIPTION = ("Put a linear per-patch head on a ViT encoder (any preset or checkpoint), "
               "upsample its logits to the pixels, train with per-pixel cross-entropy through "
               "model.fit and report the test mean IoU of each seed and their mean with a 95% CI.")

EXAMPLES = """examples:
  keras-vitnorm segment --stem dual_patchnorm --seeds 0 1 2 --output-dir runs/seg-dpn
  keras-vitnorm segment --dataset folder:/data/scenes --num-classes 5 --preset s16_dpn \\
      --image-size 224 --output-dir runs/scenes

The default dataset, digit_scenes, is composed offline from scikit-learn's digits; see
docs/segmentation.md.
"""


def add_arguments(parser):
    parser.add_argument("--dataset", default="digit_scenes",
                        help="digit_scenes (default, offline) | tfds:<name> | folder:<path>")
    parser.add_argument("--num-classes", type=int, help="pixel classes (tfds and folder datasets)")
    parser.add_argument("--preset", default="ti16",
                        help="encoder: preset name, preset directory or checkpoint (default ti16)")
    parser.add_argument("--scenes", type=int, nargs=3, default=(2000, 400, 400),
                        metavar=("TRAIN", "VAL", "TEST"),
                        help="digit_scenes split sizes (default 2000 400 400)")
    model = parser.add_argument_group("model overrides (on top of the preset)")
    add_model_overrides(model, qk_norm=False, set_help="any other ViT config value")
    add_seed_run_arguments(parser, batch_size=32, warmup_steps=100, precision=True)


def run(args):
    from keras_vitnorm.training.segmentation import SegmentationConfig
    from keras_vitnorm.training.segmentation import train_segmenter
    from keras_vitnorm.training.segmentation_data import load_segmentation_data

    model = model_overrides(args)
    image_size = model.pop("image_size", None) or 32
    config = config_from_args(SegmentationConfig, args, model=model, image_size=image_size,
                              scenes=tuple(args.scenes))
    data = load_segmentation_data(config.dataset, config.image_size, config.num_classes,
                                  config.scenes)
    if args.verbose:
        print(data.describe())
    run_seeds(args, train_segmenter, config, "test_mean_iou",
              lambda m: (f"test mean IoU {m['test_mean_iou']:.4f}, pixel accuracy "
                         f"{m['test_pixel_accuracy']:.4f}"), data=data)
