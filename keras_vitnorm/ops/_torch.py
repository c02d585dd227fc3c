"""PyTorch forms of the ops (imported only under the PyTorch backend)."""

import functools
import inspect
import platform

import keras
import torch

try:  # Keras' autocast scope (private), which `call_layer` enters as `Layer.__call__` does
    from keras.src.backend.common.variables import AutocastScope
    from keras.src.backend.common.variables import get_autocast_scope
except ImportError:  # then every layer is called through `Layer.__call__`
    AutocastScope = get_autocast_scope = None
try:  # the scopes Keras' `Variable.value` looks at (private), for `variable_value`
    from keras.src.backend.common.stateless_scope import in_stateless_scope
    from keras.src.backend.torch.core import get_device
except ImportError:  # then `variable_value` reads `variable.value`
    in_stateless_scope = get_device = None
try:  # what a functional model's graph runs each node through (private), for `call_graph`
    from keras.src.models.functional import operation_fn as keras_operation_fn
except ImportError:  # then the model is called through Keras' `Functional.call`
    keras_operation_fn = None

#: PyTorch's global module hooks, which `torch.nn.Module.__call__` runs for every module.
_GLOBAL_HOOKS = ("_global_backward_pre_hooks", "_global_backward_hooks",
                 "_global_forward_hooks", "_global_forward_pre_hooks")
#: A module's own hooks, which it runs from its `__call__`.
_MODULE_HOOKS = ("_backward_pre_hooks", "_backward_hooks", "_forward_hooks",
                 "_forward_pre_hooks")


def call_layer(layer, x, training):
    """`keras_vitnorm.ops.call_layer` on PyTorch: `layer.call` directly where nothing of
    `Layer.__call__` but the input cast and the autocast scope applies."""
    if not _calls_directly(layer, x):
        return layer(x, training=training)
    if x.is_floating_point() and x.dtype != getattr(torch, layer.input_dtype, None):
        x = layer.dtype_policy.convert_input(x, layer.autocast, layer.input_dtype)
    kwargs = {"training": training} if _takes_training(type(layer)) else {}
    scope = _autocast_scope(layer)
    if scope is None:
        return layer.call(x, **kwargs)
    with scope:
        return layer.call(x, **kwargs)


def call_graph(model, functional_call, inputs, training):
    """`keras_vitnorm.ops.call_graph` on PyTorch: the functional model's graph run by
    Keras' private `_run_through_graph`, each layer on one tensor called through
    `call_layer`, every other node as Keras' `Functional.call` calls it."""
    run = getattr(model, "_run_through_graph", None)
    standardize = getattr(model, "_standardize_inputs", None)
    if (keras_operation_fn is None or run is None or standardize is None or compiling()
            or training is None):  # None: Keras' layers take the call context's value instead
        return functional_call(inputs, training=training)

    def operation_fn(operation):
        keras_call = keras_operation_fn(operation, training=training)
        if not isinstance(operation, keras.layers.Layer):
            return keras_call

        def call(*args, **kwargs):
            # A node keeps the `mask=None` that Keras filled in when the graph was built.
            if len(args) == 1 and kwargs in ({}, {"mask": None}):
                return call_layer(operation, args[0], training)
            return keras_call(*args, **kwargs)

        return call

    outputs = run(standardize(inputs), operation_fn=operation_fn)
    if isinstance(outputs, (list, tuple)) and len(outputs) == 1:
        return outputs[0]  # as `Functional.call` returns a single output
    return outputs


def _calls_directly(layer, x):
    """Whether `Layer.__call__` would do nothing for `layer` on `x` but cast it and set
    the autocast scope. Private attributes missing from a later Keras or PyTorch count
    as "it would" (`Layer.__call__` then runs)."""
    if get_autocast_scope is None or compiling() or not layer.built:
        return False
    if not isinstance(x, torch.Tensor) or getattr(x, "_keras_mask", None) is not None:
        return False
    if _makes_masks(type(layer)):  # Keras' call would set the mask it computes on the output
        return False
    if (getattr(layer, "quantization_mode", None) is not None
            or getattr(layer, "_remat_mode", True)
            or layer.activity_regularizer is not None
            or not getattr(layer, "_convert_input_args", False)
            or keras.distribution.distribution() is not None):
        return False
    module_state = torch.nn.modules.module
    return not (any(getattr(layer, name, True) for name in _MODULE_HOOKS)
                or any(getattr(module_state, name, True) for name in _GLOBAL_HOOKS))


