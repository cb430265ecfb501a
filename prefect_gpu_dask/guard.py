"""The per-task GPU memory guard that runs inside each Dask worker.

``GPUMemoryGuard`` is a small ``WorkerPlugin``: arguments are validated in
``__init__``, NVML is opened in ``setup`` (so CPU workers just log one line and do
nothing). The runner wraps each guarded Prefect task's function with ``guarded``: the
wrapper samples this process's memory on its GPU right before and after the user's
code, inside the task run (so the record lands in the task run's log), judges it with
``policy.verdict_for`` and reports it to the flow through a Dask worker event.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from distributed import WorkerPlugin
from distributed.core import Status

from prefect_gpu_dask.policy import LEAK, GuardSettings, Verdict, format_bytes, verdict_for
from prefect_gpu_dask.probe import MemoryProbe, MemorySample, process_sampler

PLUGIN_NAME = "prefect-gpu-dask-guard"
RECORD_TOPIC = "prefect-gpu-dask-memory"
PEAK_INTERVAL_S = 0.005
# Each peak reading takes the GIL and the driver from the task for a moment (one GPU,
# speed-cube: sampling every 5 ms throughout cost 12 ms of 0.53 s), so the interval
# doubles while tasks run, up to this.
PEAK_MAX_INTERVAL_S = 0.1
RELEASE_WAIT_S = 15.0
# A drained worker whose flow never restarts it (the flow ended, restart="never" elsewhere)
# takes tasks again after this long.
DRAIN_EXPIRY_S = 120.0

logger = logging.getLogger("prefect_gpu_dask.guard")


def release_allocator_caches() -> None:
    """Give cached device memory back to the driver, for libraries already loaded.

    Never imports anything: a library that is not in ``sys.modules`` has no cache.
    """
    gc.collect()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    # RMM pools cannot shrink; a worker running on an RMM pool is judged after the
    # re-sample only, and its pool size belongs in leak_threshold.


def cached_allocator_bytes() -> int:
    """Device bytes that allocator pools hold as free blocks (reusable, not leaked)."""
    cached = 0
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        pool = cupy.get_default_memory_pool()
        cached += pool.total_bytes() - pool.used_bytes()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        cached += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    return cached


def _create_cuda_context() -> bool:
    """Create this process's CUDA context, so a task is not blamed for it (~500 MiB)."""
    try:
        import cupy

        cupy.cuda.runtime.memGetInfo()
        return True
    except ImportError:
        pass
    try:
        from numba import cuda

        cuda.current_context()
        return True
    except ImportError:
        return False


_drains: weakref.WeakKeyDictionary[Any, object] = weakref.WeakKeyDictionary()
# Worker-side states of tasks assigned to this worker that have not started running.
NOT_STARTED = {"waiting", "ready", "constrained"}


def drain(dask_worker: Any, expiry_s: float = DRAIN_EXPIRY_S) -> dict[str, Any]:
    """Stop a worker from starting tasks; say what it still runs and what never started.

    Runs on the worker's event loop (``client.run`` or ``loop.add_callback``). The
    worker reports ``closing_gracefully``, as in ``retire_workers``: the scheduler
    sends it nothing new, tasks already queued there wait, running ones finish, and
    it still serves its results. Unlike ``paused``, the memory monitor never undoes it.
    Each call re-arms the expiry: a drain ends by itself only once nobody asks for it.
    """
    if dask_worker.status in (Status.running, Status.paused) or dask_worker in _drains:
        if dask_worker.status != Status.closing_gracefully:
            dask_worker.status = Status.closing_gracefully
        token = _drains[dask_worker] = object()
        dask_worker.loop.call_later(expiry_s, _expire_drain, dask_worker, token)
    state = dask_worker.state
    return {
        "running": len(state.executing) + len(state.long_running),
        "not_started": [ts.key for ts in state.tasks.values() if ts.state in NOT_STARTED],
    }


def resume(dask_worker: Any) -> None:
    """Undo our ``drain`` (never a ``retire_workers`` someone else started)."""
    if _drains.pop(dask_worker, None) is not None and dask_worker.status == Status.closing_gracefully:
        dask_worker.status = Status.running


def _expire_drain(dask_worker: Any, token: object) -> None:
    if _drains.get(dask_worker) is token:
        logger.warning("Worker %s was drained for a restart that never came: resuming", dask_worker.address)
        resume(dask_worker)


