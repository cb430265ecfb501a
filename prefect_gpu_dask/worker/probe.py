"""The memory-probe interface the guard judges by, and its NVML implementation.

The verdict logic only ever sees ``MemoryProbe.sample()``, so CI can drive it with a
scripted probe while the GPU machine drives it with NVML.
"""

from __future__ import annotations

import importlib
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

from prefect_gpu_dask import _compat, nvml

T = TypeVar("T")


class MemorySample(NamedTuple):
    """One reading: this process's bytes on its GPU, and the whole device's."""

    process: int  # -1 when the driver cannot attribute memory per process
    device_used: int
    device_total: int
    cached: int = 0  # free blocks held by allocator pools (CuPy, torch, RMM) in this process
    owned: int | None = None  # bytes those allocators hand out (None: no allocator to ask)
    allocator: str | None = None  # whose figures those are: "rmm", "cupy", "torch", "rmm+cupy"...

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


class AllocatorBytes(NamedTuple):
    """What the allocators loaded in this process say about their device memory."""

    cached: int = 0  # free blocks pools keep for reuse
    owned: int | None = None  # blocks handed out and not yet freed: memory a task still holds
    allocator: str | None = None  # whose figures: "rmm", "cupy", "torch", joined by "+"


class RmmCounters:
    """RMM's figures in this process: what its current device resource hands out, and
    what its pool holds beyond that (``(owned, cached)``), or None where RMM's
    statistics are off (the current resource is no ``StatisticsResourceAdaptor``).

    ``owned`` is the adaptor's ``current_bytes`` (``rmm.statistics``): every allocation
    through RMM since statistics were enabled, cuDF's and ``rmm_cupy_allocator``'s
    included. The pool's reservation is ``cached``, never the task's: a
    ``PoolMemoryResource``'s ``pool_size()`` less ``owned``; a ``CudaAsyncMemoryResource``
    keeps what it once handed out (RMM sets no release threshold), so its reservation is
    at least the adaptor's ``peak_bytes``, less ``owned``. Other resources cache nothing.
    """

    def __init__(self, rmm: Any):
        self._mr = rmm.mr
        self._resource: Any = None
        self._pool: Any = None
        self._async = False

    def __call__(self) -> tuple[int, int] | None:
        mr = self._mr.get_current_device_resource()
        if not isinstance(mr, self._mr.StatisticsResourceAdaptor):
            return None
        if mr is not self._resource:
            self._pool, self._async = _pool_under(self._mr, mr)
            self._resource = mr
        counts = mr.allocation_counts
        owned = int(counts.current_bytes)
        if self._pool is not None:
            return owned, max(int(self._pool.pool_size()) - owned, 0)
        if self._async:
            return owned, max(int(counts.peak_bytes) - owned, 0)
        return owned, 0


def _pool_under(mr_module: Any, mr: Any) -> tuple[Any, bool]:
    """The ``PoolMemoryResource`` under the adaptors ``mr`` stacks (tracking, limiting,
    logging), or whether a ``CudaAsyncMemoryResource`` is there instead."""
    seen = 0
    while mr is not None and seen < 16:
        if isinstance(mr, mr_module.PoolMemoryResource):
            return mr, False
        if isinstance(mr, mr_module.CudaAsyncMemoryResource):
            return None, True
        get_upstream = getattr(mr, "get_upstream", None)
        mr = get_upstream() if get_upstream is not None else None
        seen += 1
    return None, False


_rmm_counters: RmmCounters | None = None


def rmm_counters() -> RmmCounters | None:
    """This process's ``RmmCounters``, where RMM is imported (never imports it)."""
    global _rmm_counters
    if _rmm_counters is None:
        rmm = _compat.imported_module("rmm")
        if rmm is None:
            return None
        _rmm_counters = RmmCounters(rmm)
    return _rmm_counters


def enable_rmm_statistics() -> bool:
    """Turn RMM's statistics on in this process, where RMM is already imported (a
    dask-cuda worker with ``rmm_pool_size`` or ``rmm_async``, or a task that imported
    cuDF or RMM); never imports RMM. ``rmm.statistics.enable_statistics`` puts a
    ``StatisticsResourceAdaptor`` on top of the current device resource (idempotent):
    allocations made before it keep their resource and are not counted. Returns whether
    statistics are on."""
    counters = rmm_counters()
    if counters is None:
        return False
    if counters() is not None:
        return True
    statistics = importlib.import_module("rmm.statistics")  # rmm itself is loaded
    statistics.enable_statistics()
    return counters() is not None


