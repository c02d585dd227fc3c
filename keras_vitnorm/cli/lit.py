"""`keras-vitnorm lit`: contrastive image-text training per seed, `training.train_lit`."""

import argparse
import dataclasses

from keras_vitnorm.cli.arguments import add_seed_run_arguments
from keras_vitnorm.cli.arguments import one_of
from keras_vitnorm.cli.arguments import parse_setting
from keras_vitnorm.cli.seeds import run_seeds

NAME = "lit"
EXTRA = "study"
INTERRUPTED = "Finished seeds are kept and the same command runs the rest."

EXAMPLES = """examples:
  keras-vitnorm lit --preset runs/plain/preset --seeds 0 1 2 --output-dir runs/lit-plain
  keras-vitnorm lit --preset runs/dpn/preset --dataset folder:/data/cifar10 --loss sigmoid \\
      --output-dir runs/lit-dpn

The image tower is frozen (LiT) unless --trainable-image-tower; zero-shot accuracy is
scored on the test split with prompt templates held out of training. See
docs/contrastive.md.
"""


def add_parser(commands):
    parser = commands.add_parser(
        NAME,
        allow_abbrev=False,
        help="contrastive image-text training with a frozen ViT tower (LiT), zero-shot accuracy",
        description="Train a text transformer from scratch against a ViT image tower (frozen by "
        "default) on a classification dataset's images captioned from templates, with the "
        "softmax or sigmoid contrastive loss and a learned temperature; report zero-shot "
        "test accuracy with held-out prompt templates per seed and the mean with a 95% CI.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    parser.add_argument("--set", dest="model_set", action="append", type=parse_setting, default=[],
                        metavar="KEY=VALUE",
                        help="image tower ViT overrides (for a built-in preset)")
    text = parser.add_argument_group("text tower and embedding")
    text.add_argument("--embed-dim", type=int, default=128)
    text.add_argument("--max-length", type=int, default=16)
    text.add_argument("--text-width", type=int, default=128)
    text.add_argument("--text-depth", type=int, default=2)
    text.add_argument("--text-heads", type=int, default=4)
    text.add_argument("--text-mlp-dim", type=int, default=512)
    schedule = parser.add_argument_group("optimization")
    schedule.add_argument("--epochs", type=int, default=10)
    schedule.add_argument("--batch-size", type=int, default=64)
    schedule.add_argument("--lr", "--learning-rate", dest="learning_rate", type=float, default=1e-3)
    schedule.add_argument("--warmup-steps", type=int, default=50)
    schedule.add_argument("--weight-decay", type=float, default=0.05)
    schedule.add_argument("--seeds", nargs="+", type=int, default=[0])
    add_seed_run_arguments(parser)


def lit_config(args):
    """The `LiTConfig` of the parsed arguments (the seed is each run's)."""
    from keras_vitnorm.training.contrastive import LiTConfig

    return LiTConfig(
        dataset=args.dataset, preset=args.preset, image_size=args.image_size,
        model=dict(args.model_set), freeze_image_tower=args.freeze_image_tower, loss=args.loss,
        embed_dim=args.embed_dim, max_length=args.max_length, text_width=args.text_width,
        text_depth=args.text_depth, text_heads=args.text_heads, text_mlp_dim=args.text_mlp_dim,
        train_examples=args.train_examples, epochs=args.epochs, batch_size=args.batch_size,
        learning_rate=args.learning_rate, warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
    )


def run(args):
    from keras_vitnorm.training.contrastive import train_lit

    config = lit_config(args)
    run_seeds(
        args,
        lambda seed, run_dir: train_lit(dataclasses.replace(config, seed=seed), run_dir,
                                        overwrite=args.overwrite, verbose=args.verbose,
                                        take_over_lock=args.take_over_lock),
        "zero_shot_test_accuracy",
        lambda m: (f"zero-shot test accuracy {m['zero_shot_test_accuracy']:.4f} (held-out "
                   f"templates), {m['zero_shot_test_accuracy_train_templates']:.4f} (training "
                   "templates)"),
    )
