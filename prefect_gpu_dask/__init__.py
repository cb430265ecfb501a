"""GPU Dask as a first-class Prefect 3 task runner.

Names are imported on first use: a Dask worker that unpickles the guard plugin
imports ``prefect_gpu_dask.worker.guard`` alone, not Prefect, so the cluster starts sooner.
Prefect's engine loads with a worker's first task run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefect_gpu_dask.errors import MissingResourceError, UnhealthyGPUError
    from prefect_gpu_dask.flow.flow_run_report import (
        FlowRunGPUReport,
        aread_flow_run_gpu_report,
        read_flow_run_gpu_report,
    )
    from prefect_gpu_dask.flow.routing import Route, TagRouter, parse_gpu_tag
    from prefect_gpu_dask.flow.runner import GPUDaskTaskRunner
    from prefect_gpu_dask.flow.sizing import SizingHint
    from prefect_gpu_dask.records import GPUQuarantine, RestartRecord, TaskRecord
    from prefect_gpu_dask.settings import RunnerSettings
    from prefect_gpu_dask.worker.arrays import array_module, gpu_available
    from prefect_gpu_dask.worker.compute import compute_on_gpus
    from prefect_gpu_dask.worker.guard import GPUMemoryGuard
    from prefect_gpu_dask.worker.probe import MemoryProbe, MemorySample, NvmlProbe

_HOMES = {
    "GPUDaskTaskRunner": "flow.runner",
    "MissingResourceError": "errors",
    "GPUMemoryGuard": "worker.guard",
    "RunnerSettings": "settings",
    "TaskRecord": "records",
    "RestartRecord": "records",
    "GPUQuarantine": "records",
    "UnhealthyGPUError": "errors",
    "Route": "flow.routing",
    "MemoryProbe": "worker.probe",
    "MemorySample": "worker.probe",
    "NvmlProbe": "worker.probe",
    "TagRouter": "flow.routing",
    "parse_gpu_tag": "flow.routing",
    "array_module": "worker.arrays",
    "gpu_available": "worker.arrays",
    "compute_on_gpus": "worker.compute",
    "FlowRunGPUReport": "flow.flow_run_report",
    "read_flow_run_gpu_report": "flow.flow_run_report",
    "aread_flow_run_gpu_report": "flow.flow_run_report",
    "SizingHint": "flow.sizing",
}
__all__ = [
    "FlowRunGPUReport",
    "GPUDaskTaskRunner",
    "GPUMemoryGuard",
    "GPUQuarantine",
    "MemoryProbe",
    "MemorySample",
    "MissingResourceError",
    "NvmlProbe",
    "RestartRecord",
    "Route",
    "RunnerSettings",
    "SizingHint",
    "TagRouter",
    "TaskRecord",
    "UnhealthyGPUError",
    "aread_flow_run_gpu_report",
    "array_module",
    "compute_on_gpus",
    "gpu_available",
    "parse_gpu_tag",
    "read_flow_run_gpu_report",
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
