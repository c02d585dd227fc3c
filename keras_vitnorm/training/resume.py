"""Where a resumed run starts: its last checkpoint restored, its logs cut back to it
(docs/training.md, "What survives a crash")."""

import contextlib
import csv
import os

from keras_vitnorm import durable
from keras_vitnorm.training import callbacks as callbacks_lib
from keras_vitnorm.training.run_layout import read_log


def restore_last_checkpoint(directory, checkpoint, model, plan, say, assign=True):
    """Loads the last checkpoint of the `RunDirectory` into `model` through its
    `RunCheckpoint`. Returns `((epoch, batches done in it, step), values)`, `values`
    being the variables' values where `assign` is False (else `None`)."""
    for path in (directory.preset, *directory.checkpoints.values()):
        durable.recover_directory(path)
    found = callbacks_lib.RunCheckpoint.latest(directory.backup)
    (epoch, batch, step), values = (0, 0, 0), None
    if not found:
        _check_nothing_trained(directory, say)
    else:
        path, state = found
        epoch, batch, step = state["epoch"], state["batch"], state["step"]
        if step != epoch * plan.steps_per_epoch + batch:
            raise ValueError(
                f"The checkpoint {path} (epoch {epoch}, batch {batch}, step {step}) does "
                f"not fit {plan.steps_per_epoch} steps per epoch.")
        values = checkpoint.restore(model, path, assign=assign)
        checkpoint.seconds_before = state.get("train_seconds")
        if batch >= plan.steps_per_epoch:
            epoch, batch = epoch + 1, 0
        where = ("all steps done: final evaluation" if step >= plan.total_steps
                 else f"epoch {epoch + 1}, batch {batch}")
        say(f"Resuming from step {step} ({where}).")
    # Logs hold exactly the rows up to the checkpoint (a kill may have left more).
    truncate_csv(directory.log, lambda row: int(row["epoch"]) < epoch)
    if step == 0:
        with contextlib.suppress(FileNotFoundError):
            os.remove(directory.grad_norms)
    else:
        truncate_csv(directory.grad_norms, lambda row: int(row["step"]) <= step)
    return (epoch, batch, step), values


def _check_nothing_trained(directory, say):
    """Raises unless the run without a checkpoint trained nothing yet (resuming from step
    0 would replace what it has)."""
    where = f"Cannot resume {directory.path}: it has no checkpoint to resume from"
    if os.path.exists(directory.preset):
        raise ValueError(
            f"{where} but a final model (preset/): it finished, and its metrics.json is "
            "gone. Score the model with ViT.from_preset, or train it again with "
            "--overwrite instead of --resume.")
    # Every epoch end writes a checkpoint, so a log of two epochs had one; a log of
    # one may be a kill at the first epoch end, between its log row and checkpoint.
    epochs = len(read_log(directory.log))
    if epochs > 1:
        raise ValueError(
            f"{where}, but log.csv records {epochs} trained epochs: its checkpoints "
            "were removed. Train it again with --overwrite instead of --resume.")
    say("No checkpoint yet (the run stopped before its first): training from step 0.")


def truncate_csv(path, keep):
    """Rewrites the CSV `path` atomically with the rows `keep(row)` accepts; a row cut
    short by a kill is dropped."""
    if not os.path.exists(path):
        return
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        rows = [dict(zip(header, row)) for row in reader if header and len(row) == len(header)]
    if header is None:
        os.remove(path)
        return
    durable.write_csv(path, header, [row for row in rows if keep(row)])
