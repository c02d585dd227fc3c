"""How a command ends: the one mapping from an error to its exit status (docs/training.md) and
message, and the check that a command's extra is installed."""

import contextlib
import importlib.util
import os
import signal
import sys
import threading

from keras_vitnorm import stop_signals

#: `(pip name, module)` of the packages every run of an extra's commands imports (an extra
#: includes `train`'s); tensorflow-datasets is checked where a `tfds:` dataset is read.
EXTRAS = {
    "train": (("scikit-learn", "sklearn"), ("pillow", "PIL"), ("tensorboard", "tensorboard")),
    "study": (("matplotlib", "matplotlib"), ("scipy", "scipy")),
}

#: `(module, class name, exit status)`, the first match deciding; a module never imported
#: cannot have raised, so none is imported to check (`convert` runs without the lab).
EXIT_STATUSES = (
    ("keras_vitnorm.training.fit_loop", "TrainingDiverged", 3),
    ("keras_vitnorm.study.workers", "RunsFailed", None),  # 4 if every run failed to write, else 1
    ("keras_vitnorm.training.run_files", "StorageError", 4),
    ("keras_vitnorm.training.run_files", "LockedError", 2),
    ("builtins", "ValueError", 2),
    ("builtins", "OSError", 2),  # FileExistsError included
    ("builtins", "ImportError", 2),  # a package to install, named in the message
)

#: The Keras backends; each is an extra of the package of the same name.
BACKENDS = ("jax", "tensorflow", "torch")


def missing_backend(error):
    """The message for `error` if it is Keras' backend that is not installed, else `None`."""
    name = (getattr(error, "name", None) or "").split(".")[0]
    if not isinstance(error, ModuleNotFoundError) or name not in BACKENDS:
        return None
    keras = sys.modules.get("keras")  # absent where importing it failed on its backend
    chosen = keras.config.backend() if hasattr(keras, "config") else os.environ.get("KERAS_BACKEND")
    if chosen not in (None, name):
        return None  # a module other than the backend (TensorFlow for tf.data under JAX)
    default = "" if os.environ.get("KERAS_BACKEND") else ", the default"
    return (f"Keras' backend {name!r} is not installed (KERAS_BACKEND={name}{default}). Install "
            f"it with pip install 'keras-vitnorm[{name}]', or another one "
            f"({', '.join(BACKENDS)}) and set KERAS_BACKEND to it.")


def fail(command, message, status=2):
    """Prints `keras-vitnorm <command>: error: <message>` to stderr; returns `status`."""
    print(f"keras-vitnorm {command}: error: {message}", file=sys.stderr)
    return status


def exit_status(error):
    """The exit status `error` ends a command with, or `None` for a bug (traceback shown)."""
    for module, name, status in EXIT_STATUSES:
        kind = getattr(sys.modules.get(module), name, None)
        if kind is not None and isinstance(error, kind):
            if status is None:  # RunsFailed: each failed run's own status
                from keras_vitnorm.study.workers import STORAGE_EXIT_CODE

                codes = {code for _, code in error.failures}
                return STORAGE_EXIT_CODE if codes == {STORAGE_EXIT_CODE} else 1
            return status
    return None


def missing_packages(extra):
    """The pip names of the packages of `extra` (and of `train`) not installed."""
    return [package for part in dict.fromkeys(("train", extra)) for package, module in EXTRAS[part]
            if importlib.util.find_spec(module) is None]


class Terminated(KeyboardInterrupt):
    """SIGTERM received by a command outside a training run's own handling of it."""

    exit_status = 128 + signal.SIGTERM
    signal = signal.SIGTERM

    def __init__(self):
        super().__init__("Stopped by SIGTERM.")


@contextlib.contextmanager
def signals_raise(received):
    """SIGTERM raises `Terminated` and SIGINT `KeyboardInterrupt`, each number appended to
    `received` first, so that a stop the command caught is still known; one that Python dropped
    in a GC callback is raised again (`keras_vitnorm.stop_signals`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raised(number, frame):
        received.append(number)
        raise Terminated() if number == signal.SIGTERM else KeyboardInterrupt()

    previous = {number: signal.signal(number, raised) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        with stop_signals.redelivered():
            yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def interrupted_message(command, args, error):
    """What a command stopped by a signal prints: what stopped it and how to continue."""
    advice = (command.interrupted(args, error) if hasattr(command, "interrupted")
              else command.INTERRUPTED)
    return f"{str(error) or 'Interrupted.'} {advice}"


def run_command(command, args):
    """Runs `command.run(args)` (a module of `keras_vitnorm.cli`); returns the exit status."""
    missing = command.EXTRA and missing_packages(command.EXTRA)
    if missing:
        return fail(command.NAME, f"this command needs the {command.EXTRA!r} extra: pip install "
                    f"'keras-vitnorm[{command.EXTRA}]' (missing: {', '.join(missing)}).")
    received = []
    try:
        with signals_raise(received):
            command.run(args)
    except KeyboardInterrupt as error:  # a signal: Ctrl-C, a scheduler's SIGTERM
        return fail(command.NAME, interrupted_message(command, args, error),
                    getattr(error, "exit_status", 128 + signal.SIGINT))
    except Exception as error:
        if received:  # the stop, changed on its way out by the code it landed in (NumPy's
            # import reports one as "Importing the numpy C-extensions failed")
            stop = Terminated() if received[0] == signal.SIGTERM else KeyboardInterrupt()
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            raised = type(error).__name__ + (f": {lines[0]}" if lines else "")
            stop.args = (f"{stop} (It landed in code that raised {raised} instead.)",)
            return fail(command.NAME, interrupted_message(command, args, stop), 128 + received[0])
        status = exit_status(error)
        if status is None:
            raise
        return fail(command.NAME, missing_backend(error) or str(error), status)
    if received:  # its exception was caught on the way (a framework's bare `except`)
        name = signal.Signals(received[0]).name
        return fail(command.NAME, f"{name} received while the command ran, where it could not "
                    "stop it: the command ran to its end first.", 128 + received[0])
    return 0
