"""The entry points of Keras' trainer on the library's models, guarded: the input checked
before the trainer runs, the weights kept where a call fails."""

import inspect
import warnings

import numpy as np

from keras_vitnorm import backend
from keras_vitnorm.layers.patch_stem import image_shape_hint


def _static_shape(data):
    """`data`'s shape as a tuple (`None` for a dimension not known), or `None` if unknown."""
    shape = getattr(data, "shape", None)
    if shape is None:
        return None
    try:
        return tuple(None if size is None else int(size) for size in shape)
    except (TypeError, ValueError):  # a shape of unknown rank
        return None


def _part(data, name, named_only):
    """The part of `data` (arrays, a dict of them, or a `tf.data.Dataset` of `(x, ...)`
    elements) that feeds the input `name`; `None` where it cannot be told without reading
    data (a generator, a `keras.utils.PyDataset`)."""
    spec = getattr(data, "element_spec", None)
    if spec is not None:
        data = spec[0] if isinstance(spec, tuple) else spec
    if isinstance(data, dict):
        return data.get(name)
    return None if named_only else data


#: Images of a call's input whose range is checked (`GuardedCalls.check_pixel_range`).
RANGE_SAMPLE = 64


def _first_images(data, name, named_only, peek):
    """Up to `RANGE_SAMPLE` images of `data`'s input `name` as NumPy: the first of arrays
    or tensors, the first batch of a `tf.data.Dataset` where `peek` (a batch read ahead);
    `None` where they cannot be read without consuming the data (a generator)."""
    if hasattr(data, "element_spec"):
        if not (peek and hasattr(data, "take")):
            return None
        try:
            data = next(iter(data.take(1)))
        except Exception:  # noqa: BLE001 (an input that only the call itself reads)
            return None
        data = data[0] if isinstance(data, tuple) else data
    part = _part(data, name, named_only)
    if part is None or getattr(part, "shape", None) is None or not len(part.shape):
        return None
    try:
        sample = part[:RANGE_SAMPLE]
        return np.asarray(sample.numpy() if hasattr(sample, "numpy") else sample, "float32")
    except Exception:  # noqa: BLE001 (a symbolic tensor, a device tensor)
        return None


