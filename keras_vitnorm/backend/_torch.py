"""PyTorch forms of `keras_vitnorm.backend` (imported only under the PyTorch backend).

Data-parallel training runs one process per device, started by `torchrun`, each on
its share of every global batch; each step's gradients are averaged over the processes
(`average_gradients`) before the optimizer applies them, which is the update
DistributedDataParallel computes. DDP's own wrapper is not used because Keras' `fit`
calls the model itself, so DDP's reducer, which starts from the wrapper's forward
pass, would never run; the average is one `all_reduce` of all gradients, after the
backward pass instead of overlapped with it.
"""

import contextlib
import os
import warnings

import keras
import numpy as np
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

#: Every process initializes its own variables from its own generator.
PROCESSES_START_EQUAL = False
#: Keras' dropout draws from PyTorch's global generator.
HAS_GLOBAL_RANDOM_STATE = True


def value_and_gradients(model, inputs, loss_fn, training):
    parameters = [v.value for v in model.trainable_variables]
    device = parameters[0].device if parameters else None
    x = torch.tensor(np.asarray(inputs), device=device, requires_grad=True)
    loss = loss_fn(model(x, training=training))
    grads = torch.autograd.grad(loss, [x] + parameters, allow_unused=True)
    return loss.detach(), grads[0], grads[1:]


def gradients_function(model, loss_fn, training):
    return lambda inputs: value_and_gradients(model, inputs, loss_fn, training)


def distribution_scope(kind, sharded_layout):
    if kind == "fsdp":
        raise ValueError(
            "distribute='fsdp' is available on the JAX backend only (keras.distribution."
            "ModelParallel); the 'torch' backend trains with distribute='data'."
        )
    return contextlib.nullcontext(), torch_processes()[1]


def torch_processes():
    """`(rank, world size)` of this process among those `torchrun` started, with the
    process group initialized (gloo on CPUs, NCCL on GPUs, one GPU per process)."""
    if "WORLD_SIZE" not in os.environ:
        raise ValueError(
            "distribute='data' on the torch backend trains one process per device: start it "
            "with torchrun, e.g. `torchrun --nproc-per-node 8 -m keras_vitnorm train "
            "--distribute ...` (docs/training.md, 'Scaling out')."
        )
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def process_index_and_count():
    return process_share()


def process_share():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def average_gradients(optimizer):
    apply, world = optimizer.apply, dist.get_world_size()

    def apply_averaged(grads, trainable_variables=None):
        # A variable without a gradient (None) joins as zeros and stays None for Keras.
        # (Keras' torch trainer passes the variables with their gradients.)
        present = [g is not None for g in grads]
        dense = [g if g is not None else torch.zeros_like(v.value)
                 for g, v in zip(grads, trainable_variables)]
        flat = torch.cat([g.reshape(-1) for g in dense])
        dist.all_reduce(flat)
        flat /= world
        parts = torch.split(flat, [g.numel() for g in dense])
        grads = [part.view_as(g) if kept else None for part, g, kept in zip(parts, dense, present)]
        return apply(grads, trainable_variables)

    optimizer.apply = apply_averaged


def share_variables(variables, values, lead):
    for index, variable in enumerate(variables):
        if lead and values is not None:
            variable.assign(values[index])
        dist.broadcast(variable.value.data, src=0)


def from_first_process(value):
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_process(flag):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # NCCL reduces GPU tensors only
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def global_random_state():
    return torch.get_rng_state().numpy()


def set_global_random_state(state):
    torch.set_rng_state(torch.from_numpy(np.array(state, dtype="uint8")))


#: What `train_step` and `test_step` need of Keras' trainer (private attributes of
#: `keras.Model` under PyTorch); where one is missing, the step is Keras' own.
STEP_PARTS = ("_call_has_training_arg", "_compute_loss", "_loss_tracker")


