"""Keeps the frameworks' own log lines off the terminal of the `keras-vitnorm` command:
TensorFlow and XLA log through Abseil's C++ logging straight to fd 2 (ignoring
`TF_CPP_MIN_LOG_LEVEL` before `absl::InitializeLog()`), so only redirecting fd 2 holds them."""

import contextlib
import os
import re
import sys
import threading

#: Lines the frameworks write that are logs, not messages to the user.
FRAMEWORK_LOG_LINE = re.compile(
    rb"^(?:"
    # Abseil / glog C++ lines: severity I, W or E, date, time, thread, file:line].
    rb"[IWE]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w./+-]+:\d+\] "
    rb"|WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    # The second line of TensorFlow's CPU-feature message.
    rb"|To enable the following instructions: .* rebuild TensorFlow"
    # Python loggers of the frameworks at the default format.
    rb"|(?:INFO|WARNING):(?:tensorflow|absl|jax[\w.]*|torch[\w.]*):"
    rb")")


def is_framework_log(line):
    """Whether one line of stderr output (bytes) is a framework log line."""
    return FRAMEWORK_LOG_LINE.match(line) is not None


@contextlib.contextmanager
def hidden():
    """Drops framework log lines written to fd 2 within the block; every other line passes,
    in order, fatal (severity F) ones included."""
    sys.stderr.flush()
    terminal = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    out_fd = os.dup(terminal)  # the thread's own copy: the block's end closes `terminal`

    def forward():
        with os.fdopen(read_end, "rb") as pipe, os.fdopen(out_fd, "wb", buffering=0) as out:
            for line in pipe:
                if not is_framework_log(line):
                    out.write(line)

    thread = threading.Thread(target=forward, name="framework-log-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)  # the pipe's last write end closes: the thread reads to the end
        os.close(terminal)
        thread.join(timeout=5)
