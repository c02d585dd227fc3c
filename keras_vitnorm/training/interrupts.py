"""SIGTERM and SIGINT end a training run at a step it resumes from.

While training steps run (`StopRequest.deferred`), a signal only records the request, and
`StopOnSignal` acts on it at the end of the step under way, with a checkpoint of that step:
a KeyboardInterrupt inside a step is not reliable (under JAX, Keras swallows it; raised
while XLA compiles, the process crashes as it exits). Elsewhere the signal raises
`RunInterrupted` at once (sent again where Python drops it: `keras_vitnorm.stop_signals`).
A second Ctrl-C stops at once. docs/training.md, "Interrupted runs".
"""

import contextlib
import os
import signal
import sys
import threading

import keras

from keras_vitnorm import stop_signals

#: The signals that stop a run.
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def signal_name(number):
    return signal.Signals(number).name


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by a signal: a `KeyboardInterrupt`, so that `except Exception` lets
    it through. `signal` is the signal's number, `exit_status` (`128 + signal`) the status
    of a process the signal ended, `run_dir` the run directory (`None` if the run had not
    set it up) and `resumable` whether `--resume` continues the run there.
    """

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
        raised, an error in its place is the stop, changed by the code it landed in
        (e.g. NumPy's import failing)."""
        if self._raised and not isinstance(error, RunInterrupted):
            stop_signals.acted_on()
            return RunInterrupted(self.signal)
        return None

    def check(self):
        """A safe point: raises `RunInterrupted` if a signal came (whether or not its
        handler's exception got through)."""
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
        """While training steps run: a signal waits for the step's end (`StopOnSignal`).
        A request made before the block raises as it begins, one still pending as it
        ends."""
        self.check()
        self._deferred = True
        try:
            yield self
        finally:
            self._deferred = False
        self.check()


class StopOnSignal(keras.callbacks.Callback):
    """Ends `fit` at the end of a step once `request` holds a signal: writes the
    checkpoint of that step (`checkpoint`, or `None` on a process that writes none) and
    raises `RunInterrupted`. Last in the callback list, so the step's other callbacks
    have run; with `agree` (as `StopOnNaN`'s) the processes stop at the same step.
    """

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
