"""SIGTERM and SIGINT end a training run at a step it resumes from: while steps run
(`StopRequest.deferred`) `StopOnSignal` acts at the step's end, with a checkpoint;
elsewhere `RunInterrupted` is raised at once. docs/training.md, "Interrupted runs".
"""

import contextlib
import os
import signal
import sys
import threading

import keras

from keras_vitnorm import stop_signals

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def signal_name(number):
    return signal.Signals(number).name


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by a signal: a `KeyboardInterrupt`, so `except Exception` lets it
    through. Has `signal`, `exit_status` (`128 + signal`), `run_dir` (`None` before the
    run set it up) and `resumable` (whether `--resume` continues it)."""

    def __init__(self, signal_number):
        self.signal = signal_number
        self.run_dir, self.resumable = None, False
        super().__init__(f"Stopped by {signal_name(signal_number)}.")

    @property
    def exit_status(self):
        return 128 + self.signal

    def describe(self, message, run_dir=None, resumable=False):
        self.args = (message,)
        self.run_dir, self.resumable = run_dir, resumable
        return self


class StopRequest:
    """Turns SIGTERM and SIGINT into a request to stop, while `listening()`; `signal` is
    the first one received. Outside the main thread the signals keep their handlers."""

    def __init__(self, say=None):
        self.signal = None
        self.say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self._deferred = False
        self._raised = False

    def _handle(self, number, frame):
        first = self.signal is None
        if first:
            self.signal = number
        if not self._deferred:  # every time: a raise that Python dropped comes back here
            self._raised = True
            raise RunInterrupted(self.signal)
        if first:
            self.say(f"{signal_name(number)} received: stopping at the end of this step, with "
                     "a checkpoint of it" + (" (Ctrl-C again stops at once)."
                                             if number == signal.SIGINT else "."))
        elif number == signal.SIGINT:  # Ctrl-C again: stop now
            self.say("Stopping at once: the last checkpoint on disk is whole.")
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)

    def stop_behind(self, error):
        """The `RunInterrupted` that `error` stands for, or `None`: once the handler has
        raised, an error in its place is the stop, changed by the code it landed in."""
        if self._raised and not isinstance(error, RunInterrupted):
            stop_signals.acted_on()
            return RunInterrupted(self.signal)
        return None

    def check(self):
        """A safe point: raises `RunInterrupted` if a signal came (even one dropped)."""
        if self.signal is not None:
            stop_signals.acted_on()
            raise RunInterrupted(self.signal)

    @contextlib.contextmanager
    def listening(self):
        """Holds the handlers; the previous ones come back on exit."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {number: signal.signal(number, self._handle) for number in SIGNALS}
        try:
            with stop_signals.redelivered():
                yield self
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    @contextlib.contextmanager
    def deferred(self):
        """While training steps run: a signal waits for the step's end (`StopOnSignal`);
        a pending request raises as the block begins or ends."""
        self.check()
        self._deferred = True
        try:
            yield self
        finally:
            self._deferred = False
        self.check()


class StopOnSignal(keras.callbacks.Callback):
    """Ends `fit` at a step's end once `request` holds a signal: saves `checkpoint` (if
    any) and raises `RunInterrupted`. Last of the callbacks, so the step's others have
    run; with `agree` (as `StopOnNaN`'s) the processes stop at the same step."""

    def __init__(self, request, checkpoint=None, agree=None):
        super().__init__()
        self.request = request
        self.checkpoint = checkpoint
        self.agree = agree

    def _stop_if_requested(self, save=True):
        requested = self.request.signal is not None
        if self.agree is not None:
            requested = self.agree(requested)
        if requested:
            if save and self.checkpoint is not None:
                self.checkpoint.save_if_new()
            raise RunInterrupted(self.request.signal or signal.SIGTERM)

    def on_train_begin(self, logs=None):
        # Before the first step compiles: the state is the last checkpoint's (or step 0).
        self._stop_if_requested(save=False)

    def on_train_batch_end(self, batch, logs=None):
        self._stop_if_requested()

    def on_epoch_end(self, epoch, logs=None):
        self._stop_if_requested()  # the epoch's checkpoint is written already
