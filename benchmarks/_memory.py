"""Peak memory of a benchmark worker: device memory on a GPU, resident host memory on the CPU."""

import resource
import sys

FRAMEWORKS = ("jax", "tensorflow", "torch")


def _proc_status_bytes(field):
    """A memory field of Linux's `/proc/self/status` (`"VmRSS"`, `"VmHWM"`) in bytes, or
    None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # in kB
    except OSError:
        pass
    return None


class WorkerMemory:
    """Peak memory of this process's computation under one framework.

    On a GPU it is what the framework's allocator held at most (PyTorch's
    `max_memory_allocated`, JAX's `peak_bytes_in_use`, TensorFlow's `peak`); on the
    CPU it is the process's peak resident memory (Linux's `VmHWM`; elsewhere
    `ru_maxrss`, which also counts what the parent process held before `exec` on
    Linux, hence not used there). `reset()` starts the peak again for PyTorch and
    TensorFlow on a GPU and on a Linux CPU (from the memory resident then); JAX's
    cannot be reset, so it is the process's peak so far (the workers run inference
    before training, so a training figure is training's own).

    Args:
        framework: str, "jax", "tensorflow" or "torch": the framework that computes.
        device: str, "cpu" or "gpu".
    """

    def __init__(self, framework, device):
        if framework not in FRAMEWORKS:
            raise ValueError(f"framework {framework!r} is not one of {', '.join(FRAMEWORKS)}")
        if device not in ("cpu", "gpu"):
            raise ValueError(f"device {device!r} is not one of cpu, gpu")
        self.framework, self.device = framework, device

    def reset(self):
        """Starts the peak again where it can be (see the class)."""
        if self.device == "cpu":
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # Linux: the peak resident memory becomes the current one
            except OSError:
                pass
            return
        if self.framework == "torch":
            import torch

            torch.cuda.reset_peak_memory_stats()
        elif self.framework == "tensorflow":
            import tensorflow as tf

            tf.config.experimental.reset_memory_stats("GPU:0")

    @property
    def what(self):
        """In words, what `peak` reads."""
        if self.device == "cpu":
            return "host peak RSS"
        return {"torch": "GPU max_memory_allocated (PyTorch)",
                "jax": "GPU peak_bytes_in_use (JAX)",
                "tensorflow": "GPU get_memory_info peak (TensorFlow)"}[self.framework]

    def current(self):
        """The bytes held now, as `peak` counts them: resident host memory (Linux's
        `VmRSS`) on the CPU, the framework allocator's use on a GPU."""
        if self.device == "cpu":
            return _proc_status_bytes("VmRSS") or 0  # elsewhere: the peak since the start
        if self.framework == "torch":
            import torch

            return torch.cuda.memory_allocated()
        if self.framework == "jax":
            import jax

            return jax.local_devices()[0].memory_stats()["bytes_in_use"]
        import tensorflow as tf

        return tf.config.experimental.get_memory_info("GPU:0")["current"]

    def peak(self):
        """The peak in bytes (see the class)."""
        if self.device == "cpu":
            peak = _proc_status_bytes("VmHWM")
            if peak is not None:
                return peak
            # macOS counts ru_maxrss in bytes, the other systems in KiB.
            scale = 1 if sys.platform == "darwin" else 1024
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        if self.framework == "torch":
            import torch

            return torch.cuda.max_memory_allocated()
        if self.framework == "jax":
            import jax

            return jax.local_devices()[0].memory_stats()["peak_bytes_in_use"]
        import tensorflow as tf

        return tf.config.experimental.get_memory_info("GPU:0")["peak"]

    def capacity(self):
        """Bytes this process's computation could hold at most, or None where unknown.

        JAX: its allocator's limit. PyTorch: the GPU's free memory plus what its
        allocator already holds. None on the CPU and for TensorFlow.
        """
        if self.device == "cpu" or self.framework == "tensorflow":
            return None
        if self.framework == "torch":
            import torch

            return torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved()
        import jax

        return jax.local_devices()[0].memory_stats().get("bytes_limit")

    def release(self):
        """Hands PyTorch's cached GPU blocks back, so that workers taking turns on one GPU
        hold only their live tensors while another one runs (JAX keeps its pool)."""
        if self.device == "gpu" and self.framework == "torch":
            import torch

            torch.cuda.empty_cache()


def peak_memory(run, device="cpu", backend=None):
    """`(bytes, what)`: the peak memory that `run()` (build and train a model) adds to what
    the process holds, as `WorkerMemory` reads it on `device` under `backend` (default: the
    running Keras backend's), and in words what was measured. JAX's peak cannot be reset:
    call this in a fresh process that has allocated little else."""
    if backend is None:
        import keras

        backend = keras.backend.backend()
    memory = WorkerMemory(backend, device)
    memory.reset()
    before = memory.current()
    run()
    return memory.peak() - before, memory.what
