"""GPU Dask as a first-class Prefect 3 task runner."""

from prefect_gpu_dask.arrays import array_module, gpu_available
from prefect_gpu_dask.collections import compute_on_gpus
from prefect_gpu_dask.guard import GPUMemoryGuard
from prefect_gpu_dask.policy import GuardSettings
from prefect_gpu_dask.probe import MemoryProbe, MemorySample, NvmlProbe
from prefect_gpu_dask.routing import TagRouter, parse_gpu_tag
from prefect_gpu_dask.runner import GPUDaskTaskRunner, MissingResourceError

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
