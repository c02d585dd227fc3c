"""PyTorch forms of `keras_vitnorm.backend`: one `torchrun` process per device, gradients
averaged by one `all_reduce` (why not DDP's wrapper: docs/training.md, "Scaling out")."""

import contextlib
import os

import numpy as np
import torch
import torch.distributed as dist

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
            "ModelParallel); the 'torch' backend trains with distribute='data'.")
    return contextlib.nullcontext(), torch_processes()[1]


def torch_processes():
    """`(rank, world size)` among the `torchrun` processes, the process group initialized."""
    if "WORLD_SIZE" not in os.environ:
        raise ValueError(
            "distribute='data' on the torch backend trains one process per device: start it "
            "with torchrun, e.g. `torchrun --nproc-per-node 8 -m keras_vitnorm train "
            "--distribute ...` (docs/training.md, 'Scaling out').")
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


def count_bins(indices, nbins):
    return torch.bincount(indices, minlength=nbins)


def compiled(function):
    return None  # the input pipeline's plain form: NumPy and a layer call per image


def keeping_variables(model):
    return contextlib.nullcontext()  # Keras' trainer updates the variables in place


def remember_variables(model):
    pass
