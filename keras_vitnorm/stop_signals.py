"""A stop signal whose exception Python drops (in a gc callback, which JAX installs, a
`__del__` or a weakref callback) is sent again until it lands (`redelivered`)."""

import _thread
import contextlib
import functools
import signal
import sys
import threading

#: Seconds after a dropped stop exception before its signal comes again: time for the
#: main thread to leave the code it landed in.
AGAIN_AFTER = 0.01

#: The open `redelivered()` blocks, innermost last.
_BLOCKS = []


def signal_of(error):
    """The signal that a `KeyboardInterrupt` stands for: its `signal`, else SIGINT."""
    return getattr(error, "signal", signal.SIGINT)


def _in_main_thread():
    return threading.current_thread() is threading.main_thread()


class _Block:
    """One `redelivered()` block: the signals it will send again."""

    def __init__(self):
        self.open = True
        self.timers = []
        main = threading.main_thread().ident
        # A real signal, which also ends a sleep or a wait of the main thread.
        self.kill = (functools.partial(signal.pthread_kill, main)
                     if hasattr(signal, "pthread_kill") else _thread.interrupt_main)

    def send_later(self, number):
        timer = threading.Timer(AGAIN_AFTER, self._send, (number,))
        timer.daemon = True
        self.timers.append(timer)
        timer.start()

    def _send(self, number):
        if self.open:
            self.kill(number)

    def cancel(self):
        for timer in self.timers:
            timer.cancel()
        self.timers.clear()


def acted_on():
    """Cancels the signals still to be sent again: a safe point has raised their stop."""
    for block in _BLOCKS:
        block.cancel()


@contextlib.contextmanager
def redelivered():
    """Within the block, a `KeyboardInterrupt` that Python drops in the main thread has
    its signal sent again (`sys.unraisablehook`); outside the main thread it does nothing."""
    if not _in_main_thread():
        yield
        return
    previous = sys.unraisablehook
    block = _Block()

    def hook(unraisable):
        if not (isinstance(unraisable.exc_value, KeyboardInterrupt) and _in_main_thread()):
            previous(unraisable)
            return
        number = signal_of(unraisable.exc_value)
        while True:
            try:
                block.send_later(number)
                return
            except KeyboardInterrupt as error:  # it came again before this returned
                number = signal_of(error)

    sys.unraisablehook = hook
    _BLOCKS.append(block)
    try:
        yield
    finally:
        block.open = False
        block.cancel()
        _BLOCKS.remove(block)
        sys.unraisablehook = previous