class PeakSampler:
    """One daemon thread per worker that tracks peak memory while guarded tasks run."""

    def __init__(
        self,
        probe: MemoryProbe,
        interval_s: float = PEAK_INTERVAL_S,
        max_interval_s: float = PEAK_MAX_INTERVAL_S,
    ):
        self._read = process_sampler(probe)
        self._first_interval = self._interval = interval_s
        self._max_interval = max(interval_s, max_interval_s)
        self._peaks: dict[int, int] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._restart = threading.Event()  # a task started: cut a long wait short
        self._thread: threading.Thread | None = None

    def start(self, ticket: int, first: int) -> None:
        with self._lock:
            self._peaks[ticket] = first
            self._interval = self._first_interval  # a new task is watched closely again
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpu-peak", daemon=True)
            self._thread.start()
        self._restart.set()
        self._wake.set()

    def stop(self, ticket: int, last: int) -> int:
        with self._lock:
            peak = max(self._peaks.pop(ticket, last), last)
            if not self._peaks:
                self._wake.clear()
        return peak

    def _run(self) -> None:
        while True:
            self._wake.wait()
            # A task shorter than one interval is bounded by its before/after samples:
            # sampling it would only compete with it (and with the guard's own reads).
            if self._restart.wait(self._interval):
                self._restart.clear()  # its first reading comes one short interval from now
                continue
            with self._lock:
                if not self._peaks:
                    continue
                self._interval = min(2 * self._interval, self._max_interval)
            try:
                used = self._read().judged
            except Exception:  # a failing read must never break the worker
                used = 0
            with self._lock:
                for ticket, peak in self._peaks.items():
                    if used > peak:
                        self._peaks[ticket] = used


