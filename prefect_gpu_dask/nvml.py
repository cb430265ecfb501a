"""Tiny NVML helpers around one lazy, per-process ``nvmlInit``.

Nothing here creates a CUDA context: NVML talks to the driver, not the runtime, so
counting GPUs on the flow host never grabs device memory.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from distributed.diagnostics import nvml as _dask_nvml

from prefect_gpu_dask import _compat


class DeviceMemory(NamedTuple):
    used: int
    total: int


def is_available() -> bool:
    """True when NVML loaded and the driver answered."""
    _dask_nvml.init_once()
    return _dask_nvml.is_initialized()


def visible_gpu_count() -> int:
    """GPUs this process may use: NVML's count, narrowed by ``CUDA_VISIBLE_DEVICES``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [entry for entry in visible.split(",") if entry.strip()]
        return len(entries) if entries and entries[0].strip() != "-1" and is_available() else 0
    return _dask_nvml.device_get_count()


def worker_device_handle() -> Any:
    """NVML handle of this process's GPU: the first ``CUDA_VISIBLE_DEVICES`` entry.

    Entries may be indices or ``GPU-``/``MIG-`` UUIDs; distributed resolves both.
    """
    return _compat.nvml_worker_handle()


def device_uuid(handle: Any) -> str:
    import pynvml

    uuid = pynvml.nvmlDeviceGetUUID(handle)
    return uuid.decode() if isinstance(uuid, bytes) else uuid


def device_name(handle: Any) -> str:
    import pynvml

    name = pynvml.nvmlDeviceGetName(handle)
    return name.decode() if isinstance(name, bytes) else name


def device_index(handle: Any) -> int:
    import pynvml

    return int(pynvml.nvmlDeviceGetIndex(handle))


def device_memory(handle: Any) -> DeviceMemory:
    import pynvml

    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return DeviceMemory(used=int(info.used), total=int(info.total))


def process_memory(handle: Any, pid: int) -> int:
    """Bytes the process ``pid`` holds on the device (0 when it has no context there).

    Returns -1 where the driver cannot attribute memory per process (some MIG and
    vGPU setups); callers then judge by device-wide memory.
    """
    import pynvml

    for proc in _compute_processes(handle):
        if proc.pid == pid:
            used = proc.usedGpuMemory
            unknown = used is None or used == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
            return -1 if unknown else int(used)
    return 0


def process_pids(handle: Any) -> list[int]:
    return [proc.pid for proc in _compute_processes(handle)]


_buffers = threading.local()
PROCESS_SLOTS = 32


def _compute_processes(handle: Any) -> Sequence[Any]:
    """NVML's compute-process list in one driver call, into a per-thread buffer.

    pynvml's ``nvmlDeviceGetComputeRunningProcesses`` asks the driver for the count,
    then fills a fresh array and turns every entry into a Python object. This is the
    same driver function, called once.
    """
    import pynvml

    raw = _compat.nvml_compute_processes_raw()
    if raw is None:  # older driver or pynvml
        return pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    function, entry, check = raw
    buffer = getattr(_buffers, "buffer", None)
    while True:
        if buffer is None:
            buffer = _buffers.buffer = (entry * PROCESS_SLOTS)()
        count = ctypes.c_uint(len(buffer))
        status = function(handle, ctypes.byref(count), buffer)
        if status != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
            break
        buffer = _buffers.buffer = (entry * (2 * count.value + 5))()  # room for newcomers
    check(status)
    return buffer[: count.value]
