"""Probes of a ViT's training dynamics: per-layer gradient norms, the residual stream, and the
first stem norm's learned scale (the Dual PatchNorm paper's Figures 2 and 3)."""

import csv
import os
import re

import keras
import numpy as np

from keras_vitnorm.backend import gradients_function
from keras_vitnorm.validation import check_positive_int

#: Variable-path prefix of the stem's patch embedding.
PATCH_EMBEDDING = "stem/projection"


def layer_of(path):
    """The layer of a variable: `"block_3/attention/qkv/kernel"` -> `"block_3/attention/qkv"`."""
    return path.rsplit("/", 1)[0]


def depth_group(path):
    """Coarse group for depth plots: `"patch_embedding"`, else the top-level layer name."""
    if path.startswith(PATCH_EMBEDDING + "/") or re.match(r"stem/conv\d+/", path):
        return "patch_embedding"
    return path.split("/", 1)[0]


def group_norms(gradients, group=layer_of):
    """`{group(path): L2 norm}` of the `{variable path: gradient}` `gradients`."""
    squares = {}
    for path, gradient in gradients.items():
        name = group(path)
        squares[name] = squares.get(name, 0.0) + float(np.sum(np.square(gradient, dtype="float64")))
    return {name: float(np.sqrt(total)) for name, total in squares.items()}


class GradientNormRecorder(keras.callbacks.Callback):
    """Records per-layer gradient norms on a fixed probe batch every `every` steps.

    Gradients of the unregularized cross-entropy in inference mode, after the step, so that
    the records of different variants compare.

    Args:
        images, labels: the probe batch (NumPy; labels one-hot).
        every: int, default 50: record at global steps 0, `every`, `2*every`, ...
        path: optional CSV file that `flush` and the end of training append
            `step, group, norm` rows to (a resumed run keeps its earlier rows).
        group: `layer_of` (default) or `depth_group`.

    Attributes:
        records: `{step: {group: norm}}`.
    """

    def __init__(self, images, labels, every=50, path=None, group=layer_of):
        super().__init__()
        self.every = check_positive_int("every", every)
        self.images, self.labels = np.asarray(images), np.asarray(labels)
        self.path, self.group = path, group
        self.records = {}
        self._written = set()
        self._gradients = None  # (model, its gradients function), made at the first record

    def _step(self):
        return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def _record(self):
        step = self._step()
        if step not in self.records:
            if self._gradients is None or self._gradients[0] is not self.model:
                labels = keras.ops.convert_to_tensor(np.asarray(self.labels, "float32"))

                def loss(logits):
                    return keras.ops.mean(
                        keras.losses.categorical_crossentropy(labels, logits, from_logits=True))

                self._gradients = self.model, gradients_function(self.model, loss)
            _, _, gradients = self._gradients[1](self.images)
            self.records[step] = group_norms(gradients, self.group)

    def on_train_begin(self, logs=None):
        if self._step() == 0:
            self._record()

    def on_train_batch_end(self, batch, logs=None):
        if self._step() % self.every == 0:
            self._record()

    def on_train_end(self, logs=None):
        self.flush()

    def flush(self):
        """Appends the records not yet written to `path` and flushes the file."""
        pending = sorted(set(self.records) - self._written)
        if not self.path or not pending:
            return
        new = not os.path.exists(self.path)
        with open(self.path, "a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["step", "group", "norm"])
            for step in pending:
                for name, norm in self.records[step].items():
                    writer.writerow([step, name, f"{norm:.8g}"])
            f.flush()
            os.fsync(f.fileno())
        self._written.update(pending)


def residual_stream(model, images):
    """The tokens' RMS after each stage (`"stem"`, `"block_0"`, ...) on `images`, and their mean
    cosine similarity between consecutive stages: `{"names", "rms", "similarity"}` lists."""
    blocks = [layer.name for layer in model.layers if re.fullmatch(r"block_\d+", layer.name)]
    names = ["stem"] + sorted(blocks, key=lambda name: int(name.split("_")[1]))
    probe = keras.Model(model.input, [model.get_layer(name).output for name in names])
    outputs = [np.asarray(keras.ops.convert_to_numpy(x), "float64") for x in probe(images)]
    rms = [float(np.sqrt(np.mean(np.square(x)))) for x in outputs]
    similarity = []
    for a, b in zip(outputs, outputs[1:]):
        dot = np.sum(a * b, axis=-1)
        norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
        similarity.append(float(np.mean(dot / np.maximum(norms, 1e-12))))
    return {"names": names, "rms": rms, "similarity": similarity}


def stem_scale_map(model):
    """The learned scale of the stem's first norm (DPN's LN_0) as a `(P, P, C)` array;
    `ValueError` when the stem has no learnable first norm."""
    stem = model.get_layer("stem")
    norm = getattr(stem, "patch_norm", None)
    config = model.get_config()
    if norm is None:
        raise ValueError(f"The model's stem ({config['stem']!r}) has no norm before the patch "
                         "embedding; stem_scale_map needs 'dual_patchnorm' or 'pre_patchnorm'.")
    scales = [w for w in norm.weights if w.name in ("gamma", "scale")]
    if not scales:
        raise ValueError(f"The stem's first norm ({type(norm).__name__}) has no learnable scale "
                         "(stem_norm_learnable=False or a scale-free norm).")
    patch, channels = config["patch_size"], config["num_channels"]
    return np.asarray(keras.ops.convert_to_numpy(scales[0])).reshape(patch, patch, channels)
