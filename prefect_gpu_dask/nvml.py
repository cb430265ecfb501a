"""Small NVML readers around one lazy, per-process ``nvmlInit``.

Each reader returns None where the GPU, its driver or the bindings do not support the
reading (NVML's ``NOT_SUPPORTED`` or ``FUNCTION_NOT_FOUND``), as distributed's own
readers do, and raises ``pynvml.NVMLError`` for any other failure: what such a failure
means is the caller's to say (the health checks report it, a task's activity goes
without the reading). Nothing here creates a CUDA context: NVML talks to the driver,
not the runtime, so counting GPUs on the flow host never grabs device memory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import pynvml
from distributed.diagnostics import nvml as _dask_nvml

from prefect_gpu_dask import _compat

# What a failed GPU reading raises: NVML's error, or the OS's (a device or /proc file,
# a driver gone). A ``memory_probe`` and its readers raise these too; anything else is a
# bug and propagates.
READ_ERRORS: tuple[type[Exception], ...] = (pynvml.NVMLError, OSError)


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


def visible_handles() -> list[Any]:
    """NVML handles of the GPUs this process may use, in ``CUDA_VISIBLE_DEVICES`` order
    (indices or ``GPU-``/``MIG-`` UUIDs), else all of them."""
    import pynvml

    if not is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    handles = []
    for entry in (e.strip() for e in visible.split(",") if e.strip()):
        if entry == "-1":
            break
        if entry.isdigit():
            handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(entry)))
        else:
            handles.append(pynvml.nvmlDeviceGetHandleByUUID(entry))
    return handles


def driver_versions() -> tuple[str | None, int | None]:
    """The driver's version and the CUDA version it supports (e.g. 13000 for 13.0)."""
    import pynvml

    driver = _text(pynvml.nvmlSystemGetDriverVersion())
    get_cuda = (
        getattr(pynvml, "nvmlSystemGetCudaDriverVersion_v2", None) or pynvml.nvmlSystemGetCudaDriverVersion
    )
    return driver, int(get_cuda())


def mig_enabled(handle: Any) -> bool | None:
    modes = _read("nvmlDeviceGetMigMode", handle)
    return None if modes is None else bool(modes[0])


def _read(query: str, handle: Any, *args: Any) -> Any:
    """``pynvml.<query>(handle, *args)``, or None where it is not supported."""
    import pynvml

    function = getattr(pynvml, query, None)
    if function is None:  # bindings older than the query
        return None
    try:
        return function(handle, *args)
    except pynvml.NVMLError as error:
        if error.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
            return None
        raise