def loaded_allocator_bytes() -> AllocatorBytes:
    """CuPy's and torch's pools and RMM's statistics, for the libraries already loaded.

    Never imports anything: a library that is not imported holds nothing, and one that
    another thread is still importing holds nothing yet. RMM counts only where its
    statistics are enabled (``enable_rmm_statistics``). An allocator is named once it
    holds memory (CuPy routed through RMM, ``rmm_cupy_allocator``, leaves CuPy's pool
    empty: RMM alone is named).
    """
    cached, owned, names = 0, None, []
    counters = rmm_counters()
    rmm = counters() if counters is not None else None
    if rmm is not None:
        owned, cached = rmm
        names.append("rmm")
    cupy = _compat.imported_module("cupy")
    if cupy is not None:
        pool = cupy.get_default_memory_pool()
        used, total = pool.used_bytes(), pool.total_bytes()
        cached += total - used
        owned = (owned or 0) + used
        if total:
            names.append("cupy")
    torch = _compat.imported_module("torch")
    if torch is not None and torch.cuda.is_initialized():
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        cached += reserved - allocated
        owned = (owned or 0) + allocated
        if reserved:
            names.append("torch")
    return AllocatorBytes(cached, owned, "+".join(names) or None)


@dataclass(frozen=True)
class GPUIdentity:
    index: int
    uuid: str
    name: str = ""  # NVML's device name, e.g. "NVIDIA H200"
    memory_total: int = 0  # bytes (a MIG instance's own size)


@runtime_checkable
class MemoryProbe(Protocol):
    """What the guard reads memory through.

    A probe may also offer ``sample_process() -> MemorySample``: a cheaper reading whose
    device figures may be 0; with ``sample_process_and_others() -> (MemorySample, int)``,
    the same and how many other processes have a context on the device, and
    ``sample_device() -> (used, total)``, the whole device's memory, cheaper still, the
    guard reads through a ``ProcessReader``. The guard reads through ``process_sampler`` where only
    ``judged`` matters (before a task, peaks during one) and ``sample()`` after. A probe
    that models its own allocator offers ``allocator_bytes() -> AllocatorBytes``;
    otherwise the guard asks the loaded libraries (``loaded_allocator_bytes``). A probe
    that can judge its GPU's health offers ``health_reader() -> () -> HealthReadings``
    (``health.py``); without one, the worker's GPU is not health-checked. A probe that
    can say what a task did on the GPU besides memory offers ``activity_reader() ->
    ActivityReader`` (``activity.py``); without one, records carry no utilisation or energy.
    A probe that can list every process's bytes on its GPU offers ``process_memories() ->
    {pid: bytes}``; a cluster taking the host-wide turn on the GPU then waits for another
    cluster's memory to come back (``host_gpu_lock.MemoryHandover``).
    """

    gpu: GPUIdentity

    def sample(self) -> MemorySample: ...


def with_allocators(sample: MemorySample, held: AllocatorBytes) -> MemorySample:
    """``sample`` with what the allocators say (built directly: ``_replace`` costs more
    than the reading it completes)."""
    return MemorySample(
        sample.process, sample.device_used, sample.device_total, held.cached, held.owned, held.allocator
    )


def allocator_reader(probe: MemoryProbe) -> Callable[[], AllocatorBytes]:
    return getattr(probe, "allocator_bytes", loaded_allocator_bytes)


def process_sampler(probe: MemoryProbe) -> Callable[[], MemorySample]:
    """The probe's cheapest reading that still gives a right ``judged``: its
    ``sample_process()`` where it has one, ``sample()`` when that cannot attribute
    memory to the process; through the device's own figure first (``ProcessReader``)
    where the probe offers ``sample_device()`` and ``sample_process_and_others()``."""
    device = getattr(probe, "sample_device", None)
    listed = getattr(probe, "sample_process_and_others", None)
    if device is not None and listed is not None:
        return ProcessReader(listed, device, allocator_reader(probe))
    cheap = getattr(probe, "sample_process", None)
    if cheap is None:
        return probe.sample

    def read() -> MemorySample:
        sample = cheap()
        return sample if sample.process >= 0 else probe.sample()

    return read


# How long a reading of the process list may stand for later ones (``ProcessReader``).
KNOWN_READING_MAX_AGE_S = 1.0


class _Kept(NamedTuple):
    at: float
    device_used: int
    allocators: AllocatorBytes
    sample: MemorySample


