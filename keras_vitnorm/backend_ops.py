"""The one module with backend-specific code.

Keras has no backend-neutral "gradient of this function" op, no hook into how XLA
fuses a backward pass, and no reader for PyTorch checkpoints, so each backend gets
one small function here. Everything else in the library uses `keras.ops` only.
"""

import functools

import keras
import numpy as np


def value_and_gradients(model, inputs, loss_fn, training=False):
    """Computes a loss and its gradients with respect to the inputs and weights.

    Args:
        model: a built Keras model.
        inputs: NumPy array fed to the model.
        loss_fn: callable mapping the model output (a backend tensor) to a scalar.
        training: bool, default `False`. Passed to the model call.

    Returns:
        `(loss, input_gradient, {variable path: gradient})` as NumPy values. A
        weight the loss does not depend on gets a zero gradient.

    Example:
    >>> loss, dx, dw = value_and_gradients(model, x, lambda y: keras.ops.sum(y))
    """
    backend = keras.backend.backend()
    if backend == "jax":
        loss, input_grad, grads = _jax(model, inputs, loss_fn, training)
    elif backend == "tensorflow":
        loss, input_grad, grads = _tensorflow(model, inputs, loss_fn, training)
    elif backend == "torch":
        loss, input_grad, grads = _torch(model, inputs, loss_fn, training)
    else:
        raise ValueError(
            f"value_and_gradients supports the jax, tensorflow and torch backends, not {backend!r}."
        )
    to_numpy = keras.ops.convert_to_numpy
    weight_grads = {}
    for variable, grad in zip(model.trainable_variables, grads):
        weight_grads[variable.path] = (
            np.zeros(variable.shape, "float32") if grad is None else to_numpy(grad)
        )
    return float(to_numpy(loss)), to_numpy(input_grad), weight_grads


def linear(x, kernel, bias=None):
    """`x @ kernel + bias`, with the bias add fused into the matmul on PyTorch.

    Why it exists: `keras.ops` has no matmul-plus-bias op, so Keras' `Dense` runs
    a matmul and a separate broadcast add. XLA (JAX, TensorFlow) fuses the add into
    the matmul's output, but eager PyTorch runs it as its own pass over the output,
    and its CPU `mm` path was slower than the `addmm` that `torch.nn.Linear` uses:
    in a CPU profile of S/16 inference, 2.33 s of `mm` plus 150 ms of bias adds
    against the reference's 2.14 s of `addmm` (docs/performance.md). On PyTorch
    this calls `torch.nn.functional.linear` (the same result up to float32
    rounding, tested against `Dense`); elsewhere it is `ops.matmul` then
    `ops.add`, exactly as Keras' `Dense`. Mixed dtypes take the Keras path too.

    Where no gradient is recorded (prediction runs under `torch.no_grad`) on a
    float32 x86 CPU, PyTorch's oneDNN linear (`torch_onednn_linear`) runs
    instead of `torch.nn.functional.linear`, whose float32 matmul is MKL's.

    Args:
        x: tensor `(..., in)`.
        kernel: tensor or variable `(in, out)`.
        bias: tensor, variable or `None`, `(out,)`.

    Returns:
        Tensor `(..., out)`.
    """
    kernel = keras.ops.convert_to_tensor(kernel)
    bias = None if bias is None else keras.ops.convert_to_tensor(bias)
    same_dtype = x.dtype == kernel.dtype and (bias is None or bias.dtype == x.dtype)
    if keras.backend.backend() == "torch" and same_dtype:
        import torch

        onednn_linear = torch_onednn_linear()
        if (
            onednn_linear is not None
            and x.dtype == torch.float32
            and x.device.type == "cpu"
            and not (
                torch.is_grad_enabled()
                and (x.requires_grad or kernel.requires_grad or (bias is not None and bias.requires_grad))
            )
        ):
            return onednn_linear(x, kernel.T, bias, "none", [], "")
        return torch.nn.functional.linear(x, kernel.T, bias)
    y = keras.ops.matmul(x, kernel)
    return y if bias is None else keras.ops.add(y, bias)


