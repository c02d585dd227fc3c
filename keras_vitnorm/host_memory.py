"""A process setting for CPU training and benchmarks: keep freed host memory for reuse."""

import ctypes
import platform

#: `(name, mallopt(3) parameter number from glibc's <malloc.h>, value)` of each setting.
_SETTINGS = (("M_MMAP_MAX", -4, 0), ("M_TRIM_THRESHOLD", -1, -1), ("M_ARENA_MAX", -8, 1))


def retain_freed_memory():
    """Makes glibc keep freed memory for reuse, holding the peak until exit (docs/training.md);
    call it before the first computation. Returns `False`, changing nothing, where the C
    library is not glibc; raises `OSError` where glibc refuses a setting."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    for name, parameter, value in _SETTINGS:
        if mallopt(parameter, value) != 1:
            raise OSError(f"glibc's mallopt refused {name}={value}")
    return True