class GPUMemoryGuard(WorkerPlugin):
    """Worker plugin: measure, judge and report GPU memory around guarded tasks."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(
        self,
        settings: GuardSettings | None = None,
        probe_factory: Callable[[], MemoryProbe | None] | None = None,
    ):
        self.settings = settings or GuardSettings()
        if probe_factory is not None and not callable(probe_factory):
            raise ValueError(f"probe_factory {probe_factory!r} is not callable")
        self.probe_factory = probe_factory
        self.probe: MemoryProbe | None = None
        self.worker: Any = None
        self.baseline: MemorySample | None = None
        self.tasks_run = 0
        self._tickets = 0
        self._sampler: PeakSampler | None = None
        self._read_process: Callable[[], MemorySample] | None = None

    # -- WorkerPlugin -------------------------------------------------------------
    async def setup(self, worker: Any) -> None:
        self.worker = worker
        if self.probe_factory is not None:
            self.probe = self.probe_factory()
        else:
            from prefect_gpu_dask.probe import open_probe

            try:
                self.probe = open_probe()
            except Exception as exc:  # NVML present but unusable: guard off, worker fine
                logger.warning("GPU memory guard disabled on %s: %s", worker.address, exc)
                self.probe = None
        if self.probe is None:
            logger.info("No GPU on worker %s: GPU memory guard is a no-op", worker.address)
            return
        # The CUDA context is created lazily by the first guarded task (begin()): a
        # worker that never runs one pays nothing, and the cluster starts faster.
        await self._wait_for_previous_process_memory()
        self.baseline = self.probe.sample()
        # Before a task only ``judged`` counts (the device-wide figures come after it).
        self._read_process = process_sampler(self.probe)
        self._sampler = PeakSampler(self.probe)

    async def _wait_for_previous_process_memory(self) -> None:
        """After a restart, hold tasks off until a dead worker's GPU memory is gone.

        The driver frees a killed process's memory asynchronously; a new worker that
        allocates before then can OOM (dask-cuda #859, #1075).
        """
        pids = getattr(self.probe, "process_pids", None)
        if pids is None:
            return
        deadline = time.monotonic() + RELEASE_WAIT_S
        while time.monotonic() < deadline:
            if all(os.path.exists(f"/proc/{pid}") for pid in pids()):
                return
            await asyncio.sleep(0.05)
        logger.warning("GPU memory of a previous worker was not released in %.0f s", RELEASE_WAIT_S)

    # -- around one task ----------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.probe is not None

    def begin(self) -> tuple[int, MemorySample, float]:
        self._tickets += 1
        ticket = self._tickets
        before = self._read_process()
        if before.process == 0 and _create_cuda_context():
            before = self._read_process()  # the context is the process's, not the task's
        before = before._replace(cached=cached_allocator_bytes())
        self._sampler.start(ticket, before.judged)
        return ticket, before, time.perf_counter()

    def end(self, ticket: int, before: MemorySample, started: float) -> tuple[Verdict, int, float]:
        duration = time.perf_counter() - started
        self.tasks_run += 1
        verdict = verdict_for(
            self.probe,
            before,
            self.settings,
            self.tasks_run,
            release_allocator_caches,
            cached_bytes=cached_allocator_bytes,
        )
        peak = self._sampler.stop(ticket, verdict.after.judged)
        return verdict, peak, duration

    def report(self, record: dict[str, Any]) -> None:
        self.worker.log_event(RECORD_TOPIC, record)
        if record["restart_reason"] and self.settings.restart == "worker":
            # Start nothing new here from now on: the flow restarts this worker once
            # what it runs has finished. Queued before this task returns, so the next
            # task waiting for this one's slot never starts here.
            self.worker.loop.add_callback(drain, self.worker)


def current_guard() -> GPUMemoryGuard | None:
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:
        return None
    guard = worker.plugins.get(PLUGIN_NAME)
    return guard if isinstance(guard, GPUMemoryGuard) and guard.active else None


def _task_identity() -> dict[str, Any]:
    from prefect.context import TaskRunContext

    ctx = TaskRunContext.get()
    if ctx is None:
        return {"task_run_id": None, "task_run_name": None, "flow_run_id": None, "tags": []}
    run = ctx.task_run
    return {
        "task_run_id": str(run.id),
        "task_run_name": run.name,
        "task_name": ctx.task.name,
        "flow_run_id": str(run.flow_run_id) if run.flow_run_id else None,
        "tags": sorted(run.tags or []),
    }


def build_record(guard: GPUMemoryGuard, verdict: Verdict, peak: int, duration: float) -> dict[str, Any]:
    probe = guard.probe
    return {
        **_task_identity(),
        "worker": guard.worker.address,
        "worker_name": str(guard.worker.name),
        "pid": os.getpid(),
        "gpu_index": probe.gpu.index,
        "gpu_uuid": probe.gpu.uuid,
        "before": verdict.before.judged,
        "after": verdict.after.judged,
        "peak": peak,
        "delta": verdict.delta,
        "device_used": verdict.after.device_used,
        "device_total": verdict.after.device_total,
        "verdict": verdict.status,
        "restart_reason": verdict.restart_reason,
        "duration_s": round(duration, 6),
        "time": time.time(),
    }


def _log_record(record: dict[str, Any]) -> None:
    from prefect.logging import get_run_logger

    message = (
        f"GPU memory on {record['gpu_uuid']} (#{record['gpu_index']}): "
        f"before {format_bytes(record['before'])}, after {format_bytes(record['after'])}, "
        f"peak {format_bytes(record['peak'])}, delta {format_bytes(record['delta'])} "
        f"-> {record['verdict']}"
    )
    run_logger = get_run_logger()
    if record["verdict"] == LEAK or record["restart_reason"]:
        run_logger.warning(
            "%s; worker %s will be recycled (%s)",
            message,
            record["worker"],
            record["restart_reason"],
        )
    else:
        run_logger.info(message)


def _finish(guard: GPUMemoryGuard, ticket: int, before: MemorySample, started: float) -> None:
    verdict, peak, duration = guard.end(ticket, before, started)
    record = build_record(guard, verdict, peak, duration)
    _log_record(record)
    guard.report(record)


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a task function so the worker's guard measures it (no-op without a guard)."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def guarded_async(*args: Any, **kwargs: Any) -> Any:
            guard = current_guard()
            if guard is None:
                return await fn(*args, **kwargs)
            ticket, before, started = guard.begin()
            try:
                return await fn(*args, **kwargs)
            finally:
                _finish(guard, ticket, before, started)

        return guarded_async

    @functools.wraps(fn)
    def guarded_sync(*args: Any, **kwargs: Any) -> Any:
        guard = current_guard()
        if guard is None:
            return fn(*args, **kwargs)
        ticket, before, started = guard.begin()
        try:
            return fn(*args, **kwargs)
        finally:
            _finish(guard, ticket, before, started)

    return guarded_sync
