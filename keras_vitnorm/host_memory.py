"""A process setting for CPU training and benchmarks: keep freed host memory for reuse.

Not part of the library's API on import: the training commands and the benchmark
scripts apply it at their start.
"""

import ctypes
import platform

# mallopt(3) parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def retain_freed_memory():
    """Makes glibc's allocator keep freed memory for reuse instead of returning it to the kernel.

    XLA on CPU allocates each training step's temporary buffer afresh, one block of
    gigabytes for a ViT step, from a worker thread's malloc arena. glibc serves
    blocks that large with `mmap` and unmaps them on free, so the kernel maps and
    zeroes the whole block again every step; Keras and JAX expose no allocator
    setting for this. With the settings below the step faults no page after
    warm-up; the measured effect per backend is in docs/performance.md.

    The settings (mallopt(3)), process-wide:
    - `M_MMAP_MAX = 0`: large blocks come from the heap, not from `mmap`;
    - `M_TRIM_THRESHOLD = -1`: freed heap memory is kept, not trimmed;
    - `M_ARENA_MAX = 1`: every thread allocates from the main heap, the one
      place a block larger than 64 MiB can be reused from.

    The cost: the process keeps its peak memory until it exits, and threads share
    one allocator lock. That is why only the commands that train (`keras-vitnorm
    train`, `ablate` and its worker processes, `segment`, `vtab`, `lit`) and the
    throughput benchmarks apply it, not the library on import. It takes effect for
    threads that have not allocated yet, so it belongs at the start of a process,
    before the first computation.

    Returns:
        `True` when applied; `False`, changing nothing, where the C library is
        not glibc (macOS, Windows, musl).

    Raises:
        OSError: glibc refused a setting.

    Example:
    >>> from keras_vitnorm.host_memory import retain_freed_memory
    >>> retain_freed_memory()
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
