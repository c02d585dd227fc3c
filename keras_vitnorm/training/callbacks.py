"""Training callbacks that Keras core lacks or gets wrong for step-exact resumption."""

import json
import math
import os

import keras


class ResumableBackup(keras.callbacks.BackupAndRestore):
    """`BackupAndRestore` that resumes an interrupted epoch at the batch it reached.

    Written because Keras' `BackupAndRestore` (3.9 to 3.15) restores the epoch number
    only: a run killed mid-epoch replays that epoch from its first batch, so it trains
    more steps than planned; and after a restart, its batch-level saves record epoch 0
    (it counts only the epochs it finished itself). This subclass

    - records the epoch in progress, the batches done in it and the global step;
    - writes the weights and that record atomically (temporary file, then rename), so a
      kill during a save leaves the previous backup intact;
    - always saves at the end of an epoch, and every `save_freq` batches if it is an int;
    - never deletes the backup itself: the trainer does, once the run's results are
      written.

    The trainer reads `read_state(backup_dir)` before calling `fit` and runs the rest
    of the interrupted epoch as a shorter `fit` call, positioning the data stream at the
    recorded step (see `keras_vitnorm.training.trainer`).
    """

    def __init__(self, backup_dir, save_freq="epoch"):
        super().__init__(backup_dir, save_freq=save_freq, delete_checkpoint=False)
        self.batch_offset = 0
        self._batches_done = 0
        self._since_save = 0

    @staticmethod
    def read_state(backup_dir):
        """`{"epoch", "batch", "step"}` of the last backup in `backup_dir`, or `None`."""
        path = os.path.join(backup_dir, "training_metadata.json")
        if not os.path.exists(path) or not os.path.exists(
            os.path.join(backup_dir, "latest.weights.h5")
        ):
            return None
        with open(path) as f:
            state = json.load(f)
        if not {"epoch", "batch", "step"} <= set(state):
            raise ValueError(
                f"{path} was not written by keras-vitnorm's ResumableBackup "
                f"(keys {sorted(state)}); cannot resume from it."
            )
        return state

    def on_epoch_begin(self, epoch, logs=None):
        self._current_epoch = epoch
        self._batches_done = self.batch_offset

    def on_train_batch_end(self, batch, logs=None):
        self._batches_done = self.batch_offset + batch + 1
        if self.save_freq != "epoch":
            self._since_save += 1
            if self._since_save >= self.save_freq:
                self._save_model()

    def on_epoch_end(self, epoch, logs=None):
        self._current_epoch = epoch + 1
        self._batches_done = 0
        self.batch_offset = 0
        self._save_model()

    def _save_model(self):
        self._since_save = 0
        os.makedirs(self.backup_dir, exist_ok=True)
        temporary = os.path.join(self.backup_dir, "writing.weights.h5")
        self.model.save_weights(temporary, overwrite=True)
        os.replace(temporary, self._weights_path)
        state = {
            "epoch": self._current_epoch,
            "batch": self._batches_done,
            "step": int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)),
        }
        temporary = self._training_metadata_path + ".writing"
        with open(temporary, "w") as f:
            json.dump(state, f)
        os.replace(temporary, self._training_metadata_path)


class LossIsNaN(RuntimeError):
    """Raised by `StopOnNaN` out of `fit`."""


class StopOnNaN(keras.callbacks.Callback):
    """Stops training at the first non-finite loss and records where it happened.

    Keras' `TerminateOnNaN` prints the batch index within the epoch and lets the epoch
    end normally, so end-of-epoch callbacks (checkpoints, backups) then save the NaN
    weights. This callback records the global step in `self.step` (1-based count of
    optimizer steps, the NaN step included), `self.epoch` and `self.batch` (1-based),
    and raises `LossIsNaN` at once, so nothing is saved after the loss went bad. The
    trainer catches it and reports the divergence.
    """

    def __init__(self):
        super().__init__()
        self.step = None
        self.epoch = None
        self.batch = None
        self.batch_offset = 0
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is None or math.isfinite(float(loss)):
            return
        self.step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        self.epoch = self._epoch + 1
        self.batch = self.batch_offset + batch + 1
        raise LossIsNaN(f"loss {loss} at step {self.step}")
