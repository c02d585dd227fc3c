"""`keras-vitnorm fewshot`: few-shot linear transfer, `study.fewshot.write_fewshot`."""

from keras_vitnorm.choices import INPUT_PIPELINES
from keras_vitnorm.cli.arguments import TAKE_OVER_LOCK_HELP
from keras_vitnorm.cli.arguments import add_verbose
from keras_vitnorm.cli.arguments import one_of

NAME = "fewshot"
EXTRA = "study"
INTERRUPTED = "Rerun the same command: the runs already scored are kept."
HELP = "few-shot linear transfer of a study's trained models (big_vision's evaluator)"
DESCRIPTION = ("Score every completed run of a study by few-shot linear transfer to a dataset: a "
               "regularized least-squares classifier on the model's pre-logit features, fitted on "
               "a few training images per class, scored on the test split. Writes "
               "<study>/<group>_fewshot.md and <study>/fewshot.csv; each run's result is kept in "
               "its analysis.json, so a rerun computes only what it lacks.")

EXAMPLES = """examples:
  keras-vitnorm fewshot studies/imagenette --dataset folder:/data/cifar10
  keras-vitnorm fewshot studies/digits --dataset digits --shots 5 10 --draws 3 \\
      --test-examples 200

See docs/study.md.
"""


def add_arguments(parser):
    parser.add_argument("study_dir", metavar="STUDY_DIR",
                        help="a study directory (its results.csv names the runs)")
    parser.add_argument("--dataset", required=True,
                        help="the transfer dataset: digits | folder:<path>")
    parser.add_argument("--shots", nargs="+", type=int, default=[10, 25],
                        help="training images per class of each fit (default 10 25)")
    parser.add_argument("--draws", type=int, default=5,
                        help="draws of the training images per shot count, draw d with seed d "
                        "(default 5)")
    parser.add_argument("--test-examples", type=int, metavar="N",
                        help="score on a class-stratified subset of N test images (default: "
                        "the whole test split)")
    parser.add_argument("--batch-size", type=int, default=256,
                        help="images per forward pass (default 256)")
    parser.add_argument("--input-pipeline", **one_of(INPUT_PIPELINES), default="auto",
                        help="tf.data, or python (no TensorFlow); auto (default): tf.data where "
                        "TensorFlow is installed")
    add_verbose(parser, "0 silent, 1 a line and a progress bar per run computed (default)")
    parser.add_argument("--take-over-lock", action="store_true", help=TAKE_OVER_LOCK_HELP)


def run(args):
    import os

    from keras_vitnorm.study.fewshot import write_fewshot

    tables = write_fewshot(args.study_dir, args.dataset, args.shots, args.draws,
                           args.test_examples, args.batch_size, args.input_pipeline,
                           verbose=args.verbose, take_over_lock=args.take_over_lock)
    for group, table in tables.items():
        print(f"\n{group}\n{table}")
    written = [os.path.join(args.study_dir, f"{group}_fewshot.md") for group in tables]
    print("written: " + ", ".join([*written, os.path.join(args.study_dir, "fewshot.csv")]))
