"""`keras-vitnorm evaluate`: a saved model scored again, `keras_vitnorm.training.evaluate`."""

import json

from keras_vitnorm.cli.arguments import add_verbose
from keras_vitnorm.cli.arguments import one_of

NAME = "evaluate"
EXTRA = "train"
INTERRUPTED = "Nothing was written."
HELP = "score a saved model on a dataset split"
DESCRIPTION = "Score a preset directory (or a run directory from `train`) on a dataset."


def add_arguments(parser):
    parser.add_argument("path", help="preset directory, or run directory (uses its preset/)")
    parser.add_argument("--dataset", help="digits | tfds:<name> | folder:<path> "
                        "(default: the run's dataset)")
    parser.add_argument("--split", **one_of(("test", "validation", "train")), default="test")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--val-fraction", type=float, help="as used in training")
    parser.add_argument("--data-dir")
    parser.add_argument("--manual-dir")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    add_verbose(parser, "0 no progress bar, 1 progress bar (default), 2 one line")


def run(args):
    from keras_vitnorm.training import evaluate

    result = evaluate(args.path, args.dataset, args.split, args.batch_size, args.val_fraction,
                      args.data_dir, args.manual_dir, verbose=0 if args.json else args.verbose)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['dataset']} {result['split']}: accuracy {result['accuracy']:.4f}, "
              f"loss {result['loss']:.4f} on {result['examples']} images")
