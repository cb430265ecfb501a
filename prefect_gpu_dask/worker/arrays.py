"""One function for GPU and CPU: ``xp = array_module()`` is CuPy on a GPU, NumPy elsewhere."""

from __future__ import annotations

import functools
from types import ModuleType


@functools.cache
def gpu_available() -> bool:
    """This process can run CuPy on a GPU (checked once per process, no CUDA context)."""
    from prefect_gpu_dask.nvml import visible_gpu_count

    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return visible_gpu_count() > 0


def array_module() -> ModuleType:
    """``cupy`` where this worker has a GPU and CuPy, else ``numpy``: the CPU fallback."""
    if gpu_available():
        import cupy

        return cupy
    import numpy

    return numpy
