"""Leak verdicts and restart reasons: pure logic over a ``MemoryProbe``.

A task's "after" figure is only trusted once allocator caches had their chance to
give memory back: CuPy's and torch's pools keep freed blocks, so a task that churned
4 GiB through the pool looks 4 GiB heavier until the pool is flushed. Like PyTorch's
own leak check, a suspicion is re-sampled after ``gc.collect()`` and a cache flush,
and confirmed once more after the driver has had a moment to settle.

Growth that survives that is a ``leak`` when the allocators say the task still holds
it (their in-use bytes grew by more than the threshold). Growth outside every
allocator is what a library's first use leaves in the process (cuBLAS/cuSOLVER
handles and workspaces, once per thread; kernels loaded once per process): the first
time a task leaves it on a worker thread it is ``library``, and only if the same task
leaves it again on the same thread is it a ``leak``.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from prefect_gpu_dask.records import CACHED, CLEAN, LEAK, LIBRARY, OOM, format_bytes
from prefect_gpu_dask.settings import RunnerSettings
from prefect_gpu_dask.worker.probe import AllocatorBytes, MemoryProbe, MemorySample, with_allocators


@dataclass(frozen=True)
class OutOfMemory:
    """A CUDA out-of-memory error, as one of the GPU libraries raised it."""

    library: str  # cupy | torch | rmm | numba | cuda
    requested: int | None  # bytes asked for, where the message says
    message: str


_SIZES = re.compile(r"(?:allocating|allocate)\s+([\d,]+)\s*bytes", re.IGNORECASE)
_HUMAN = re.compile(r"Tried to allocate\s+([\d.]+\s*[KMGTP]i?B)", re.IGNORECASE)


def _requested(message: str) -> int | None:
    from dask.utils import parse_bytes

    if match := _SIZES.search(message):
        return int(match.group(1).replace(",", ""))
    if match := _HUMAN.search(message):
        return parse_bytes(match.group(1).replace(" ", ""))
    return None


def _one_oom(exc: BaseException) -> OutOfMemory | None:
    kind, module, message = type(exc).__name__, type(exc).__module__ or "", str(exc)
    library = None
    if kind == "OutOfMemoryError" and module.startswith("cupy"):
        library = "cupy"
    elif (kind == "OutOfMemoryError" and module.startswith("torch")) or "CUDA out of memory" in message:
        library = "torch"
    elif isinstance(exc, MemoryError) and ("out_of_memory" in message or "bad_alloc" in message):
        library = "rmm"
    elif kind == "CudaAPIError" and "OUT_OF_MEMORY" in message:
        library = "numba"
    elif "out of memory" in message.lower() and "cuda" in message.lower():
        library = "cuda"
    return None if library is None else OutOfMemory(library, _requested(message), message[:500])


def out_of_memory(exc: BaseException | None) -> OutOfMemory | None:
    """The CUDA out-of-memory error behind ``exc`` (itself, its cause or context), if any.

    Recognised by type and message, so no GPU library is imported to ask.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if (found := _one_oom(exc)) is not None:
            return found
        exc = exc.__cause__ or exc.__context__
    return None


@dataclass(frozen=True)
class Verdict:
    status: str  # clean | cached | library | leak | oom
    before: MemorySample
    after: MemorySample
    delta: int
    restart_reason: str | None = None
    oom: OutOfMemory | None = None

    @property
    def allocator_delta(self) -> int | None:
        return owned_growth(self.before, self.after)


def no_allocators() -> AllocatorBytes:
    return AllocatorBytes()


def owned_growth(before: MemorySample, after: MemorySample) -> int | None:
    """How much more the allocators hand out after the task, where they can say."""
    if after.owned is None:
        return None
    return after.owned - (before.owned or 0)


def _read(sample: Callable[[], MemorySample], allocators: Callable[[], AllocatorBytes]) -> MemorySample:
    held = allocators()
    return with_allocators(sample(), held)


def _explained(before: MemorySample, after: MemorySample, threshold: int, alone: bool) -> bool:
    """No growth to suspect: memory in use grew by at most ``threshold`` and, on a
    worker allocating through RMM where the task ran ``alone``, so did what the
    allocators hand out. Inside an RMM pool (``rmm_pool_size``, ``rmm_async``) the
    driver sees only the pool: RMM's own figure is the only one a leak moves."""
    if after.live - before.live > threshold:
        return False
    if not alone or before.owned is None or after.owned is None or "rmm" not in (after.allocator or ""):
        return True
    return after.owned - before.owned <= threshold


