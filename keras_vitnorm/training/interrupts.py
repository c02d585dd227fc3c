"""SIGTERM and SIGINT end a training run at a step it resumes from.

SIGTERM is what a scheduler sends before it preempts or cancels a job (Slurm, Kubernetes,
a preemptible VM), SIGINT what Ctrl-C sends. While `train` runs, `StopRequest` holds
handlers for both:

- While training steps run (`StopRequest.deferred`: `model.fit` and the final
  evaluation), a signal only records the request. `StopOnSignal`, the last callback of
  `fit`, acts on it at the end of the step under way: it writes the checkpoint of that
  step and raises `RunInterrupted` out of `fit`. A step is never cut in the middle, so
  the checkpoint is the state after a whole step, and `--resume` continues from it
  exactly.
- Elsewhere (loading the data, building the model) the signal raises `RunInterrupted`
  at once: nothing there needs finishing, and the last checkpoint on disk is whole.
  Where it lands in code whose exceptions Python drops (a garbage-collection callback,
  which JAX installs under every backend; a `__del__` method), the signal is sent
  again a moment later (`keras_vitnorm.stop_signals`), and the request it recorded is
  acted on at the run's safe points too (`StopRequest.check`: before the model is
  built, before `fit` and as it begins), so that it never goes unheard.

A KeyboardInterrupt raised inside a training step is not reliable: under JAX, Keras
converts each step's logs inside a bare `except` that swallows it (the run goes on),
and one raised while XLA compiles leaves the process to crash as it exits. SIGTERM's
own action ends the process with no checkpoint of the steps since the last one.

A second Ctrl-C stops the process at once, by SIGINT's own action (the last checkpoint
on disk stays whole, and the kernel releases the run's lock).
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
    """`"SIGTERM"` for `signal.SIGTERM`, ..."""
    return signal.Signals(number).name


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by a signal.

    A `KeyboardInterrupt`, so that code which handles errors (`except Exception`)
    lets it through, as it lets Ctrl-C through.

    Attributes:
        signal: the signal's number.
        exit_status: `128 + signal`, the status a process ended by the signal has
            (130 for SIGINT, 143 for SIGTERM).
        run_dir: the run directory, or `None` if the run had not set it up.
        resumable: whether `run_dir` holds a run that `--resume` continues.
    """

    def __init__(self, signal_number, message=None, run_dir=None, resumable=False):
        self.signal = signal_number
        self.run_dir = run_dir
        self.resumable = resumable
        super().__init__(message or f"Stopped by {signal_name(signal_number)}.")

    @property
    def exit_status(self):
        return 128 + self.signal

    def describe(self, message, run_dir=None, resumable=False):
        """Sets the message, run directory and whether it resumes; returns `self`."""
        self.args = (message,)
        self.run_dir, self.resumable = run_dir, resumable
        return self


class StopRequest:
    """Turns SIGTERM and SIGINT into a request to stop, while `listening()`.

    `signal` is the first signal received (`None` until one is). Handlers are only
    installed in the main thread (Python runs signal handlers there alone); elsewhere
    the signals keep their own handlers.
    """

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
        raised, an error that comes out in place of its `RunInterrupted` is the stop,
        changed on its way by the code it landed in (NumPy's import reports one that
        lands in it as "Importing the numpy C-extensions failed")."""
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
        previous = {number: signal.getsignal(number) for number in SIGNALS}
        for number in SIGNALS:
            signal.signal(number, self._handle)
        try:
            with stop_signals.redelivered():
                yield self
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    @contextlib.contextmanager
    def deferred(self):
        """While training steps run: a signal waits for the step's end (`StopOnSignal`).

        A request already made when the block begins (a signal during start-up whose
        exception was dropped) raises `RunInterrupted` at once; one still pending when
        the block ends (a signal during the last step's validation, or the final
        evaluation) raises it then.
        """
        self.check()
        self._deferred = True
        try:
            yield self
        finally:
            self._deferred = False
        self.check()


class StopOnSignal(keras.callbacks.Callback):
    """Ends `fit` at the end of a step once `request` holds a signal: writes the
    checkpoint of that step (`checkpoint`, a `RunCheckpoint`, or `None` on a process
    that writes none) and raises `RunInterrupted`. A request made before `fit` begins
    ends it before its first step, with nothing to write.

    With `agree` (a function every training process calls each step, True where any
    process's flag is), the processes of a distributed run stop at the same step.
    Last in the callback list, so the step's other callbacks have run.
    """

    def __init__(self, request, checkpoint=None, agree=None):
        super().__init__()
        self.request = request
        self.checkpoint = checkpoint
        self.agree = agree

    def _stop_requested(self):
        requested = self.request.signal is not None
        return self.agree(requested) if self.agree is not None else requested

    def _stop(self):
        if self.checkpoint is not None:
            self.checkpoint.save_if_new()
        raise RunInterrupted(self.request.signal or signal.SIGTERM)

    def on_train_begin(self, logs=None):
        # Before the first step compiles: the state is the last checkpoint's (or step 0).
        if self._stop_requested():
            raise RunInterrupted(self.request.signal or signal.SIGTERM)

    def on_train_batch_end(self, batch, logs=None):
        if self._stop_requested():
            self._stop()

    def on_epoch_end(self, epoch, logs=None):
        if self._stop_requested():  # the epoch's checkpoint is written already
            self._stop()