@functools.cache
def torch_onednn_linear():
    """PyTorch's oneDNN float32 linear op (`torch.ops.mkldnn._linear_pointwise`), or `None`.

    Why it exists: PyTorch's CPU wheels run a float32 `torch.nn.functional.linear`
    through MKL, and on the AMD EPYC host of docs/performance.md MKL's float32
    matmul reached 195 to 206 GFLOP/s, where the oneDNN library that the same
    wheel ships (and that Inductor calls for linear layers on x86 CPUs) reached
    the rate XLA did: 2.2 to 2.3x faster on each of an S/16 block's four linear
    layers at batch 16 (docs/performance.md). The op has no autograd formula, so
    `linear` calls it only where no gradient is recorded.

    It is a private op, so it is used only where it exists, the CPU is x86-64
    with oneDNN available, and a small product through it matches
    `torch.nn.functional.linear`; otherwise this returns `None` and `linear`
    keeps `torch.nn.functional.linear`. Checked once per process.
    """
    import platform

    import torch

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


def torch_attention(q, k, v):
    """`keras.ops.dot_product_attention(q, k, v)` on PyTorch, without copying q, k and v.

    Why it exists: Keras' PyTorch attention moves the heads axis forward and, unless
    its flash-attention check passes (never on a CPU), copies q, k and v into
    contiguous memory before `torch.nn.functional.scaled_dot_product_attention`.
    That function takes the strided views itself, as the transformers ViT passes
    them, and picks its kernel itself. On one S/16 attention layer on CPU (batch
    16) the copies cost 1.6 ms of 25.5 forward and 3.3 ms of 79 forward and
    backward. On an H100 (B/16, bfloat16, batch 256) Keras' check passes and it
    forces FlashAttention-2, where PyTorch picks cuDNN's attention, as the
    reference does: training steps 144 against 153 ms (docs/performance.md).
    Same result (tested). PyTorch only.

    Args:
        q, k, v: tensors `(batch, tokens, heads, head_dim)`, one dtype.

    Returns:
        Tensor `(batch, tokens, heads, head_dim)`.
    """
    import torch

    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def jax_cudnn_attention_fits(q, k, v):
    """Whether JAX's cuDNN attention takes these q, k and v once their tokens are padded.

    JAX backend on an NVIDIA GPU of compute capability 8.0 or more, one dtype,
    bfloat16 or float16, and a head dimension that is a multiple of 8 and at most
    128 (256 from compute capability 9.0): the conditions JAX (0.11) checks
    besides the token count. `False` on every other backend and on a CPU.
    """
    if keras.backend.backend() != "jax" or not q.dtype == k.dtype == v.dtype:
        return False
    import jax

    if jax.default_backend() != "gpu" or str(q.dtype) not in ("bfloat16", "float16"):
        return False
    capability = getattr(jax.devices()[0], "compute_capability", None)
    try:
        major, minor = (int(part) for part in str(capability).split(".")[:2])
    except ValueError:  # not a CUDA device (no "major.minor" capability)
        return False
    head_dim = q.shape[-1]
    return (major, minor) >= (8, 0) and head_dim % 8 == 0 and head_dim <= (256 if major >= 9 else 128)


def jax_padded_attention(q, k, v, implementation="cudnn", multiple=8):
    """Softmax attention on tokens padded to a multiple of `multiple`, the padding masked (JAX).

    Why it exists: JAX's cuDNN flash attention rejects an odd token count at
    training time ("Unsupported sequence length Q 197, KV 197", jax 0.11), and a
    ViT with a class token has 197 tokens at 224 pixels. Keras then falls back to
    XLA's attention, whose backward pass is twice as slow: on an H100 (B/16,
    bfloat16, batch 256) one layer's attention took 3.38 ms forward and backward
    under XLA and 1.61 ms under cuDNN with the tokens padded to 200, and a whole
    training step 133.6 against 102.9 ms (docs/performance.md). Here q, k and v
    get zero tokens up to the multiple, `jax.nn.dot_product_attention` masks
    them out through `query_seq_lengths` and `key_value_seq_lengths`, and the
    padded rows of the output are dropped. Same values and gradients as
    unpadded attention (tested on the CPU with `implementation="xla"`, which
    takes the same arguments). If JAX still rejects the inputs, this falls back
    to XLA's attention on the unpadded tokens.

    Args:
        q, k, v: JAX arrays `(batch, tokens, heads, head_dim)`, one dtype.
        implementation: `"cudnn"` (default) or `"xla"`, for `jax.nn.dot_product_attention`.
        multiple: int, default 8. The padded token count is its multiple.

    Returns:
        Array `(batch, tokens, heads, head_dim)`.
    """
    import jax
    import jax.numpy as jnp

    tokens = q.shape[1]
    pad = -tokens % multiple
    padded = [jnp.pad(t, ((0, 0), (0, pad), (0, 0), (0, 0))) for t in (q, k, v)]
    lengths = jnp.full((q.shape[0],), tokens, jnp.int32)
    try:
        out = jax.nn.dot_product_attention(
            *padded, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
            implementation=implementation)
    except NotImplementedError:
        return jax.nn.dot_product_attention(q, k, v, implementation="xla")
    return out[:, :tokens]


