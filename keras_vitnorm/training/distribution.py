"""Training on several devices: the distribution scope of each backend and layout.

- `"data"`: data-parallel. JAX: `keras.distribution.DataParallel` over all devices;
  TensorFlow: `tf.distribute.MirroredStrategy` over the local GPUs (or the logical
  CPUs when there is no GPU).
- `"fsdp"` (JAX): fully sharded data parallel. One device mesh axis, `"batch"`,
  carries both the batch and the weights: every kernel of the encoder blocks (and
  the head) is split along its first dimension over the devices, as is its AdamW
  state, and XLA gathers a kernel where a step needs it whole. Built with
  `keras.distribution.ModelParallel` and the `FSDP_LAYOUT` layout map. A device then
  holds 1/n of those weights and their optimizer state (the measured memory per
  device is in docs/training.md).

With `KERAS_DISTRIBUTION_NUM_PROCESSES` > 1 (several hosts, or several processes on
one), JAX's data-parallel layout spans every process's devices after
`keras.distribution.initialize()`, and Keras feeds each process its share of every
batch.

PyTorch (`"data"`): one process per device, started by `torchrun`, each training on
its share of every global batch; each step's gradients are averaged over the
processes (`average_gradients`) before the optimizer applies them, which is the
update DistributedDataParallel computes. DDP's own wrapper is not used because
Keras' `fit` calls the model itself, so DDP's reducer, which starts from the
wrapper's forward pass, would never run; the average is one `all_reduce` of all
gradients, after the backward pass instead of overlapped with it.

With several processes (either backend) the first one writes the run's files; the
others train and read nothing but what it sends them (`from_first_process`,
`share_variables`).
"""

import os

import keras

from keras_vitnorm.choices import DISTRIBUTIONS
from keras_vitnorm.validation import check_choice

#: Variable path pattern -> sharded axes, for `"fsdp"`. The kernels' first dimension is
#: the width or the MLP size, which the device counts in use divide. The stem, the
#: position embedding, the norms and the biases stay replicated (well under 2% of a
#: ViT-B's parameters).
FSDP_LAYOUT = {
    r"block_\d+/attention/(qkv|out)/kernel": ("batch", None),
    r"block_\d+/mlp/(fc1|fc2)/kernel": ("batch", None),
    r"head/kernel": ("batch", None),
}


def distribution_scope(kind="data"):
    """Returns `(context manager, number of data-parallel replicas)` for `kind`.

    Args:
        kind: `"data"` or `"fsdp"` (JAX only).
    """
    check_choice("distribute", kind, DISTRIBUTIONS)
    backend = keras.backend.backend()
    if backend == "jax":
        processes = int(os.environ.get("KERAS_DISTRIBUTION_NUM_PROCESSES", "1"))
        if processes > 1:
            if kind == "fsdp":
                raise ValueError(
                    "distribute='fsdp' shards the weights over the devices of one process; "
                    f"with KERAS_DISTRIBUTION_NUM_PROCESSES={processes} use distribute='data' "
                    "(each process would hold only part of the weights it saves)."
                )
            keras.distribution.initialize()
        devices = keras.distribution.list_devices()
        if kind == "data":
            return keras.distribution.DataParallel(devices=devices).scope(), len(devices)
        mesh = keras.distribution.DeviceMesh((len(devices),), ["batch"], devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        for pattern, axes in FSDP_LAYOUT.items():
            layout_map[pattern] = axes
        fsdp = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
        return fsdp.scope(), len(devices)
    if kind == "fsdp":
        raise ValueError(
            f"distribute='fsdp' is available on the JAX backend only (keras.distribution."
            f"ModelParallel); the {backend!r} backend trains with distribute='data'."
        )
    if backend == "tensorflow":
        import tensorflow as tf

        # All GPUs, else every logical CPU (one unless the process split the CPU).
        devices = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
        strategy = tf.distribute.MirroredStrategy(devices=[d.name for d in devices])
        return strategy.scope(), strategy.num_replicas_in_sync
    import contextlib

    return contextlib.nullcontext(), torch_processes()[1]


def torch_processes():
    """`(rank, world size)` of this process among those `torchrun` started, with the
    process group initialized (gloo on CPUs, NCCL on GPUs, one GPU per process)."""
    import torch
    import torch.distributed as dist

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
    """`(index, count)` of this process among the training processes: torchrun's
    rank and world size, or JAX's process index and count; `(0, 1)` for one process."""
    backend = keras.backend.backend()
    if backend == "torch":
        return process_share()
    if backend == "jax":
        import jax

        return jax.process_index(), jax.process_count()
    return 0, 1


def process_share():
    """`(index, count)`: which share of each global batch this process trains on.

    `(rank, world size)` under torchrun with its process group running; else `(0, 1)`
    (JAX and TensorFlow split the global batch over their devices themselves).
    """
    if keras.backend.backend() == "torch":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    return 0, 1


def average_gradients(optimizer):
    """Makes `optimizer.apply` average each step's gradients over the torch processes
    first (one `all_reduce` of all of them), so every process applies the same update."""
    import torch
    import torch.distributed as dist

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


def share_variables(variables, values=None):
    """Gives every training process the first process's `values` of `variables` (its
    current ones where `values` is None). Every process calls this, with its own
    variables in the same order; every process assigns (on JAX an assignment is a
    step of all processes)."""
    lead = process_index_and_count()[0] == 0
    if keras.backend.backend() == "torch":
        import torch.distributed as dist

        for index, variable in enumerate(variables):
            if lead and values is not None:
                variable.assign(values[index])
            dist.broadcast(variable.value.data, src=0)
        return
    from jax.experimental import multihost_utils

    # One variable at a time: every process offers an array of the variable's shape
    # (its own value), and the first process's is the one that arrives.
    for index, variable in enumerate(variables):
        value = values[index] if lead and values is not None else variable
        variable.assign(multihost_utils.broadcast_one_to_all(keras.ops.convert_to_numpy(value)))


def from_first_process(value):
    """The first training process's `value` (a small picklable object: a step, a
    message; arrays go through `share_variables`), on every process."""
    if keras.backend.backend() == "torch":
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    import pickle

    import numpy as np
    from jax.experimental import multihost_utils

    data = np.frombuffer(pickle.dumps(value), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int64(data.size)))
    buffer = np.zeros(size, np.uint8)
    buffer[: min(size, data.size)] = data[:size]
    return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes())


def any_process(flag):
    """Whether `flag` holds on any training process (every process must call this)."""
    if keras.backend.backend() == "torch":
        import torch
        import torch.distributed as dist

        device = "cuda" if torch.cuda.is_available() else "cpu"  # NCCL reduces GPU tensors only
        value = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array([flag]))))