def train_step(model, keras_step, data):
    """Keras' PyTorch training step, its Python numbers made on the device once.

    The same step as Keras' (`keras_step`): forward pass, loss, loss tracker, loss
    scaling, backward pass, optimizer update, metrics, in that order; but the loss,
    the loss tracker, the optimizer update and the metrics run in
    `device_constants`, so that the numbers Keras turns into tensors there (the
    batch size, the loss's divisor, AdamW's betas and weight decay, the iteration
    counter's increment) are copies, on the device, of tensors made once, and the
    host never waits for the GPU to take them. The forward and backward passes run
    outside it, at full dispatch speed (they make no such tensors). Where Keras'
    trainer lacks a part in `STEP_PARTS`, and under `torch.compile` (which keeps such
    numbers in the compiled graph), the step is `keras_step(data)`.
    """
    if torch.compiler.is_compiling() or not _has_step_parts(model):
        return keras_step(data)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
    model.zero_grad()
    with device_constants():
        loss = _track_loss(model, x, y, y_pred, sample_weight, training=True)
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
    variables = model.trainable_weights  # a fresh list; Keras walks every layer for it
    if variables:
        loss.backward()
        with torch.no_grad(), device_constants():
            model.optimizer.apply([v.value.grad for v in variables], variables)
    else:
        warnings.warn("The model does not have any trainable weights.", stacklevel=2)
    with device_constants():
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def test_step(model, keras_step, data):
    """Keras' PyTorch evaluation step, its Python numbers made on the device once.

    Keras' step (`keras_step`): forward pass, loss, loss tracker, metrics; the last
    three in `device_constants`, as in `train_step`.
    """
    if torch.compiler.is_compiling() or not _has_step_parts(model):
        return keras_step(data)
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    y_pred = model(x, training=False) if model._call_has_training_arg else model(x)
    with device_constants():
        _track_loss(model, x, y, y_pred, sample_weight, training=False)
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _has_step_parts(model):
    return all(hasattr(model, name) for name in STEP_PARTS) and model._loss_tracker is not None


def _track_loss(model, x, y, y_pred, sample_weight, training):
    """The loss, as Keras' steps compute it and add it to the loss tracker."""
    loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                               training=training)
    batch_size = next(i for i in keras.tree.flatten(x) if i is not None).shape[0]
    model._loss_tracker.update_state(loss, sample_weight=batch_size)
    return loss


#: Functions that make a tensor from host data, whose Python numbers `device_constants` serves.
_FROM_HOST_DATA = (torch.as_tensor, torch.tensor, torch.asarray)
#: The most tensors `device_constants` keeps (a step makes about ten); beyond, it makes each anew.
CONSTANTS_LIMIT = 256
_constants = {}


@contextlib.contextmanager
def device_constants():
    """Within it, a tensor made from Python numbers is a copy, on the device, of one made once.

    Keras' PyTorch code turns Python numbers into tensors with
    `torch.as_tensor(value, dtype=..., device=...)`; on a GPU each is a copy from host
    memory, for which the host first waits until the GPU has run everything queued
    before it. Here, such a call with a `bool`, `int` or `float`, or a short list or
    tuple of them, returns a clone of a tensor made by the same call the first time
    (kept by value, dtype and device, `CONSTANTS_LIMIT` of them at most): the same
    tensor, made by a copy on the device that the host does not wait for, and a
    clone, so that no caller can change another's. Other calls run as they are. Under
    `torch.compile` the context does nothing (the compiler keeps constants in the
    compiled graph).
    """
    if torch.compiler.is_compiling():
        yield
        return
    with _DeviceConstants():
        yield


class _DeviceConstants(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FROM_HOST_DATA and len(args) == 1 and kwargs.keys() <= {"dtype", "device"}:
            value = _number_key(args[0])
            if value is not None:
                device = kwargs.get("device")
                device = torch.get_default_device() if device is None else torch.device(device)
                key = (func, value, kwargs.get("dtype"), device)
                tensor = _constants.get(key)
                if tensor is None:
                    tensor = func(*args, **kwargs)
                    if len(_constants) >= CONSTANTS_LIMIT:
                        return tensor
                    _constants[key] = tensor
                return tensor.clone()
        return func(*args, **kwargs)


def _number_key(data):
    """A key that tells `data` (a Python number, or a list or tuple of at most 8) from every
    other such value, types and float bits included; `None` for anything else."""
    if type(data) in (bool, int):
        return type(data), data
    if type(data) is float:
        return float, data.hex()
    if isinstance(data, (list, tuple)) and len(data) <= 8:
        keys = tuple(_number_key(item) for item in data)
        if all(key is not None and key[0] in (bool, int, float) for key in keys):
            return tuple, keys
    return None


def count_bins(indices, nbins):
    return torch.bincount(indices, minlength=nbins)


def compiled(function):
    return None  # the input pipeline's plain form: NumPy and a layer call per image


def map_examples(function, *batches, chunk=None):
    raise ValueError("map_examples runs inside a program of `compiled`, which PyTorch "
                     "does not make.")


def keeping_variables(model):
    return contextlib.nullcontext()  # Keras' trainer updates the variables in place


def remember_variables(model):
    pass
