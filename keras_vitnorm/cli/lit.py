"""`keras-vitnorm lit`: contrastive image-text training per seed, `training.train_lit`."""

from keras_vitnorm.cli.arguments import add_seed_run_arguments
from keras_vitnorm.cli.arguments import add_set_option
from keras_vitnorm.cli.arguments import one_of
from keras_vitnorm.cli.seeds import config_from_args
from keras_vitnorm.cli.seeds import run_seeds

NAME = "lit"
EXTRA = "study"
INTERRUPTED = "Finished seeds are kept and the same command runs the rest."
HELP = "contrastive image-text training with a frozen ViT tower (LiT), zero-shot accuracy"
DESCRIPTION = ("Train a text transformer from scratch against a ViT image tower (frozen by "
               "default) on a classification dataset's images captioned from templates, with the "
               "softmax or sigmoid contrastive loss and a learned temperature; report zero-shot "
               "test accuracy with held-out prompt templates per seed and the mean with a 95% CI.")

EXAMPLES = """examples:
  keras-vitnorm lit --preset runs/plain/preset --seeds 0 1 2 --output-dir runs/lit-plain
  keras-vitnorm lit --preset runs/dpn/preset --dataset folder:/data/cifar10 --loss sigmoid \\
      --output-dir runs/lit-dpn

See docs/contrastive.md.
"""


def add_arguments(parser):
    parser.add_argument("--preset", default="ti16",
                        help="image tower: preset directory, checkpoint or name")
    parser.add_argument("--dataset", default="digits",
                        help="digits (default) | tfds:<name> | folder:<path>")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--train-examples", type=int,
                        help="train on this many examples (default: all)")
    parser.add_argument("--trainable-image-tower", dest="freeze_image_tower", action="store_false",
                        help="train the image tower too (default: frozen, as LiT)")
    parser.add_argument("--loss", **one_of(("softmax", "sigmoid")), default="softmax")
    add_set_option(parser, "image tower ViT overrides (for a built-in preset)")
    text = parser.add_argument_group("text tower and embedding")
    text.add_argument("--embed-dim", type=int, default=128)
    text.add_argument("--max-length", type=int, default=16)
    text.add_argument("--text-width", type=int, default=128)
    text.add_argument("--text-depth", type=int, default=2)
    text.add_argument("--text-heads", type=int, default=4)
    text.add_argument("--text-mlp-dim", type=int, default=512)
    add_seed_run_arguments(parser, batch_size=64, warmup_steps=50)


def run(args):
    from keras_vitnorm.training.contrastive import LiTConfig
    from keras_vitnorm.training.contrastive import train_lit

    config = config_from_args(LiTConfig, args, model=dict(args.model_set))
    run_seeds(args, train_lit, config, "zero_shot_test_accuracy",
              lambda m: (f"zero-shot test accuracy {m['zero_shot_test_accuracy']:.4f} (held-out "
                         f"templates), {m['zero_shot_test_accuracy_train_templates']:.4f} "
                         "(training templates)"))
