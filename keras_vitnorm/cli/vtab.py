"""`keras-vitnorm vtab`: the VTAB-1k transfer sweep, `keras_vitnorm.study.vtab.run_vtab`."""

import dataclasses

from keras_vitnorm.cli.arguments import PER_RUN_LEVELS
from keras_vitnorm.cli.arguments import TAKE_OVER_LOCK_HELP
from keras_vitnorm.cli.arguments import add_training_arguments
from keras_vitnorm.cli.arguments import add_verbose
from keras_vitnorm.cli.arguments import train_config_from_args

NAME = "vtab"
EXTRA = "study"
INTERRUPTED = "The same command resumes the sweep."
HELP = "VTAB-1k transfer: fine-tune presets on 1,000 examples per task, rate sweep x seeds"
DESCRIPTION = ("Fine-tune every preset on every dataset with 800 training and 200 validation "
               "examples of its training split (VTAB-1k), at each learning rate and seed; choose "
               "the rate with the best mean validation accuracy and write the test accuracy table "
               "(vtab.md). Rerunning skips finished runs.")

EXAMPLES = """examples:
  keras-vitnorm vtab --presets runs/b16/preset runs/b16_dpn/preset \\
      --datasets tfds:cifar100 tfds:caltech101 tfds:dtd --output-dir runs/vtab
  keras-vitnorm vtab --presets runs/a/preset --datasets digits folder:/data/flowers \\
      --batch-size 64 --steps 300 --image-size 32 --output-dir runs/vtab-cpu

See docs/transfer.md.
"""


def add_arguments(parser):
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--presets", nargs="+", required=True,
                       help="trained models: preset directories or checkpoints")
    sweep.add_argument("--datasets", nargs="+", required=True,
                       help="tfds:<name> | folder:<path> | digits")
    sweep.add_argument("--lrs", dest="learning_rates", nargs="+", type=float,
                       default=[0.001, 0.003, 0.01],
                       help="learning rates swept (default 0.001 0.003 0.01)")
    sweep.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    sweep.add_argument("--output-dir", dest="sweep_dir", required=True, help="sweep directory")
    add_verbose(sweep, PER_RUN_LEVELS)
    sweep.add_argument("--take-over-lock", action="store_true", help=TAKE_OVER_LOCK_HELP)
    sweep.add_argument("--no-tensorboard", dest="tensorboard", action="store_false", default=None,
                       help="do not write TensorBoard logs")
    add_training_arguments(parser)
    parser.set_defaults(recipe="vtab_1k")


def sweep_config(args):
    """The sweep's base `TrainConfig` (first preset and dataset), every dataset checked with it."""
    for flag, value in (("--preset", args.preset), ("--dataset", args.dataset),
                        ("--train-examples", args.train_examples), ("--lr", args.learning_rate),
                        ("--seed", args.seed)):
        if value is not None:
            raise ValueError(f"{flag} is set by the sweep: use --presets, --datasets, --lrs and "
                             "--seeds (800 + 200 examples per task are the protocol).")
    base = train_config_from_args(args, preset=args.presets[0], dataset=args.datasets[0])
    for dataset in args.datasets[1:]:
        dataclasses.replace(base, dataset=dataset).validate()
    return base


def run(args):
    import os

    from keras_vitnorm.study.vtab import run_vtab
    from keras_vitnorm.study.vtab import vtab_table

    rows = run_vtab(sweep_config(args), args.presets, args.datasets, args.sweep_dir,
                    args.learning_rates, args.seeds, verbose=args.verbose,
                    take_over_lock=args.take_over_lock)
    print(vtab_table(rows))
    print(f"written: {os.path.join(args.sweep_dir, 'vtab.md')}, "
          f"{os.path.join(args.sweep_dir, 'vtab_results.csv')}")
