"""`keras-vitnorm ablate-job`: one run of a study's plan, `keras_vitnorm.study.plan.run_job`."""

from keras_vitnorm.cli.arguments import LOGS_NOTE

NAME = "ablate-job"
EXTRA = "study"
INTERRUPTED = "Run the same command to continue."


def add_parser(commands):
    parser = commands.add_parser(
        NAME,
        allow_abbrev=False,
        help="train one run of a study's plan (a line of <study>/plan/commands.txt)",
        description="Train, resume or skip (if finished) the one study run that a job file "
        "of `ablate --plan` describes. Safe to run again at any time. See docs/study.md.",
    )
    parser.add_argument("job_file", metavar="JOB_FILE", help="a <study>/plan/*.job.json file")
    parser.add_argument("--verbose", type=int, choices=(0, 1, 2), default=2,
                        help="0 silent, 1 progress bar, 2 one line per epoch (default)"
                        + LOGS_NOTE)


def run(args):
    from keras_vitnorm.study.plan import run_job

    row = run_job(args.job_file, verbose=args.verbose)
    if args.verbose:
        print(f"[{row['group']}] {row['variant']} seed {row['seed']}: {row['status']}, test "
              f"accuracy {row['test_accuracy']}")
