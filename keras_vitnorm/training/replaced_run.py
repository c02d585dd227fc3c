"""The run that `--overwrite` replaces, kept aside until the new run's first checkpoint
(docs/training.md, "What a run writes"): `move_aside`, then `drop_replaced`, or
`remove_failed_start`, or, after a kill, `recover_replaced`.
"""

import contextlib
import os
import shutil

from keras_vitnorm.training import run_files
from keras_vitnorm.training.run_layout import MOVING
from keras_vitnorm.training.run_layout import REPLACED
from keras_vitnorm.training.run_layout import has_checkpoint_or_result
from keras_vitnorm.training.run_layout import run_entries


def keeps_replaced_run(output_dir):
    """Whether `output_dir` holds a run that an `--overwrite` moved (or was moving) aside
    and that the next command there puts back: the new run has no checkpoint yet."""
    return os.path.isdir(os.path.join(output_dir, MOVING)) or (
        os.path.isdir(os.path.join(output_dir, REPLACED))
        and not has_checkpoint_or_result(output_dir))


def move_aside(output_dir):
    """Moves what the run in `output_dir` wrote (but the lock) into `REPLACED`, through
    `MOVING`: a kill part way leaves `MOVING`, whose entries the next command puts back."""
    entries = run_entries(output_dir)
    if not entries:
        return
    moving = os.path.join(output_dir, MOVING)
    with run_files.storage_errors(output_dir, "The run there is kept.", run_files.AGAIN):
        os.mkdir(moving)
        for entry in entries:
            os.rename(os.path.join(output_dir, entry), os.path.join(moving, entry))
        os.rename(moving, os.path.join(output_dir, REPLACED))


def _put_back(output_dir):
    """Moves the run that `move_aside` kept back into `output_dir`, through `MOVING` too."""
    replaced, moving = (os.path.join(output_dir, name) for name in (REPLACED, MOVING))
    if os.path.isdir(replaced):
        os.rename(replaced, moving)
    if not os.path.isdir(moving):
        return
    for entry in sorted(os.listdir(moving)):
        target = os.path.join(output_dir, entry)
        if os.path.lexists(target):
            raise FileExistsError(
                f"Cannot put back {os.path.join(moving, entry)}, the run that --overwrite was "
                f"replacing: {target} is in its place. Move one of them out of {output_dir}.")
        os.rename(os.path.join(moving, entry), target)
    os.rmdir(moving)


def drop_replaced(output_dir):
    """Deletes the run that `move_aside` kept, if any; a failure leaves it for the next
    command there, not stopping a run in training."""
    shutil.rmtree(os.path.join(output_dir, REPLACED), ignore_errors=True)


def recover_replaced(output_dir):
    """Settles what a killed `--overwrite` left in the locked `output_dir`: the old run is
    put back unless the new one has a checkpoint or a result (then it is deleted).
    Returns what was done, for the user, or `None`."""
    replaced = os.path.join(output_dir, REPLACED)
    if os.path.isdir(replaced) and has_checkpoint_or_result(output_dir):
        with run_files.storage_errors(replaced, "Nothing was changed in the new run.",
                                      run_files.AGAIN):
            shutil.rmtree(replaced)
        return (f"Deleted the run that an --overwrite was replacing in {output_dir}: the new "
                "run there has a checkpoint.")
    if os.path.isdir(replaced):  # a new run that never reached its first checkpoint
        remove_failed_start(output_dir)
    elif os.path.isdir(os.path.join(output_dir, MOVING)):  # killed while moving: all old entries
        _put_back(output_dir)
    else:
        return None
    return (f"Put back the run that an --overwrite was replacing in {output_dir}: that "
            "command stopped before the new run's first checkpoint, and what the new run had "
            "written is removed.")


def remove_failed_start(output_dir):
    """Removes the run entries (not the lock) of a new run that failed before its first
    checkpoint and puts back the run it was replacing."""
    for entry in run_entries(output_dir):
        path = os.path.join(output_dir, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    _put_back(output_dir)
