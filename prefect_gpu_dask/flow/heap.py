"""Handing the flow process's freed heap back to the operating system after a flow run.

A flow run's Dask client and the Prefect objects around it end in reference cycles,
which only Python's full collections free, every hundred or so flow runs in a process
that runs them one after another (``serve``, a long-lived worker process, a soak).
glibc keeps what such a collection frees, so the process's RSS climbs while what it
holds stays level (``benchmarks/fleet_soak.py`` reports both). ``malloc_trim(0)``
gives the free pages back, as Dask's docs advise for workers; it runs in a thread of
its own, off the flow run's end, one at a time. Nothing to do where the C library is
not glibc.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

_trimming = threading.Lock()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc
        return None


def release_freed_heap() -> bool:
    """Give freed heap pages back now, after any release under way; False where the C
    library has no ``malloc_trim``."""
    trim = _malloc_trim()
    if trim is None:
        return False
    with _trimming:
        trim(0)
    return True


def release_freed_heap_soon() -> bool:
    """Start giving freed heap pages back, unless a release is under way or the C
    library has no ``malloc_trim``. Returns whether one started."""
    trim = _malloc_trim()
    if trim is None or not _trimming.acquire(blocking=False):
        return False

    def release() -> None:
        try:
            trim(0)  # ctypes lets go of the GIL for the call
        except OSError:  # never worth more than a debug line
            logger.debug("malloc_trim failed", exc_info=True)
        finally:
            _trimming.release()

    try:
        threading.Thread(target=release, name="prefect-gpu-dask-heap-release", daemon=True).start()
    except RuntimeError:  # the interpreter is shutting down
        _trimming.release()
        return False
    return True