def gradient_fence(x):
    """Identity whose gradient XLA on CPU must materialize; use on the residual stream.

    Why it exists: in a pre-LN transformer the gradient of the residual stream is
    a chain of element-wise adds through every block. XLA's CPU compiler (jaxlib
    0.10) fuses that whole chain, and duplicates it into each consumer: every
    block's weight-gradient transpose re-reads up to ~96 tensors, so the backward
    pass grows with depth squared. On S/16 at batch 16 the gradient took 8.2 s;
    with the fence it takes 4.4 to 4.8 s (docs/performance.md). Passing the
    gradient through a `lax.cond` (whose branches both return it) ends the fusion
    at each block; `optimization_barrier` does not, because the CPU compiler
    removes barriers before fusion. The conditional sits only in the transpose
    (reverse mode) and its predicate is read from the incoming gradient, so the
    backward pass keeps nothing from the forward pass for it; forward-mode
    autodiff (`jax.jvp`) passes the tangent through untouched. This form was
    2.9% (and, before `retain_freed_memory`, 5.6%) faster per S/16 training step
    than a conditional on the tangent with its predicate taken from the forward
    value (`benchmarks/bench_ab.py --changes fence_transpose`).

    The forward value and the gradient are unchanged. On other backends, and on
    JAX off CPU (where a conditional would copy its predicate to the host), this
    returns `x` untouched.

    Args:
        x: tensor.

    Returns:
        `x`.
    """
    if keras.backend.backend() != "jax" or not jax_or_tensorflow_on_cpu():
        return x
    return _jax_fence()(x)