class ProcessReader:
    """This process's bytes on its GPU, with the device's figures, read through the
    device's used memory first.

    The device's figure is one short driver call; the process list, a few times longer,
    was most of what the guard cost a task. While this process is the only one with a
    context on the GPU, any change of its memory moves the device's figure, so while
    that figure and this process's allocators (CuPy's, torch's, RMM's pools) stand where
    they stood at a reading of the list at most ``max_age_s`` old, the process holds what
    it held then, and the list is not read again. A reading is kept only where the list
    showed no other process and the device's figure was the same before and after it:
    another process's change could offset this one's, and a process that comes creates a
    context, which moves the figure. Where the driver cannot attribute memory per process
    (MIG, vGPU), the device's figure is the reading, and the list is read again once
    ``max_age_s`` has passed. While the last list showed other processes, the list is
    the reading, as without the device's figure (whose figures then read 0, as
    ``sample_process``'s do), until one shows this process alone again. "Other
    processes" are those NVML lists with a CUDA context on the device.

    Threads share one reader; the kept reading and the mode are swapped whole, and a
    thread may keep a reading another has just dropped: it stands only while the
    device's figure is exactly what it was when that reading was made.
    """

    def __init__(
        self,
        read_list: Callable[[], tuple[MemorySample, int]],
        device: Callable[[], tuple[int, int]],
        allocators: Callable[[], AllocatorBytes],
        max_age_s: float = KNOWN_READING_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._read_list = read_list
        self._device = device
        self._allocators = allocators
        self._max_age_s = max_age_s
        self._clock = clock
        self._kept: _Kept | None = None  # swapped whole: threads read at once
        self._shared = False  # the last list showed other processes on the GPU

    def __call__(self) -> MemorySample:
        if self._shared:
            listed, others = self._read_list()
            if listed.process >= 0:
                self._shared = others > 0
                return listed
            self._shared = False
            used, total = self._device()
            return self._unattributed(used, total, self._clock())
        used, total = self._device()
        now = self._clock()
        kept = self._kept
        recent = kept if kept is not None and now - kept.at <= self._max_age_s else None
        if recent is not None and recent.sample.process < 0:
            return MemorySample(-1, used, total)
        held = self._allocators()
        if recent is not None and recent.device_used == used and recent.allocators == held:
            return recent.sample
        listed, others = self._read_list()
        if listed.process < 0:
            return self._unattributed(used, total, now)
        after = self._device()[0]
        if others:
            self._kept, self._shared = None, True
            return MemorySample(listed.process, after, total)
        sample = MemorySample(listed.process, after, total)
        if after == used:
            self._kept = _Kept(now, used, held, sample)
        return sample

    def _unattributed(self, used: int, total: int, now: float) -> MemorySample:
        """The driver cannot attribute memory per process: the device's figure is the
        reading until the list is read again, ``max_age_s`` from now."""
        sample = MemorySample(-1, used, total)
        self._kept = _Kept(now, used, AllocatorBytes(), sample)
        return sample


# How old the device-wide figure after a task may be (see ``AfterSampler``).
DEVICE_READING_MAX_AGE_S = 1.0


class AfterSampler:
    """The reading after a task: this process's bytes read now, the device's from a full
    reading at most ``max_age_s`` old, moved by this process's own change since. What
    other processes did within that age is not seen; only the memory limit reads it,
    and a limit the figure says is passed is confirmed by ``full()``
    (``verdict.verdict_for``). A probe without ``sample_process``, or one that cannot
    attribute memory to the process, is read in full. Given a ``ProcessReader``
    (``process``), which reads the device's figures with every reading, it reads through
    that instead."""

    def __init__(
        self,
        probe: MemoryProbe,
        max_age_s: float = DEVICE_READING_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
        process: Callable[[], MemorySample] | None = None,
    ):
        self._probe = probe
        self._cheap = getattr(probe, "sample_process", None)
        self._max_age_s = max_age_s
        self._clock = clock
        self._last: tuple[float, MemorySample] | None = None  # swapped whole: threads read at once
        # A ``ProcessReader`` reads the device's figures now with every reading: no estimate.
        self._fresh = process if isinstance(process, ProcessReader) else None

    def __call__(self) -> MemorySample:
        if self._fresh is not None:
            sample = self._fresh()
            return sample if sample.device_total else self._moved(sample)
        if self._cheap is not None and self._recent() is not None:
            sample = self._cheap()
            if sample.process >= 0:
                return self._moved(sample)
        return self.full()

    def _recent(self) -> MemorySample | None:
        last = self._last
        if last is None or last[1].process < 0 or self._clock() - last[0] > self._max_age_s:
            return None
        return last[1]

    def _moved(self, sample: MemorySample) -> MemorySample:
        """The device's figures of the recent full reading, moved by this process's change
        since (``sample``: this process's bytes now); where none is recent, ``sample``
        with the device's figures read now, which later estimates start from."""
        full = self._recent()
        if full is None:
            device = getattr(self._probe, "sample_device", None)
            if device is None:
                return self.full()
            used, total = device()
            full = MemorySample(sample.process, used, total)
            self._last = (self._clock(), full)
            return full
        used = full.device_used + sample.process - full.process
        return MemorySample(sample.process, min(max(used, 0), full.device_total), full.device_total)

    def full(self) -> MemorySample:
        """A full reading now, which later estimates start from."""
        full = self._probe.sample()
        self._last = (self._clock(), full)
        return full


class NvmlProbe:
    """Reads this process's GPU (first ``CUDA_VISIBLE_DEVICES`` entry) through NVML."""

    def __init__(self, handle: Any | None = None, pid: int | None = None):
        self._handle = handle if handle is not None else nvml.worker_device_handle()
        self._pid = pid if pid is not None else os.getpid()
        self.gpu = GPUIdentity(
            _needed(nvml.device_index(self._handle), "index"),
            _needed(nvml.device_uuid(self._handle), "UUID"),
            nvml.device_name(self._handle) or "",
            self._memory().total,
        )

    def _memory(self) -> nvml.DeviceMemory:
        return _needed(nvml.device_memory(self._handle), "memory")

    def sample(self) -> MemorySample:
        device = self._memory()
        return MemorySample(nvml.process_memory(self._handle, self._pid), device.used, device.total)

    def sample_process(self) -> MemorySample:
        """This process's bytes only: one driver call instead of two (the device-wide
        one is a good part of a reading). Device figures are 0."""
        return MemorySample(nvml.process_memory(self._handle, self._pid), 0, 0)

    def sample_process_and_others(self) -> tuple[MemorySample, int]:
        """``sample_process()``, and how many other processes have a context on this GPU
        (the same driver call)."""
        memory, others = nvml.process_memory_and_others(self._handle, self._pid)
        return MemorySample(memory, 0, 0), others

    def sample_device(self) -> nvml.DeviceMemory:
        """The whole device's memory in use and in all: the shortest driver call."""
        return self._memory()

    def process_pids(self) -> list[int]:
        return nvml.process_pids(self._handle)

    def process_memories(self) -> dict[int, int]:
        """Every process's bytes on this GPU, by PID (NVML's compute-process list): what
        a cluster taking the GPU's turn waits on (``host_gpu_lock.MemoryHandover``)."""
        return nvml.process_memories(self._handle)

    def activity_reader(self) -> Any:
        """This GPU's utilisation, energy, temperature and throttling, for
        ``activity.ActivityWatch``."""
        from prefect_gpu_dask.worker.activity import NvmlActivity

        return NvmlActivity(self._handle, self._pid)

    def health_reader(self) -> Callable[[], Any]:
        """This GPU's health readings, for ``health.HealthMonitor``."""
        from prefect_gpu_dask.health import NvmlHealthReader

        return NvmlHealthReader(self._handle)


ProbeFactory = Callable[[], Any]


def resolve_probe_factory(value: str | ProbeFactory) -> ProbeFactory:
    """The factory named by ``"package.module:factory"`` (imported where it runs)."""
    if callable(value):
        return value
    module, _, name = value.rpartition(":")
    return getattr(importlib.import_module(module), name)


def _needed(reading: T | None, what: str) -> T:
    """A reading the probe cannot do without (the guard is off on a GPU without it)."""
    if reading is None:
        raise RuntimeError(f"NVML does not read this GPU's {what}")
    return reading


def open_probe(memory_probe: str | ProbeFactory | None = None) -> MemoryProbe | None:
    """This process's probe: the runner's ``memory_probe``'s, else an NVML probe of its
    GPU (None on a host without one)."""
    if memory_probe is not None:
        return resolve_probe_factory(memory_probe)()
    if nvml.visible_gpu_count() == 0:
        return None
    return NvmlProbe()


# What opening a probe raises: NVML's bindings or driver missing or failing, a
# ``memory_probe`` that does not resolve or construct. Anything else is a bug and propagates.
OPEN_ERRORS: tuple[type[Exception], ...] = (
    *nvml.READ_ERRORS,
    ImportError,
    ValueError,
    TypeError,
    AttributeError,
    RuntimeError,
)

_opened: weakref.WeakKeyDictionary[Any, dict[Any, tuple[MemoryProbe | None, Exception | None]]] = (
    weakref.WeakKeyDictionary()
)


def worker_probe(worker: Any, memory_probe: str | ProbeFactory | None) -> MemoryProbe | None:
    """``open_probe`` once per worker: its labels and its guard read the same probe (and
    each hears what opening it raised)."""
    key = memory_probe if memory_probe is None or isinstance(memory_probe, str) else id(memory_probe)
    opened = _opened.setdefault(worker, {})
    if key not in opened:
        try:
            opened[key] = (open_probe(memory_probe), None)
        except OPEN_ERRORS as exc:
            opened[key] = (None, exc)
    probe, error = opened[key]
    if error is not None:
        raise error
    return probe
