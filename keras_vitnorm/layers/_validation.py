"""Argument checks shared by layers and models: clear errors naming the bad value."""

import difflib


def check_choice(argument, value, choices):
    """Raises a `ValueError` unless `value` is one of `choices`.

    The message names the argument, the value, every valid choice and, when one is
    close, the most likely intended spelling.
    """
    if value in choices:
        return value
    message = f"Unknown {argument}={value!r}. Valid values: {', '.join(map(repr, choices))}."
    if isinstance(value, str):
        close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
        if close:
            message += f" Did you mean {close[0]!r}?"
    raise ValueError(message)


def check_positive_int(argument, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{argument} must be a positive integer, got {value!r}.")
    return value


def check_rate(argument, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{argument} must be a float in [0, 1), got {value!r}.")
    return float(value)
