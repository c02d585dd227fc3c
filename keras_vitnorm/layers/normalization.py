"""Normalization layers and `make_norm`, which maps a `norm` string to a layer; why some
compute in float32: docs/normalization.md."""

import importlib
import importlib.util
import inspect
import os
import pathlib

import keras
from keras import ops

from keras_vitnorm.choices import NORM_TYPES
from keras_vitnorm.choices import STEM_NORM_TYPES
from keras_vitnorm.ops import layer_norm
from keras_vitnorm.validation import check_bool
from keras_vitnorm.validation import did_you_mean
from keras_vitnorm.validation import check_positive_float
from keras_vitnorm.validation import check_positive_int


#: Keras `BatchNormalization` momentum matching PyTorch's 0.1 (pycls, timm).
BATCHNORM_MOMENTUM = 0.9


def _float32(weight):
    # Weights are float16 or bfloat16 under such a variable dtype; TensorFlow does not
    # promote them to the float32 they are combined with here.
    return ops.cast(weight, "float32")


class _Float32Norm(keras.layers.Layer):
    """A shape-keeping layer that computes in float32 (no autocast) and passes masks on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.autocast = False
        self.supports_masking = True

    def compute_output_shape(self, input_shape):
        return input_shape


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class LayerNormalization(keras.layers.LayerNormalization):
    """Keras' `LayerNormalization` with its last-axis call through `ops.layer_norm`.

    Same arguments, weights, config, class name and numbers; on PyTorch the normalized width
    stays a Python int, which Keras' ONNX export with an open batch size needs.
    """

    def call(self, inputs):
        if self.rms_scaling or self.axis not in ([-1], [len(inputs.shape) - 1]):
            return super().call(inputs)
        return layer_norm(inputs, self.gamma, self.beta, self.epsilon, dtype=self.compute_dtype)


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class RMSNorm(_Float32Norm):
    """RMSNorm over the last axis: `x / sqrt(mean(x**2) + epsilon) * scale`, in float32.

    Args:
        epsilon: float, default `1e-6`.
        scale: bool, default `True`. Learn a per-channel gain (init 1); `False` standardizes only.
        **kwargs: base layer keyword arguments.

    Example:
    >>> y = RMSNorm(epsilon=1e-6)(keras.random.normal((2, 5, 8)))

    Reference:
    - [Zhang & Sennrich, 2019](https://arxiv.org/abs/1910.07467)
    """

    def __init__(self, epsilon=1e-6, scale=True, **kwargs):
        super().__init__(**kwargs)
        check_positive_float("epsilon", epsilon)
        check_bool("scale", scale)
        self.epsilon = epsilon
        self.scale = scale

    def build(self, input_shape):
        self.gamma = None
        if self.scale:
            self.gamma = self.add_weight(name="scale", shape=(input_shape[-1],), initializer="ones",
                                         autocast=False)

    def call(self, x):
        scale = None if self.gamma is None else _float32(self.gamma)
        y = ops.rms_normalization(ops.cast(x, "float32"), scale=scale, epsilon=self.epsilon)
        return ops.cast(y, self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "epsilon": self.epsilon, "scale": self.scale}


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class BatchNorm(keras.layers.BatchNormalization):
    """Keras `BatchNormalization` that keeps float32 inputs in float32; returns the compute dtype.

    On `(batch, tokens, channels)` the statistics are per channel over batch x tokens.

    Example:
    >>> y = BatchNorm(momentum=0.9, epsilon=1e-6)(keras.random.normal((2, 5, 8)))
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.autocast = False

    def call(self, inputs, training=None, mask=None):
        outputs = super().call(inputs, training=training, mask=mask)
        return ops.cast(outputs, self.compute_dtype)


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class DyT(_Float32Norm):
    """Dynamic Tanh `gamma * tanh(alpha * x) + beta` (scalar `alpha`), in float32.

    Args:
        alpha_init: float, default `0.5` (the paper's value for ViTs).
        affine: bool, default `True`. `False` drops `gamma`/`beta` and freezes `alpha`.
        **kwargs: base layer keyword arguments.

    Example:
    >>> y = DyT(alpha_init=0.5)(keras.random.normal((2, 5, 8)))

    Reference:
    - [Zhu et al., Transformers without Normalization, 2025](https://arxiv.org/abs/2503.10622)
    """

    def __init__(self, alpha_init=0.5, affine=True, **kwargs):
        super().__init__(**kwargs)
        check_positive_float("alpha_init", alpha_init)
        check_bool("affine", affine)
        self.alpha_init = alpha_init
        self.affine = affine

    def build(self, input_shape):
        self.alpha = self.add_weight(name="alpha", shape=(),
                                     initializer=keras.initializers.Constant(self.alpha_init),
                                     trainable=self.affine, autocast=False)
        self.gamma = self.beta = None
        if self.affine:
            dim = input_shape[-1]
            self.gamma = self.add_weight(name="gamma", shape=(dim,), initializer="ones", autocast=False)
            self.beta = self.add_weight(name="beta", shape=(dim,), initializer="zeros", autocast=False)

    def call(self, x):
        y = ops.tanh(_float32(self.alpha) * ops.cast(x, "float32"))
        if self.affine:
            y = y * _float32(self.gamma) + _float32(self.beta)
        return ops.cast(y, self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "alpha_init": self.alpha_init, "affine": self.affine}


@keras.saving.register_keras_serializable(package="keras_vitnorm")
class Affine(_Float32Norm):
    """`gamma * x + beta` per channel, no standardization: Dual PatchNorm's `stem_norm="affine"`.

    Example:
    >>> y = Affine()(keras.random.normal((2, 5, 8)))
    """

    def build(self, input_shape):
        dim = input_shape[-1]
        self.gamma = self.add_weight(name="gamma", shape=(dim,), initializer="ones", autocast=False)
        self.beta = self.add_weight(name="beta", shape=(dim,), initializer="zeros", autocast=False)

    def call(self, x):
        y = ops.cast(x, "float32") * _float32(self.gamma) + _float32(self.beta)
        return ops.cast(y, self.compute_dtype)


#: The Keras serialization package `register_norm` registers a user's norm class in.
USER_NORM_PACKAGE = "keras_vitnorm.norms"
#: Environment variable: modules (dotted names or `.py` paths, comma-separated) that
#: register norms, imported the first time a norm name is not found.
NORM_MODULES_VARIABLE = "KERAS_VITNORM_NORM_MODULES"


def register_norm(name, layer_class=None):
    """Registers a normalization layer class under `name`, usable wherever a norm name is.

    A function or a class decorator. The class normalizes the last axis and is built as
    `layer_class(name=..., dtype=...)` (plus `epsilon=` if it takes one); docs/your-norm.md.

    Args:
        name: str. A new name: not a built-in norm, letters, digits and underscores.
        layer_class: a `keras.layers.Layer` subclass, or None to return a decorator.

    Raises `ValueError` for a bad, built-in or taken name, `TypeError` for a non-Layer class.

    Example:
    >>> @register_norm("scalenorm")
    ... class ScaleNorm(keras.layers.Layer):
    ...     def build(self, shape):
    ...         self.g = self.add_weight(shape=(), initializer="ones")
    ...     def call(self, x):
    ...         return self.g * x / ops.maximum(ops.norm(x, axis=-1, keepdims=True), 1e-5)
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(
            f"A norm name is a string of letters, digits and underscores, got {name!r}.")
    if name in STEM_NORM_TYPES:
        raise ValueError(f"norm {name!r} is a built-in norm; register yours under another name.")

    def register(cls):
        if not (isinstance(cls, type) and issubclass(cls, keras.layers.Layer)):
            raise TypeError(f"register_norm({name!r}, ...) takes a keras.layers.Layer subclass, "
                            f"got {cls!r}.")
        previous = user_norm_class(name, import_modules=False)
        if previous is not None and previous.__qualname__ != cls.__qualname__:
            raise ValueError(f"norm {name!r} is already registered to {previous.__qualname__}; "
                             f"pick another name for {cls.__qualname__}.")
        return keras.saving.register_keras_serializable(package=USER_NORM_PACKAGE, name=name)(cls)

    return register if layer_class is None else register(layer_class)


#: The entries of `KERAS_VITNORM_NORM_MODULES` this process has imported.
_imported_entries = set()


def import_norm_modules():
    """Imports the `KERAS_VITNORM_NORM_MODULES` not imported yet; a missing one: `ValueError`."""
    entries = (entry.strip() for entry in os.environ.get(NORM_MODULES_VARIABLE, "").split(","))
    for entry in filter(None, entries):
        if entry in _imported_entries:
            continue
        if entry.endswith(".py"):
            path = pathlib.Path(entry).expanduser().resolve()
            if not path.is_file():
                raise ValueError(f"{NORM_MODULES_VARIABLE} lists {entry!r}, which is not a file.")
            module_name = f"keras_vitnorm_user_norms_{path.stem}"
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            try:
                importlib.import_module(entry)
            except ModuleNotFoundError as error:
                raise ValueError(f"{NORM_MODULES_VARIABLE} lists module {entry!r}, which cannot be "
                                 f"imported: {error}.") from error
        _imported_entries.add(entry)


def user_norm_class(name, import_modules=True):
    """The class registered under `name`, or None; imports the norm modules once if not found."""
    key = f"{USER_NORM_PACKAGE}>{name}"
    found = keras.saving.get_custom_objects().get(key)
    if found is None and import_modules:
        import_norm_modules()
        found = keras.saving.get_custom_objects().get(key)
    return found


def registered_norms(import_modules=False):
    """The sorted `register_norm` names; with `import_modules`, after importing the norm modules."""
    if import_modules:
        import_norm_modules()
    prefix = f"{USER_NORM_PACKAGE}>"
    return sorted(key.removeprefix(prefix) for key in keras.saving.get_custom_objects()
                  if key.startswith(prefix))


def check_norm(argument, value, stem=False):
    """A `ValueError` unless `value` is a built-in (stem if `stem`) or a registered norm."""
    built_in = STEM_NORM_TYPES if stem else NORM_TYPES
    if value in built_in or (isinstance(value, str) and user_norm_class(value) is not None):
        return value
    registered = registered_norms()
    modules = os.environ.get(NORM_MODULES_VARIABLE) or "unset"
    raise ValueError(
        f"Unknown {argument}={value!r}.{did_you_mean(value, [*built_in, *registered])} Valid: "
        f"{', '.join(map(repr, built_in))}, or a name registered with "
        f"keras_vitnorm.layers.register_norm (registered here: "
        f"{', '.join(map(repr, registered)) or 'none'}; {NORM_MODULES_VARIABLE}, the modules "
        f"that register them for the command line and its workers: {modules}).")


def check_norm_options(epsilon, groups, prefix=""):
    """Checks `make_norm`'s `epsilon` and `groups`, named `{prefix}epsilon`, `{prefix}groups`."""
    check_positive_float(f"{prefix}epsilon", epsilon)
    check_positive_int(f"{prefix}groups", groups)


def make_norm(norm, epsilon=1e-6, learnable=True, groups=32, name=None, dtype=None):
    """A new normalization layer for a `norm` string (docs/normalization.md, Norm types).

    Args:
        norm: str, one of `NORM_TYPES`, `"affine"`, or a `register_norm` name.
        epsilon: float, default `1e-6` (the ViT value; Keras' default is 1e-3).
        learnable: bool, default `True`. `False`: standardize only; invalid for `"affine"`.
        groups: int, default `32`, for `groupnorm`.
        name, dtype: the layer's name and dtype policy.

    Example:
    >>> layer = make_norm("rmsnorm", epsilon=1e-6)
    """
    check_norm("norm", norm, stem=True)
    check_norm_options(epsilon, groups)
    check_bool("learnable", learnable)
    common = {"name": name, "dtype": dtype}
    if norm not in STEM_NORM_TYPES:
        if not learnable:
            raise ValueError(
                f"norm {norm!r} is a registered norm, which is used as its class defines it: "
                "learnable=False (stem_norm_learnable=False) takes a built-in norm.")
        cls = user_norm_class(norm)
        if "epsilon" in inspect.signature(cls.__init__).parameters:
            common["epsilon"] = epsilon
        return cls(**common)
    if norm == "layernorm":
        return LayerNormalization(epsilon=epsilon, center=learnable, scale=learnable, **common)
    if norm == "rmsnorm":
        return RMSNorm(epsilon=epsilon, scale=learnable, **common)
    if norm == "batchnorm":
        return BatchNorm(axis=-1, momentum=BATCHNORM_MOMENTUM, epsilon=epsilon,
                         center=learnable, scale=learnable, **common)
    if norm == "groupnorm":
        return keras.layers.GroupNormalization(groups=groups, axis=-1, epsilon=epsilon,
                                               center=learnable, scale=learnable, **common)
    if norm == "dyt":
        return DyT(affine=learnable, **common)
    if norm == "affine":
        if not learnable:
            raise ValueError(
                "norm='affine' is the learnable scale and shift alone; with "
                "learnable=False it would do nothing. Use norm='identity' instead.")
        return Affine(**common)
    return keras.layers.Identity(**common)
