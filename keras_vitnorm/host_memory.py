"""Keeping freed host memory in the process, for CPU training and benchmarks."""

import ctypes
import platform

# mallopt(3) parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def retain_freed_memory():
    """Makes glibc's allocator keep freed memory for reuse instead of returning it to the kernel.

    Why it exists: XLA on CPU allocates each step's temporary buffer afresh, one
    block of gigabytes for a ViT training step, from a worker thread's malloc
    arena. glibc serves blocks that large with `mmap` and unmaps them on free,
    so every step the kernel maps and zeroes the whole block again: on S/16 at
    batch 16 (JAX, 2-core CPU) that was about 570,000 page faults and 1.1 to 1.5 s
    of kernel time per 3.9 to 4.4 s step. Keras and JAX expose no allocator
    setting for this. With the three settings below the step faulted no page
    after warm-up and took 3.27 s against 3.93 s (docs/performance.md). The
    PyTorch and TensorFlow backends, and the PyTorch reference, page-fault far
    less; their training steps changed within this host's noise.

    The settings (mallopt(3)), process-wide:
    - `M_MMAP_MAX = 0`: large blocks come from the heap, not from `mmap`;
    - `M_TRIM_THRESHOLD = -1`: freed heap memory is kept, not trimmed;
    - `M_ARENA_MAX = 1`: every thread allocates from the main heap, the one
      place a block larger than 64 MiB can be reused from.

    The cost: the process keeps its peak memory until it exits, and threads
    share one allocator lock. Call it once, at the start of a process that
    trains or benchmarks on the CPU, before the first computation: a thread
    that has already allocated keeps its own arena. The `keras-vitnorm` command
    calls it; in your own script, call it before building the model.

    Returns:
        `True` when applied; `False`, changing nothing, where the C library is
        not glibc (macOS, Windows, musl).

    Raises:
        OSError: glibc refused a setting.

    Example:
    >>> import keras_vitnorm
    >>> keras_vitnorm.retain_freed_memory()
    True
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    for name, parameter, value in (("M_MMAP_MAX", _M_MMAP_MAX, 0),
                                   ("M_TRIM_THRESHOLD", _M_TRIM_THRESHOLD, -1),
                                   ("M_ARENA_MAX", _M_ARENA_MAX, 1)):
        if mallopt(parameter, value) != 1:
            raise OSError(f"glibc's mallopt refused {name}={value}")
    return True