def judge(
    read: Callable[[], MemorySample],
    before: MemorySample,
    settings: RunnerSettings,
    release_caches: Callable[[], None],
    sleep: Callable[[float], None],
    grew_before: bool,
    read_again: Callable[[], MemorySample] | None = None,
    alone: bool = True,
) -> tuple[str, MemorySample]:
    """Sample after a task (``read``) and decide clean / cached / library / leak,
    flushing only when needed. ``read_again``: how to read after the flush (default
    ``read``): in full, where ``read`` may answer from an earlier reading.

    Memory in use (``MemorySample.live``) is what is judged, so warm pools stay warm
    for the next task; only growth the pools cannot explain triggers the flush.
    ``grew_before``: this task already left growth outside every allocator on this
    worker thread, so doing it again is no library's one-time cost. ``alone``: no other
    guarded task ran on the worker while this one did; the allocators count for the
    whole process, not a thread, so only then does their figure alone make a suspect
    (``_explained``).
    """
    threshold = settings.leak_threshold
    after = read()
    if _explained(before, after, threshold, alone):
        # The hot path: two NVML reads, no flush.
        return (CLEAN if after.judged - before.judged <= threshold else CACHED), after
    release_caches()
    read_again = read_again or read
    after = read_again()
    if _explained(before, after, threshold, alone):
        return CACHED, after
    sleep(settings.settle_s)
    after = read_again()
    if _explained(before, after, threshold, alone):
        return CACHED, after
    held = owned_growth(before, after)
    if held is not None and held > settings.leak_threshold:
        return LEAK, after  # the task's own allocations are still alive
    return (LEAK if grew_before else LIBRARY), after


def restart_reason(
    status: str,
    after: MemorySample,
    delta: int,
    tasks_run: int,
    settings: RunnerSettings,
    replacement_bytes: int = 0,
) -> str | None:
    """Why this worker should be recycled now, or None. ``replacement_bytes``: what a
    replacement of this worker holds on the GPU once serving (its CUDA context)."""
    if status == LEAK:
        threshold = format_bytes(settings.leak_threshold)
        return f"leak: task left {format_bytes(delta)} on the GPU (threshold {threshold})"
    if status == OOM and delta > settings.leak_threshold:
        return f"oom: {format_bytes(delta)} still held after an out-of-memory error and a cache flush"
    if over_limit(after, settings, replacement_bytes):
        return (
            f"memory limit: GPU {after.device_used / after.device_total:.0%} used "
            f"(limit {settings.memory_limit:.0%})"
        )
    if settings.restart_after_tasks and tasks_run >= settings.restart_after_tasks:
        return f"recycle: {tasks_run} GPU tasks run (restart_after_tasks={settings.restart_after_tasks})"
    return None


def over_limit(sample: MemorySample, settings: RunnerSettings, replacement_bytes: int = 0) -> bool:
    """The GPU is above ``memory_limit`` and recycling this worker would bring it back
    under, with its replacement holding ``replacement_bytes``. Memory other processes
    hold (another cluster's worker, a notebook) does not come back when this one
    restarts, so recycling for it would only repeat after every task.
    Where the driver cannot attribute memory per process, the device-wide figure decides."""
    if not sample.device_total:
        return False
    limit = settings.memory_limit * sample.device_total
    if sample.process < 0:
        return sample.device_used > limit
    others = sample.device_used - sample.process
    return sample.device_used > limit and others + replacement_bytes <= limit


def verdict_for(
    probe: MemoryProbe,
    before: MemorySample,
    settings: RunnerSettings,
    tasks_run: int,
    release_caches: Callable[[], None],
    sleep: Callable[[float], None] = time.sleep,
    allocators: Callable[[], AllocatorBytes] = no_allocators,
    grew_before: bool = False,
    oom: OutOfMemory | None = None,
    replacement_bytes: int = 0,
    sample: Callable[[], MemorySample] | None = None,
    alone: bool = True,
) -> Verdict:
    """The verdict on one task. ``oom``: the task failed on a CUDA out-of-memory error;
    its verdict is ``oom``, and its worker is recycled only if, with the pools flushed,
    the memory has not come back. ``replacement_bytes``: see ``restart_reason``.
    ``sample``: the reading after the task (default ``probe.sample``), whose
    device-wide figures may be a little old (``probe.AfterSampler``): a memory limit
    they say is passed is read again in full (its ``full()``, where it has one) before
    it recycles the worker. ``alone``: see ``judge``."""
    read_in_full = functools.partial(_read, getattr(sample, "full", probe.sample), allocators)
    read = functools.partial(_read, sample, allocators) if sample is not None else read_in_full
    if oom is not None:
        release_caches()
        sleep(settings.settle_s)
        after = read_in_full()
        delta = after.live - before.live
        reason = restart_reason(OOM, after, delta, tasks_run, settings, replacement_bytes)
        return Verdict(OOM, before, after, delta, reason, oom)
    status, after = judge(read, before, settings, release_caches, sleep, grew_before, read_in_full, alone)
    if status != LEAK and over_limit(after, settings, replacement_bytes):
        # Cached blocks count toward the device's use: give them back before recycling.
        release_caches()
        after = read_in_full()
    delta = after.live - before.live
    held = owned_growth(before, after)
    if status == LEAK and held is not None and held > delta:
        delta = held  # inside a pool the driver saw none of it: the allocator's figure says
    reason = restart_reason(status, after, delta, tasks_run, settings, replacement_bytes)
    return Verdict(status, before, after, delta, reason)