class GuardedCalls:
    """`fit`, `evaluate`, `predict`, `train_on_batch`, `test_on_batch` and
    `predict_on_batch`: Keras' own, with two guards.

    - The inputs are checked first, where their shape is known without reading them
      (arrays, tensors, a dict of them, a `tf.data.Dataset`): a `ValueError` names the
      shape given and the one the model takes, with what to do (channels-first images:
      transpose them).
    - Under JAX, a call that raises anyway (a generator's batch of the wrong shape,
      labels the loss does not take, Ctrl-C) leaves the model as the call's last finished
      step did, or as it was before the call, where Keras' trainer would leave its
      variables empty and the model unusable (`keras_vitnorm.backend.keeping_variables`;
      docs/backends.md, "A failed call under JAX").

    - Images far outside the model's `pixel_range` (0-255 images given to a model that
      takes [-1, 1]) get a warning that names both ranges, once per model
      (`check_pixel_range`): the model would train and predict on them without a word.
      Arrays and tensors are checked at every call; a `tf.data.Dataset` by reading its
      first batch ahead, at the model's first call with one (`peek_datasets`).

    A mixin, placed before `keras.Model` in the bases. `input_shapes()` says what the
    model takes, `pixel_ranges()` in which range.
    """

    #: Whether a `tf.data.Dataset` given to a call has its first batch read ahead for the
    #: range check (the trainer, whose pipelines produce the model's range, turns it off).
    peek_datasets = True

    def pixel_ranges(self):
        """`{input name: (low, high)}` of the image inputs whose range is checked."""
        return {}

    def check_pixel_range(self, x, method="call"):
        """Warns (once per model) where the images of `x` lie far outside `pixel_ranges()`:
        beyond half the range's span on either side."""
        if getattr(self, "_pixel_range_warned", False):
            return
        ranges = self.pixel_ranges()
        peek = self.peek_datasets and not getattr(self, "_pixel_range_peeked", False)
        if hasattr(x, "element_spec") and peek:
            self._pixel_range_peeked = True
        for name, (low, high) in ranges.items():
            images = _first_images(x, name, len(self.input_shapes()) > 1, peek)
            if images is None or not images.size:
                continue
            found = float(images.min()), float(images.max())
            margin = (high - low) / 2
            if found[0] >= low - margin and found[1] <= high + margin:
                continue
            self._pixel_range_warned = True
            warnings.warn(
                f"{type(self).__name__}.{method} got {name} with values in [{found[0]:g}, "
                f"{found[1]:g}]; the model takes {name} in [{low:g}, {high:g}] (its "
                f"pixel_range). Scale them to that range, or build the model with the range "
                f"they have, e.g. pixel_range=[0, 255] (also as a from_preset override): it "
                f"maps them onto the range its weights were trained on. This warning is "
                f"given once per model.", UserWarning, stacklevel=4)
            return

    def input_shapes(self):
        """`{input name: shape without the batch}`: `{"images": (height, width, channels)}`."""
        return {"images": tuple(self.inputs[0].shape[1:])}

    def check_inputs(self, x, method="call"):
        """Raises a `ValueError` unless the static shapes of `x` fit `input_shapes()`."""
        expected = self.input_shapes()
        named_only = len(expected) > 1
        for name, shape in expected.items():
            found = _static_shape(_part(x, name, named_only))
            if found is None:
                continue
            if len(found) == len(shape) + 1 and all(
                    size is None or size == want for size, want in zip(found[1:], shape)):
                continue
            wanted = "(" + ", ".join(str(size) for size in ("batch", *shape)) + ")"
            hint = ""
            if name == "images" and len(shape) == 3:
                wanted = f"(batch, height, width, channels) = {wanted}, channels last"
                hint = image_shape_hint(found[1:], shape)
            raise ValueError(
                f"{type(self).__name__}.{method} got {name} of shape {found}; the model takes "
                f"{name} of shape {wanted}.{hint}")

    def _guarded(self, method, arguments, inputs):
        keras_method = getattr(super(), method)
        bound = inspect.signature(keras_method).bind_partial(*arguments[0], **arguments[1])
        for name in inputs:
            data = bound.arguments.get(name)
            if name == "validation_data" and isinstance(data, (tuple, list)):
                data = data[0] if data else None
            if data is not None:
                self.check_inputs(data, method)
                if name == "x":
                    self.check_pixel_range(data, method)
        with backend.keeping_variables(self):
            return keras_method(*arguments[0], **arguments[1])

    def fit(self, *args, **kwargs):
        return self._guarded("fit", (args, kwargs), ("x", "validation_data"))

    def evaluate(self, *args, **kwargs):
        return self._guarded("evaluate", (args, kwargs), ("x",))

    def predict(self, *args, **kwargs):
        return self._guarded("predict", (args, kwargs), ("x",))

    def train_on_batch(self, *args, **kwargs):
        return self._guarded("train_on_batch", (args, kwargs), ("x",))

    def test_on_batch(self, *args, **kwargs):
        return self._guarded("test_on_batch", (args, kwargs), ("x",))

    def predict_on_batch(self, *args, **kwargs):
        return self._guarded("predict_on_batch", (args, kwargs), ("x",))

    # Keras makes a step function once everything the call needs is built (the
    # optimizer's and the metrics' variables too), before the step that empties them.
    def make_train_function(self, force=False):
        backend.remember_variables(self)
        return super().make_train_function(force)

    def make_test_function(self, force=False):
        backend.remember_variables(self)
        return super().make_test_function(force)

    def make_predict_function(self, force=False):
        backend.remember_variables(self)
        return super().make_predict_function(force)
