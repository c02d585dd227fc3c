"""Keras' trainer entry points, guarded: inputs checked first, weights kept where a call fails."""

import inspect
import sys
import warnings

import numpy as np

from keras_vitnorm import backend
from keras_vitnorm.layers.patch_stem import image_shape_hint
from keras_vitnorm.models.vit_config import MODEL_RANGE
from keras_vitnorm.models.vit_config import pixel_range_of


def _static_shape(data):
    """`data`'s shape as a tuple (`None` for a dimension not known), or `None` if unknown."""
    shape = getattr(data, "shape", None)
    try:
        return tuple(None if size is None else int(size) for size in shape)
    except (TypeError, ValueError):  # no shape, or a shape of unknown rank
        return None


def _part(data, name, named_only):
    """The part of `data` that feeds input `name`; `None` where only reading would tell."""
    spec = getattr(data, "element_spec", None)
    if spec is not None:
        data = spec[0] if isinstance(spec, tuple) else spec
    if isinstance(data, dict):
        return data.get(name)
    return None if named_only else data


#: Images of a call's input whose range is checked (`GuardedCalls.check_pixel_range`).
RANGE_SAMPLE = 64


def _sample_range(data, name, named_only):
    """`(min, max)` of the finite values in up to `RANGE_SAMPLE` images of input `name` (arrays
    or eager tensors), or `None`."""
    part = _part(data, name, named_only)
    if part is None or not len(getattr(part, "shape", ())):
        return None
    try:
        sample = part[:RANGE_SAMPLE]
        images = np.asarray(sample.numpy() if hasattr(sample, "numpy") else sample)
    except Exception:  # noqa: BLE001 (a symbolic tensor, a device tensor)
        return None
    if not np.issubdtype(images.dtype, np.number):
        return None
    finite = images[np.isfinite(images)] if np.issubdtype(images.dtype, np.floating) else images
    return (float(finite.min()), float(finite.max())) if finite.size else None


class GuardedCalls:
    """Mixin (before `keras.Model`) guarding `fit`, `evaluate`, `predict` and `*_on_batch`.

    - Input shapes known without reading the data are checked first (a `ValueError`).
    - Under JAX a call that raises leaves the weights of its last finished step.
    - Images far outside `pixel_ranges()` get a warning once per model (arrays: a sample of
      the first call; a `tf.data.Dataset` as it is read).
    """

    #: Range-check a `tf.data.Dataset`'s batches (the library's trainers turn it off).
    check_datasets = True

    def pixel_ranges(self):
        """`{input name: (low, high)}` of the checked image inputs (the ViT's `pixel_range`)."""
        config = getattr(self, "vit_config", None)
        if config is None:
            return {}
        return {"images": pixel_range_of(config.get("pixel_range", MODEL_RANGE))}

    def _range_advice(self):
        return ("build it on a ViT of the range they have, e.g. "
                "ViT.from_preset(..., pixel_range=[0, 255])")

    def _warn_outside_range(self, name, found, method):
        """Warns once per model where `found` lies over half the range's span outside it."""
        low, high = self.pixel_ranges()[name]
        margin = (high - low) / 2
        if getattr(self, "_pixel_range_warned", False) or (
                found[0] >= low - margin and found[1] <= high + margin):
            return False
        self._pixel_range_warned = True
        warnings.warn(
            f"{type(self).__name__}.{method} got {name} with values in [{found[0]:g}, "
            f"{found[1]:g}]; the model takes {name} in [{low:g}, {high:g}] (its pixel_range). "
            f"Scale them to that range, or {self._range_advice()}: it maps them onto the "
            f"range its weights were trained on. This warning is given once per model.",
            UserWarning, stacklevel=5)
        return True

    def check_pixel_range(self, x, method="call"):
        """`x`, its images checked against `pixel_ranges()` (a dataset mapped to check batches)."""
        ranges = self.pixel_ranges()
        if not ranges or getattr(self, "_pixel_range_warned", False):
            return x
        named_only = len(self.input_shapes()) > 1
        if hasattr(x, "element_spec"):
            return self._checking_dataset(x, method, named_only) if self.check_datasets else x
        if getattr(self, "_pixel_range_checked", False):
            return x
        for name in ranges:
            found = _sample_range(x, name, named_only)
            if found is not None:
                self._pixel_range_checked = True
                self._warn_outside_range(name, found, method)
        return x

    def _checking_dataset(self, dataset, method, named_only):
        """A `tf.data.Dataset` mapped to pass each batch's finite range to `_warn_outside_range`."""
        tf = sys.modules.get("tensorflow")
        if tf is None or not isinstance(dataset, tf.data.Dataset):
            return dataset

        def check(*element):
            checks = []
            for name in self.pixel_ranges():
                images = _part(element[0], name, named_only)
                if not isinstance(images, tf.Tensor) or not (images.dtype.is_floating
                                                             or images.dtype.is_integer):
                    continue  # another structure, a ragged or sparse tensor: not checked
                values = tf.cast(images, "float32")
                finite = tf.math.is_finite(values)
                low = tf.reduce_min(tf.where(finite, values, np.inf))
                high = tf.reduce_max(tf.where(finite, values, -np.inf))
                checks.append(tf.py_function(
                    lambda lo, hi, name=name: self._warn_outside_range(
                        name, (float(lo), float(hi)), method) if lo <= hi else False,
                    [low, high], tf.bool))
            if checks:  # the element waits for them (and is otherwise the same)
                with tf.control_dependencies(checks):
                    element = tf.nest.map_structure(tf.identity, element)
            return element if len(element) > 1 else element[0]

        return dataset.map(check)

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
                    bound.arguments["x"] = self.check_pixel_range(data, method)
        with backend.keeping_variables(self):
            return keras_method(*bound.args, **bound.kwargs)

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

    # Keras makes a step function once all variables exist, before a step empties them.
    def make_train_function(self, force=False):
        backend.remember_variables(self)
        return super().make_train_function(force)

    def make_test_function(self, force=False):
        backend.remember_variables(self)
        return super().make_test_function(force)

    def make_predict_function(self, force=False):
        backend.remember_variables(self)
        return super().make_predict_function(force)