def _text(value: str | bytes | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


# -- identity and memory -------------------------------------------------------------


def device_uuid(handle: Any) -> str | None:
    return _text(_read("nvmlDeviceGetUUID", handle))


def device_name(handle: Any) -> str | None:
    return _text(_read("nvmlDeviceGetName", handle))


def device_index(handle: Any) -> int | None:
    index = _read("nvmlDeviceGetIndex", handle)
    return None if index is None else int(index)


def device_memory(handle: Any) -> DeviceMemory | None:
    """The device's memory in use and in all."""
    info = _read("nvmlDeviceGetMemoryInfo", handle)
    return None if info is None else DeviceMemory(used=int(info.used), total=int(info.total))


def process_memory(handle: Any, pid: int) -> int:
    """Bytes the process ``pid`` holds on the device (0 when it has no context there).

    Returns -1 where the driver cannot attribute memory per process (some MIG and
    vGPU setups); callers then judge by device-wide memory.
    """
    return process_memory_and_others(handle, pid)[0]


def process_memory_and_others(handle: Any, pid: int) -> tuple[int, int]:
    """``process_memory``, and how many other processes have a context on the device,
    from one reading of the process list."""
    import pynvml

    memory, others = 0, 0
    for proc in _compute_processes(handle):
        if proc.pid != pid:
            others += 1
            continue
        used = proc.usedGpuMemory
        unknown = used is None or used == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
        memory = -1 if unknown else int(used)
    return memory, others


def process_pids(handle: Any) -> list[int]:
    return [proc.pid for proc in _compute_processes(handle)]


def process_memories(handle: Any) -> dict[int, int]:
    """Bytes each process with a context on the device holds there (-1: not attributed)."""
    import pynvml

    unknown = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
    return {
        int(proc.pid): -1 if proc.usedGpuMemory in (None, unknown) else int(proc.usedGpuMemory)
        for proc in _compute_processes(handle)
    }


def _compute_processes(handle: Any) -> Sequence[Any]:
    """NVML's list of the processes with a compute context on the device."""
    import pynvml

    return pynvml.nvmlDeviceGetComputeRunningProcesses(handle)


# -- activity: power, temperature, clocks, utilisation, energy ------------------------


def power_mw(handle: Any) -> int | None:
    return _read("nvmlDeviceGetPowerUsage", handle)


def temperature_c(handle: Any) -> int | None:
    import pynvml

    return _read("nvmlDeviceGetTemperature", handle, pynvml.NVML_TEMPERATURE_GPU)


def clock_event_reasons(handle: Any) -> int | None:
    """Why the GPU's clocks are held down now (a bitmask), through the older "throttle
    reasons" name where the driver lacks the new one."""
    reasons = _read("nvmlDeviceGetCurrentClocksEventReasons", handle)
    return reasons if reasons is not None else _read("nvmlDeviceGetCurrentClocksThrottleReasons", handle)


def hardware_slowdown_mask() -> int:
    """The bits of ``clock_event_reasons`` that are the GPU's own slowdown signals."""
    import pynvml

    mask = 0
    for bit in ("HwSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown"):
        mask |= getattr(pynvml, f"nvmlClocksEventReason{bit}", None) or getattr(
            pynvml, f"nvmlClocksThrottleReason{bit}"
        )
    return mask


def utilization_percent(handle: Any) -> int | None:
    """The whole GPU's latest SM utilisation."""
    rates = _read("nvmlDeviceGetUtilizationRates", handle)
    return None if rates is None else int(rates.gpu)


def energy_mj(handle: Any) -> int | None:
    """The device's energy counter, millijoules since the driver loaded."""
    return _read("nvmlDeviceGetTotalEnergyConsumption", handle)


def process_utilization(handle: Any, since_us: int) -> list[tuple[float, int, int]] | None:
    """(time, pid, SM %) samples of each process since ``since_us``; [] where none was
    sampled (no process used the GPU)."""
    import pynvml

    try:
        samples = _read("nvmlDeviceGetProcessUtilization", handle, since_us)
    except pynvml.NVMLError as error:
        if error.value == pynvml.NVML_ERROR_NOT_FOUND:
            return []
        raise
    return None if samples is None else [(s.timeStamp / 1e6, s.pid, int(s.smUtil)) for s in samples]


def utilization_samples(handle: Any, since_us: int) -> list[tuple[float, int]] | None:
    """(time, SM %) samples of the whole GPU since ``since_us``."""
    import pynvml

    answer = _read("nvmlDeviceGetSamples", handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, since_us)
    return None if answer is None else [(s.timeStamp / 1e6, int(s.sampleValue.uiVal)) for s in answer[1]]


# -- health: ECC, page retirement, row remapping ---------------------------------------


def ecc_volatile_uncorrectable(handle: Any) -> int | None:
    """Uncorrectable ECC errors since the last reset."""
    import pynvml

    errors = _read(
        "nvmlDeviceGetTotalEccErrors",
        handle,
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        pynvml.NVML_VOLATILE_ECC,
    )
    return None if errors is None else int(errors)


def ecc_enabled(handle: Any) -> bool | None:
    import pynvml

    mode = _read("nvmlDeviceGetEccMode", handle)
    return None if mode is None else mode[0] == pynvml.NVML_FEATURE_ENABLED


def retired_pages_pending(handle: Any) -> bool | None:
    """Pages waiting to be retired at the next reset (GPUs before Ampere)."""
    import pynvml

    pending = _read("nvmlDeviceGetRetiredPagesPendingStatus", handle)
    return None if pending is None else pending == pynvml.NVML_FEATURE_ENABLED


class RemappedRows(NamedTuple):
    pending: bool
    failed: bool


def remapped_rows(handle: Any) -> RemappedRows | None:
    """Row remapping (Ampere and later): one waiting for the next reset, or one that failed."""
    rows = _read("nvmlDeviceGetRemappedRows", handle)
    return None if rows is None else RemappedRows(pending=bool(rows[2]), failed=bool(rows[3]))
