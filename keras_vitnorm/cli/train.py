"""`keras-vitnorm train`: one training run, `keras_vitnorm.training.train`."""

import shlex

from keras_vitnorm.choices import DISTRIBUTIONS
from keras_vitnorm.cli.arguments import PROGRESS_LEVELS
from keras_vitnorm.cli.arguments import TAKE_OVER_LOCK_HELP
from keras_vitnorm.cli.arguments import add_training_arguments
from keras_vitnorm.cli.arguments import add_verbose
from keras_vitnorm.cli.arguments import one_of
from keras_vitnorm.cli.arguments import train_config_from_args

NAME = "train"
EXTRA = "train"
HELP = "train a ViT (default: a small pre-LN ViT on the bundled digits)"
DESCRIPTION = "Train a ViT preset on a dataset with model.fit."

EXAMPLES = """examples:
  keras-vitnorm train                                  # small pre-LN ViT on digits (default recipe)
  keras-vitnorm train --stem dual_patchnorm --norm rmsnorm   # same recipe, other norms
  keras-vitnorm train --dataset tfds:cifar10 --image-size 32 --epochs 100 --flip
  keras-vitnorm train --dataset folder:/data/flowers --preset s16_dpn --image-size 224 \\
      --patch-size 16 --width 384 --mlp-dim 1536 --depth 12   # S/16 as it is: the default
                                        # recipe cuts any preset to its small size
  keras-vitnorm train --recipe augreg_i1k --manual-dir ~/imagenet --distribute
  keras-vitnorm train --recipe finetune_384 --preset runs/b16/preset --manual-dir ~/imagenet
  keras-vitnorm train --output-dir runs/a --resume      # continue an interrupted run
  keras-vitnorm train --resume         # continue the latest unfinished run of these settings

Settings not given here come from the recipe (--recipe); see docs/training.md.
The Keras backend comes from KERAS_BACKEND (jax, tensorflow or torch).
"""


def add_arguments(parser):
    add_training_arguments(parser)
    run = parser.add_argument_group("run")
    run.add_argument("--output-dir", help="run directory (default runs/<preset>-<dataset>-<time>)")
    overwrite = run.add_mutually_exclusive_group()
    overwrite.add_argument("--resume", action="store_true",
                           help="continue the interrupted run in --output-dir (default: the latest "
                           "unfinished run of these settings in runs/)")
    overwrite.add_argument("--overwrite", action="store_true",
                           help="replace the run in --output-dir and start again (the old "
                           "run is kept aside until the new one's first checkpoint)")
    run.add_argument("--take-over-lock", action="store_true", help=TAKE_OVER_LOCK_HELP)
    run.add_argument("--backup-every", type=int,
                     help="steps between mid-epoch backups (default: each epoch end)")
    run.add_argument("--shuffle-buffer", type=int,
                     help="tf.data shuffle buffer size (the python pipeline shuffles whole passes)")
    run.add_argument("--distribute", nargs="?", const="data", **one_of(DISTRIBUTIONS), default=None,
                     help="data: data-parallel over all local devices (JAX, TensorFlow), or over "
                     "the processes torchrun started (PyTorch); the default when the flag is given "
                     "alone. fsdp: also shard every block kernel and its optimizer state over the "
                     "devices (JAX)")
    run.add_argument("--no-tensorboard", dest="tensorboard", action="store_false", default=None,
                     help="do not write TensorBoard logs")
    run.add_argument("--track", choices=("mlflow",), help="mlflow: log the settings, each epoch's "
                     "and the final metrics to MLflow (MLFLOW_TRACKING_URI, default ./mlruns); a "
                     "resumed run continues its MLflow run")
    add_verbose(run, PROGRESS_LEVELS)


def interrupted(args, stop):
    """The advice after a signal stopped the run: the command that continues it."""
    if not getattr(stop, "resumable", False):
        return "Nothing was trained: run the same command again."
    argv = list(args.argv)
    if not args.resume:
        argv.append("--resume")
    if not args.output_dir:
        argv += ["--output-dir", stop.run_dir]
    return f"Continue it with: keras-vitnorm {shlex.join(argv)}"


def run(args):
    from keras_vitnorm.training import train

    metrics = train(train_config_from_args(args), resume=args.resume, overwrite=args.overwrite,
                    verbose=args.verbose, take_over_lock=args.take_over_lock,
                    track={} if args.track == "mlflow" else None)
    if args.verbose:
        print(f"metrics: test_accuracy={metrics['test_accuracy']:.4f} "
              f"val_accuracy={metrics['val_accuracy']:.4f}")
