"""The `keras-vitnorm` command (backend: `KERAS_BACKEND`); `errors` maps how a command ends to
its exit status.

One module per subcommand: `NAME`, `HELP`, `DESCRIPTION`, `EXAMPLES` (if any: the epilog, as
written); `EXTRA`, the extra it needs (`None`: none); `INTERRUPTED` or `interrupted(args, stop)`,
the advice after a signal stopped it; `add_arguments(parser)` and `run(args)`.
"""

import argparse
import signal
import sys

from keras_vitnorm.cli import ablate
from keras_vitnorm.cli import ablate_job
from keras_vitnorm.cli import convert
from keras_vitnorm.cli import evaluate
from keras_vitnorm.cli import fewshot
from keras_vitnorm.cli import lit
from keras_vitnorm.cli import segment
from keras_vitnorm.cli import train
from keras_vitnorm.cli import vtab
from keras_vitnorm.cli.arguments import Parser
from keras_vitnorm.cli.arguments import train_config_from_args
from keras_vitnorm.cli.errors import run_command

__all__ = ["COMMANDS", "build_parser", "console", "main", "train_config_from_args"]

#: The commands, in the order `--help` lists them.
COMMANDS = {command.NAME: command for command in (train, ablate, ablate_job, fewshot, evaluate,
                                                   convert, vtab, lit, segment)}
#: The commands that train: long CPU work whose step time the allocator setting changes.
TRAINING_COMMANDS = ("train", "ablate", "ablate-job", "segment", "vtab", "lit")


def build_parser():
    parser = Parser(prog="keras-vitnorm", allow_abbrev=False, description="Train and evaluate "
                    "Vision Transformers whose normalization is a config choice.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        examples = getattr(command, "EXAMPLES", None)
        command.add_arguments(commands.add_parser(
            command.NAME, allow_abbrev=False, help=command.HELP,
            description=command.DESCRIPTION, epilog=examples,
            formatter_class=(argparse.RawDescriptionHelpFormatter if examples
                             else argparse.HelpFormatter)))
    return parser


def main(argv=None, hide_framework_logs=False):
    """Runs the command line; returns the exit status. `hide_framework_logs` keeps the
    frameworks' log lines off stderr unless `--verbose 2`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # what the advice after an interrupt repeats
    command = COMMANDS[args.command]
    if hide_framework_logs and args.verbose < 2:
        from keras_vitnorm import framework_logs

        with framework_logs.hidden():
            return run_command(command, args)
    return run_command(command, args)


def console(argv=None):
    """Console-script entry point: runs `argv` and exits with its status; a training command
    first keeps freed memory (`host_memory.retain_freed_memory`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in TRAINING_COMMANDS:
        from keras_vitnorm.host_memory import retain_freed_memory

        retain_freed_memory()
    status = main(argv, hide_framework_logs=True)
    # The status is decided: a SIGTERM during shutdown must not turn a finished run into a
    # killed one (-15), which a scheduler would run again.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(status)
