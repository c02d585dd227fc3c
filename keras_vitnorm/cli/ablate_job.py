"""`keras-vitnorm ablate-job`: one run of a study's plan, `keras_vitnorm.study.plan.run_job`."""

from keras_vitnorm.cli.arguments import add_verbose

NAME = "ablate-job"
EXTRA = "study"
INTERRUPTED = "Run the same command to continue."
HELP = "train one run of a study's plan (a line of <study>/plan/commands.txt)"
DESCRIPTION = ("Train, resume or skip (if finished) the one study run that a job file "
               "of `ablate --plan` describes. Safe to run again at any time. See docs/study.md.")


def add_arguments(parser):
    parser.add_argument("job_file", metavar="JOB_FILE", help="a <study>/plan/*.job.json file")
    add_verbose(parser, "0 silent, 1 progress bar, 2 one line per epoch (default)", default=2)


def run(args):
    from keras_vitnorm.study.plan import run_job

    row = run_job(args.job_file, verbose=args.verbose)
    if args.verbose:
        print(f"[{row['group']}] {row['variant']} seed {row['seed']}: {row['status']}, test "
              f"accuracy {row['test_accuracy']}")
