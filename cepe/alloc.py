"""The memory allocator behind a CPU run (``scripts/fast_alloc.sh`` preloads jemalloc, told to keep the
memory it frees): which one serves this process, and returning jemalloc's kept pages to the kernel.

jemalloc that keeps every freed page reuses a step's tensors without page faults, but over many steps of
different shapes its kept pages grow without bound (a chain stage reached 24 GiB and was killed). Training
therefore purges them once per optimizer step (:func:`purge`): the micro-batches of a step reuse each
other's memory, and the footprint stays that of one step.
"""

from __future__ import annotations

import ctypes
import functools

_ALL_ARENAS = 4096  # MALLCTL_ARENAS_ALL


@functools.lru_cache(maxsize=1)
def _mallctl():
    """jemalloc's ``mallctl`` where it serves this process (preloaded), else None."""
    try:
        f = ctypes.CDLL(None).mallctl
    except (AttributeError, OSError, TypeError):  # TypeError: no CDLL(None) (Windows)
        return None
    f.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    f.restype = ctypes.c_int
    return f


def jemalloc_active() -> bool:
    """Whether jemalloc serves this process's allocations."""
    return _mallctl() is not None


def purge() -> bool:
    """Return the pages jemalloc keeps for reuse (all arenas) to the kernel; False where jemalloc does not
    serve this process or the call failed. Values and tensors are unaffected."""
    f = _mallctl()
    if f is None:
        return False
    return f(f"arena.{_ALL_ARENAS}.purge".encode(), None, None, None, 0) == 0
