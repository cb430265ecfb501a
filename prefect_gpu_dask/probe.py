"""The memory-probe interface the guard judges by, and its NVML implementation.

The verdict logic only ever sees ``MemoryProbe.sample()``, so CI can drive it with a
scripted probe while the GPU machine drives it with NVML.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

from prefect_gpu_dask import nvml


class MemorySample(NamedTuple):
    """One reading: this process's bytes on its GPU, and the whole device's."""

    process: int  # -1 when the driver cannot attribute memory per process
    device_used: int
    device_total: int
    cached: int = 0  # free blocks held by allocator pools (CuPy, torch) in this process

    @property
    def judged(self) -> int:
        """What the driver says: per process where known, else device-wide."""
        return self.device_used if self.process < 0 else self.process

    @property
    def live(self) -> int:
        """Memory in use: the driver's figure less the pools' free blocks.

        Judging by this, a pool that grew is not a leak, and a leak served from
        blocks the pool already held is not hidden.
        """
        return self.judged - self.cached


@dataclass(frozen=True)
class GPUIdentity:
    index: int
    uuid: str


@runtime_checkable
class MemoryProbe(Protocol):
    """What the guard reads memory through.

    A probe may also offer ``sample_process() -> MemorySample``: a cheaper reading whose
    device figures may be 0. The guard reads through ``process_sampler`` where only
    ``judged`` matters (before a task, peaks during one) and ``sample()`` after.
    """

    gpu: GPUIdentity

    def sample(self) -> MemorySample: ...


def process_sampler(probe: MemoryProbe) -> Callable[[], MemorySample]:
    """The probe's cheapest reading that still gives a right ``judged``: its
    ``sample_process()`` where it has one, ``sample()`` when that cannot attribute
    memory to the process."""
    cheap = getattr(probe, "sample_process", None)
    if cheap is None:
        return probe.sample

    def read() -> MemorySample:
        sample = cheap()
        return sample if sample.process >= 0 else probe.sample()

    return read


class NvmlProbe:
    """Reads this process's GPU (first ``CUDA_VISIBLE_DEVICES`` entry) through NVML."""

    def __init__(self, handle: Any | None = None, pid: int | None = None):
        self._handle = handle if handle is not None else nvml.worker_device_handle()
        self._pid = pid if pid is not None else os.getpid()
        self.gpu = GPUIdentity(nvml.device_index(self._handle), nvml.device_uuid(self._handle))

    def sample(self) -> MemorySample:
        device = nvml.device_memory(self._handle)
        return MemorySample(nvml.process_memory(self._handle, self._pid), device.used, device.total)

    def sample_process(self) -> MemorySample:
        """This process's bytes only: one driver call instead of two (the device-wide
        one is ~a quarter of a reading on an H200). Device figures are 0."""
        return MemorySample(nvml.process_memory(self._handle, self._pid), 0, 0)

    def process_pids(self) -> list[int]:
        return nvml.process_pids(self._handle)


def open_probe() -> NvmlProbe | None:
    """An NVML probe for this process's GPU, or None on a host without one."""
    if nvml.visible_gpu_count() == 0:
        return None
    return NvmlProbe()