def _autocast_scope(layer):
    """The autocast scope `Layer.__call__` enters for `layer`, or `None` where it keeps
    the current one (its step 7)."""
    current = get_autocast_scope()
    if current is not None:
        if not layer.autocast or not keras.backend.is_float_dtype(layer.compute_dtype):
            return AutocastScope(None)
        if current.dtype != layer.compute_dtype:
            return AutocastScope(layer.compute_dtype)
        return None
    if layer.compute_dtype != layer.variable_dtype:
        return AutocastScope(layer.compute_dtype)
    return None


@functools.cache
def _makes_masks(layer_class):
    return getattr(layer_class, "compute_mask", None) is not keras.layers.Layer.compute_mask


@functools.cache
def _takes_training(layer_class):
    return "training" in inspect.signature(layer_class.call).parameters


def linear(x, kernel, bias, use_onednn):
    """`x @ kernel + bias` in one call, as `torch.nn.Linear` computes it.

    `keras.ops` has no matmul-plus-bias op, and eager PyTorch runs Keras' separate
    bias add as a second pass over the output; `torch.nn.functional.linear` fuses it
    (`addmm`). With `use_onednn`, where no gradient is recorded on a float32 x86 CPU,
    oneDNN's linear runs instead (`onednn_linear`), except under `torch.compile`,
    which picks its own kernel (and would have to trace `onednn_linear`'s check).
    """
    on_cpu = x.dtype == torch.float32 and x.device.type == "cpu"
    if use_onednn and on_cpu and not compiling() and not (
        torch.is_grad_enabled()
        and (x.requires_grad or kernel.requires_grad or (bias is not None and bias.requires_grad))
    ):
        op = onednn_linear()
        if op is not None:
            return op(x, kernel.T, bias, "none", [], "")
    return torch.nn.functional.linear(x, kernel.T, bias)


def reshape(x, shape):
    """`torch.reshape`, for `keras_vitnorm.ops.reshape`."""
    return torch.reshape(tensor(x), (shape,) if isinstance(shape, int) else tuple(shape))


def layer_norm(x, gamma, beta, epsilon, dtype):
    """`keras_vitnorm.ops.layer_norm` as Keras' PyTorch backend computes it: `x`, `gamma`
    and `beta` in float32 at least, `torch.nn.functional.layer_norm`, back to `x`'s
    dtype, then to `dtype`. The normalized width is a Python int, so that a TorchScript
    trace (Keras' ONNX export with a dynamic batch) keeps it a constant, as ONNX's
    LayerNormalization needs."""
    x = tensor(x)
    compute = torch.promote_types(x.dtype, torch.float32)
    gamma, beta = (None if w is None else tensor(w).to(compute) for w in (gamma, beta))
    width = (int(x.shape[-1]),)
    y = torch.nn.functional.layer_norm(x.to(compute), width, gamma, beta, epsilon).to(x.dtype)
    return y if dtype is None else y.to(_torch_dtype(dtype))


def tensor(value):
    """`keras_vitnorm.ops.tensor` on PyTorch: a tensor as it is, a Keras variable's value
    by `variable_value`, anything else by Keras' conversion; one that lies on another
    device than the current one (weights loaded under `keras.device("cpu")` on a GPU
    host) is moved there by Keras' conversion, as `keras.ops.convert_to_tensor` moves it."""
    device = None if get_device is None else _device_kind(get_device())
    if isinstance(value, keras.Variable):
        read = variable_value(value, device)
    elif isinstance(value, torch.Tensor):
        read = value
    else:
        return keras.ops.convert_to_tensor(value)
    return read if _on_device(read, device) else keras.ops.convert_to_tensor(read)


