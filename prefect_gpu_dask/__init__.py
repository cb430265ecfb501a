"""GPU Dask as a first-class Prefect 3 task runner.

Names are imported on first use: a Dask worker that unpickles the guard plugin
imports ``prefect_gpu_dask.guard`` alone, not Prefect (2.7 s of cluster start on the
GPU machine). Prefect's engine loads with a worker's first task run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefect_gpu_dask.arrays import array_module, gpu_available
    from prefect_gpu_dask.collections import compute_on_gpus
    from prefect_gpu_dask.guard import GPUMemoryGuard
    from prefect_gpu_dask.policy import GuardSettings
    from prefect_gpu_dask.probe import MemoryProbe, MemorySample, NvmlProbe
    from prefect_gpu_dask.routing import TagRouter, parse_gpu_tag
    from prefect_gpu_dask.runner import GPUDaskTaskRunner, MissingResourceError

_HOMES = {
    "GPUDaskTaskRunner": "runner",
    "MissingResourceError": "runner",
    "GPUMemoryGuard": "guard",
    "GuardSettings": "policy",
    "MemoryProbe": "probe",
    "MemorySample": "probe",
    "NvmlProbe": "probe",
    "TagRouter": "routing",
    "parse_gpu_tag": "routing",
    "array_module": "arrays",
    "gpu_available": "arrays",
    "compute_on_gpus": "collections",
}
__all__ = [
    "GPUDaskTaskRunner",
    "GPUMemoryGuard",
    "GuardSettings",
    "MemoryProbe",
    "MemorySample",
    "MissingResourceError",
    "NvmlProbe",
    "TagRouter",
    "array_module",
    "compute_on_gpus",
    "gpu_available",
    "parse_gpu_tag",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