def jax_or_tensorflow_on_cpu():
    """Whether the backend is JAX or TensorFlow and computes on a CPU: no GPU or TPU in use.

    JAX: its default backend is the CPU (where it always compiles with XLA).
    TensorFlow: no logical GPU or TPU device. On such a machine Keras runs
    TensorFlow's steps as a graph of TensorFlow's own kernels, without XLA
    (`jit_compile="auto"` resolves to `False` there). PyTorch: `False`.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return jax.default_backend() == "cpu"
    if backend == "tensorflow":
        import tensorflow as tf

        return not (tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"))
    return False


def torch_forward_is_plain(module):
    """Whether calling this PyTorch module would go straight to its `forward`.

    That is PyTorch's own test in `Module._call_impl`: no forward or backward
    hooks on the module or registered globally, no `torch.jit.trace` in
    progress, and no `Module.compile()` wrapper. `layers._calls.call_sublayer`
    skips Keras' `Layer.__call__` only where this holds, so a hook a user
    registers on a sublayer always runs.
    """
    torch, torch_module = _torch_modules()
    return not (
        module._compiled_call_impl is not None
        or torch._C._get_tracing_state()
        or module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
        or torch_module._global_backward_hooks
        or torch_module._global_backward_pre_hooks
    )


@functools.cache
def _torch_modules():
    import torch
    from torch.nn.modules import module as torch_module

    return torch, torch_module


def conditional_identity(probe, value):
    """`value` through a JAX `lax.cond` whose predicate, read from `probe`, XLA cannot fold.

    Both branches return `value` (the second also when `probe`'s first element
    is not finite), so the conditional stays in the compiled program and ends
    XLA's fusion there. The core of the gradient fence; JAX only.
    """
    import jax

    keep = jax.numpy.isfinite(probe.reshape(-1)[0])
    return jax.lax.cond(keep, lambda g: g, lambda g: g * 1, value)


@functools.cache
def _jax_fence():
    import jax
    from jax.custom_derivatives import linear_call

    def identity(_, tangent):
        return tangent

    def transpose(_, cotangent):
        return conditional_identity(cotangent, cotangent)

    # A custom JVP whose tangent map is linear with a custom transpose: forward
    # mode sees the identity, reverse mode transposes into the conditional.
    @jax.custom_jvp
    def fence(x):
        return x

    @fence.defjvp
    def fence_jvp(primals, tangents):
        (x,), (tangent,) = primals, tangents
        return x, linear_call(identity, transpose, (), tangent)

    return fence


def _jax(model, inputs, loss_fn, training):
    import jax

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def compute(x, trainable_values):
        outputs, _ = model.stateless_call(trainable_values, non_trainable, x, training=training)
        return loss_fn(outputs)

    loss, (input_grad, grads) = jax.value_and_grad(compute, argnums=(0, 1))(
        jax.numpy.asarray(inputs), trainable
    )
    return loss, input_grad, grads


def _tensorflow(model, inputs, loss_fn, training):
    import tensorflow as tf

    x = tf.convert_to_tensor(inputs)
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = loss_fn(model(x, training=training))
    grads = tape.gradient(loss, [x] + variables)
    return loss, grads[0], grads[1:]


def _torch(model, inputs, loss_fn, training):
    import torch

    parameters = [v.value for v in model.trainable_variables]
    device = parameters[0].device if parameters else None
    x = torch.tensor(np.asarray(inputs), device=device, requires_grad=True)
    loss = loss_fn(model(x, training=training))
    grads = torch.autograd.grad(loss, [x] + parameters, allow_unused=True)
    return loss.detach(), grads[0], grads[1:]


def data_parallel_scope():
    """Returns `(context manager, number of replicas)` for data-parallel training.

    JAX: `keras.distribution.DataParallel` over all local devices (and, when the
    `KERAS_DISTRIBUTION_*` variables describe several processes, over all hosts after
    `keras.distribution.initialize()`). TensorFlow: `tf.distribute.MirroredStrategy`
    over the local GPUs (or the logical CPUs when there is no GPU). PyTorch: not supported, because Keras' `fit`
    has no DistributedDataParallel integration (see docs/training.md).
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import os

        if int(os.environ.get("KERAS_DISTRIBUTION_NUM_PROCESSES", "1")) > 1:
            keras.distribution.initialize()
        devices = keras.distribution.list_devices()
        return keras.distribution.DataParallel(devices=devices).scope(), len(devices)
    if backend == "tensorflow":
        import tensorflow as tf

        # All GPUs, else every logical CPU (one unless the process split the CPU).
        devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
        strategy = tf.distribute.MirroredStrategy(devices=[d.name for d in devices])
        return strategy.scope(), strategy.num_replicas_in_sync
    raise ValueError(
        f"distribute=True is not available on the {backend!r} backend: Keras' model.fit "
        "has no DistributedDataParallel support. Use KERAS_BACKEND=jax "
        "(keras.distribution.DataParallel) or tensorflow (tf.distribute.MirroredStrategy); "
        "docs/training.md explains the options."
    )


def read_torch_tensors(path, safetensors_file=False):
    """`{key: float32 NumPy array}` of a PyTorch checkpoint file, under any Keras backend.

    Used by the checkpoint converters for `.pth`/`.bin` files (`torch.load` with
    `weights_only=True`, so no code from the file runs) and for `.safetensors` files
    in bfloat16, which NumPy cannot hold. A dict that wraps the weights under
    `state_dict`, `model` or `module` is unwrapped.
    """
    try:
        import torch
    except ImportError:
        raise ValueError(
            f"Reading {path!r} needs PyTorch (pip install torch); a float32 .safetensors copy "
            "of the checkpoint loads without it."
        ) from None
    if safetensors_file:
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        for wrapper in ("state_dict", "model", "module"):
            if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
                state = state[wrapper]
    if not isinstance(state, dict):
        raise ValueError(f"{path!r} does not hold a state dict (found {type(state).__name__}).")
    return {k: v.float().numpy() for k, v in state.items() if isinstance(v, torch.Tensor)}