def _on_device(x, device):
    """Whether `x` lies on `device`, Keras' current one as `(kind, index)` (as `Tensor.to`
    would leave it there; a device without an index is the current one of its kind).
    Without Keras' private `get_device` (`device` None), never: the caller then converts
    as Keras does."""
    if device is None:
        return False
    kind, index = device
    if kind == "cpu":
        return x.is_cpu
    if kind == "cuda":
        return x.is_cuda and x.get_device() == (torch.cuda.current_device() if index is None else index)
    return x.device.type == kind and (index is None or x.device.index == index)


def variable_value(variable, device):
    """`variable.value` in an eager call on `device` (Keras' current one as `(kind,
    index)`, or `None` without Keras' private `get_device`): its PyTorch parameter,
    cast to the autocast scope's dtype where the variable autocasts and is a float.

    Keras' PyTorch `Variable.value` computes that through `backend.cast` and its dtype
    checks; here it is one `Tensor.to`. Where Keras' property does more (a stateless
    scope, which substitutes values; the "meta" device of a symbolic call; an
    uninitialized variable; `torch.compile`), or where the private names it reads
    are missing, this returns `variable.value` itself.
    """
    value = getattr(variable, "_value", None)
    autocasts = getattr(variable, "_autocast", None)
    if (in_stateless_scope is None or device is None or get_autocast_scope is None
            or autocasts is None or not isinstance(value, torch.Tensor) or compiling()
            or in_stateless_scope() or device[0] == "meta"):
        return variable.value
    scope = get_autocast_scope()
    if autocasts and scope is not None and scope.dtype is not None and value.is_floating_point():
        dtype = _torch_dtype(scope.dtype)
        if value.dtype != dtype:
            return value.to(dtype)
    return value


@functools.cache
def _device_kind(device):
    device = device if isinstance(device, torch.device) else torch.device(device)
    return device.type, device.index


@functools.cache
def _torch_dtype(dtype):
    return getattr(torch, keras.backend.standardize_dtype(dtype))


def compiling():
    """Whether `torch.compile` is tracing the code that calls this."""
    return torch.compiler.is_compiling()


@functools.cache
def onednn_linear():
    """PyTorch's oneDNN float32 linear op (`torch.ops.mkldnn._linear_pointwise`), or `None`.

    PyTorch's CPU wheels run a float32 `torch.nn.functional.linear` through MKL; the
    oneDNN library that the same wheel ships (and that Inductor calls for linear
    layers on x86 CPUs) runs it at XLA's rate (docs/performance.md). The op has no
    autograd formula, so `linear` calls it only where no gradient is recorded, and
    only outside `torch.compile`.

    It is a private op, so it is used only where it exists, the CPU is x86-64 with
    oneDNN available, and a small product through it matches
    `torch.nn.functional.linear`; otherwise this returns `None` and `linear` keeps
    `torch.nn.functional.linear`. Checked once per process.
    """
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return None
    op = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if op is None:
        return None
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=generator)
    weight = torch.randn(16, 8, generator=generator)
    bias = torch.randn(8, generator=generator)
    try:
        with torch.no_grad():
            matches = all(
                torch.allclose(op(x, weight.T, b, "none", [], ""),
                               torch.nn.functional.linear(x, weight.T, b), rtol=1e-5, atol=1e-5)
                for b in (bias, None)
            )
    except (RuntimeError, TypeError):
        return None
    return op if matches else None


def attention(q, k, v):
    """Softmax attention by `torch.nn.functional.scaled_dot_product_attention` on views.

    Keras' PyTorch attention moves the heads axis forward and, unless its
    flash-attention check passes (never on a CPU), copies q, k and v into contiguous
    memory first; PyTorch's function takes the strided views itself and picks its
    kernel itself (cuDNN's attention on an H100, where Keras forces
    FlashAttention-2), as the transformers ViT calls it.

    Args:
        q, k, v: tensors `(batch, tokens, heads, head_dim)`, one dtype.
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
