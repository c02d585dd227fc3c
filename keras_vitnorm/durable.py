"""Writes that a kill cannot leave half done (a temporary name, fsync, a rename), for
files, directories and groups of files, and the fault points that test them."""

import contextlib
import csv
import errno
import io
import json
import os
import pathlib
import shutil
import signal

#: Environment variable naming the stage at which `fault_point` strikes, for tests:
#: `"<stage>"` or `"<stage>@<n>"` (the n-th time that stage is reached, 1-based) kills
#: the process with SIGKILL; `"enospc:<stage>[@<n>]"` raises a "No space left on
#: device" error there instead.
FAULT_ENV = "KERAS_VITNORM_FAULT"
_fault_counts = {}


def fault_point(stage):
    """Kills the process (or fails a write) here if `KERAS_VITNORM_FAULT` names `stage`."""
    spec = os.environ.get(FAULT_ENV, "")
    target, _, nth = spec.removeprefix("enospc:").partition("@")
    if not spec or target != stage:
        return
    _fault_counts[stage] = _fault_counts.get(stage, 0) + 1
    if _fault_counts[stage] != int(nth or 1):
        return
    if spec.startswith("enospc:"):
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected at {stage})")
    os.kill(os.getpid(), signal.SIGKILL)


def _fsync_directory(directory):
    with contextlib.suppress(OSError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


#: The open `written_together` block: `(folders, {path: temporary path})`, or `None`.
_together = None


@contextlib.contextmanager
def written_together(*folders):
    """Files written (by `write_file`) directly in `folders` within the block are renamed
    into place together as it ends, or none is where it raises; a nested block joins it."""
    global _together
    if _together is not None:
        yield
        return
    pending = {}
    _together = ({os.path.abspath(folder) for folder in folders}, pending)
    try:
        yield
    except BaseException:
        for temporary in pending.values():
            with contextlib.suppress(OSError):
                os.remove(temporary)
        raise
    finally:
        _together = None
    for path, temporary in pending.items():
        os.replace(temporary, path)
    for directory in {os.path.dirname(path) for path in pending}:
        _fsync_directory(directory)


def write_file(path, write, stage=None):
    """Writes `path` atomically: `write(temporary_path)` writes the whole file, which is
    fsynced and renamed into place (in a `written_together` block: as it ends). The
    `fault_point` `stage`, if any, strikes once the temporary file is whole."""
    directory = os.path.dirname(os.path.abspath(path))
    # The temporary name keeps the file's suffix: Keras picks the format by it.
    temporary = os.path.join(directory, f".writing.{os.path.basename(path)}")
    deferred = _together is not None and directory in _together[0]
    try:
        write(temporary)
        with open(temporary, "rb+") as f:
            os.fsync(f.fileno())
        if stage:
            fault_point(stage)
        if deferred:
            _together[1][os.path.abspath(path)] = temporary
            return
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    _fsync_directory(directory)


def write_text(path, text, stage=None):
    write_file(path, lambda temporary: pathlib.Path(temporary).write_text(text), stage)


def write_csv(path, fieldnames, rows, stage=None):
    """Writes `rows` (dicts) as a CSV of the columns `fieldnames`, with a header."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=fieldnames)
    writer.writeheader()
    writer.writerows(rows)
    write_text(path, buffer.getvalue(), stage)


def write_json(path, value, stage=None):
    write_text(path, json.dumps(value, indent=2, sort_keys=True) + "\n", stage)


def read_json(path):
    """The JSON in `path`, or `None` if missing; a `ValueError` naming a directory or bad JSON."""
    if not os.path.exists(path):
        return None
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory, not a JSON file.")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as error:
        raise ValueError(
            f"{path} is not valid JSON ({error}); it may be truncated or damaged.") from error


def _beside(path):
    """`(parent, temporary, old)`: where `write_directory` writes `path` and puts the old one."""
    parent = os.path.dirname(os.path.abspath(path))
    name = os.path.basename(os.path.normpath(path))
    return parent, os.path.join(parent, f".{name}.writing"), os.path.join(parent, f".{name}.old")


def write_directory(path, write, stage=None):
    """Writes the directory `path` whole: `write(temporary_dir)`, then a rename; an existing
    `path` is renamed aside first (`recover_directory` puts it back after a kill) and
    deleted after. The `fault_point` `stage` strikes once the new directory is complete,
    `<stage>:replacing` once the old one is aside."""
    parent, temporary, old = _beside(path)
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        write(temporary)
        if stage:
            fault_point(stage)
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
            if stage:
                fault_point(f"{stage}:replacing")
        os.rename(temporary, path)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    _fsync_directory(parent)


def recover_directory(path):
    """Restores `path` after an interrupted `write_directory`: a leftover new copy may be
    incomplete and is dropped; the old copy comes back if `path` is missing."""
    _, temporary, old = _beside(path)
    shutil.rmtree(temporary, ignore_errors=True)
    if os.path.isdir(old):
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(old, path)
