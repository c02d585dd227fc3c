"""Shared argument checks: errors naming the bad value and what is valid."""

import difflib
import math
import os


def did_you_mean(value, choices):
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def check_choice(argument, value, choices):
    """A `ValueError` naming the argument, value, valid choices and a close spelling, if any."""
    if value in choices:
        return value
    message = f"Unknown {argument}={value!r}. Valid values: {', '.join(map(repr, choices))}."
    raise ValueError(message + did_you_mean(value, choices))


def check_known_keys(keys, valid, where):
    """A `ValueError` naming each of `keys` not in `valid`; `where` says what they are."""
    valid = list(valid)
    unknown = [key for key in keys if key not in valid]
    if not unknown:
        return
    hints = "".join(did_you_mean(key, valid) for key in unknown)
    raise ValueError(
        f"Unknown {where}{'s' if len(unknown) > 1 else ''} "
        f"{', '.join(map(repr, unknown))}.{hints} Valid: {', '.join(valid)}.")


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_distinct(what, values):
    """Raises a `ValueError` naming a value given twice: its runs would count twice."""
    repeated = sorted({value for value in values if list(values).count(value) > 1}, key=str)
    if repeated:
        raise ValueError(f"{what} name {', '.join(map(repr, repeated))} more than once: each "
                         "run would count twice in the tables. Give each once.")


def check_positive_int(argument, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{argument} must be a positive integer, got {value!r}.")
    return value


def check_positive_float(argument, value):
    """`value` as a float; raises unless it is a finite number above 0."""
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{argument} must be a finite number > 0, got {value!r}.")
    return float(value)


def check_rate(argument, value):
    if not _is_number(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"{argument} must be a float in [0, 1), got {value!r}.")
    return float(value)


def check_bool(argument, value):
    if not isinstance(value, bool):
        raise ValueError(f"{argument} must be True or False, got {value!r}.")
    return value


def check_directory_path(path, what="output directory"):
    """`path`, or a `FileExistsError` where it or a folder above it is a file; `what` names it."""
    path = os.fspath(path)
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if os.path.isdir(existing):
        return path
    if existing == os.path.abspath(path):
        raise FileExistsError(
            f"The {what} {path} is a file, not a directory. Choose another path (or move "
            "the file away).")
    raise FileExistsError(
        f"The {what} {path} cannot be made: {existing} is a file, not a directory. Choose "
        "another path.")
