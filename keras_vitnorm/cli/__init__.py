"""The `keras-vitnorm` command: `train`, `ablate`, `ablate-job`, `fewshot`, `evaluate`,
`convert`, `segment`, `vtab` and `lit`, one module each (`add_parser`, `run`); `errors`
maps what ends a command to its exit status. A bad argument is one line
(`arguments.Parser`) that names a close spelling of a misspelt choice
(`arguments.one_of`). The backend is `KERAS_BACKEND`'s, as for any Keras program.
"""

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
    parser = Parser(
        prog="keras-vitnorm",
        allow_abbrev=False,
        description="Train and evaluate Vision Transformers whose normalization is a config "
        "choice.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add_parser(commands)
    return parser


def main(argv=None, hide_framework_logs=False):
    """Runs the command line; returns the exit status (`keras_vitnorm.cli.errors`).

    With `hide_framework_logs` (the console command), the frameworks' own log lines
    are kept off stderr unless `--verbose 2` (`keras_vitnorm.framework_logs`).
    """
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
    """Entry point of the console script, `python -m keras_vitnorm` and `recipes/`: runs
    `argv` and exits with its status. A command that trains first keeps freed memory
    (`host_memory.retain_freed_memory`); a SIGTERM after the command ended leaves its
    status as it is.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in TRAINING_COMMANDS:
        from keras_vitnorm.host_memory import retain_freed_memory

        retain_freed_memory()
    status = main(argv, hide_framework_logs=True)
    # The command's work is done and its status decided: a SIGTERM while the interpreter
    # and the frameworks shut down (TensorFlow's take a while) must not end a finished
    # run as killed (-15), which a scheduler counts as a failure to run again.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(status)
