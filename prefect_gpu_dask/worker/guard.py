"""The per-task GPU memory guard that runs inside each Dask worker.

``GPUMemoryGuard`` is a small ``WorkerPlugin``: settings are validated before it is
built (``RunnerSettings``), the worker's probe (NVML, or the configured
``memory_probe``; its labels read the same one) is opened in ``setup``, so CPU workers
just log one line and do nothing. The flow clones each guarded Prefect task with
``taskwrap.with_around(task, guarding)``: this process's
memory on its GPU is read right before and after the user's code, inside the task run
(so the record lands in the task run's log), judged by ``verdict.verdict_for``, and
sent to the flow as a ``TaskRecord`` in a Dask worker event.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple

from distributed import Worker, WorkerPlugin

from prefect_gpu_dask import _compat, nvml
from prefect_gpu_dask.health import HealthMonitor
from prefect_gpu_dask.records import (
    HUNG_TOPIC,
    LEAK,
    LIBRARY,
    OOM,
    RECORD_TOPIC,
    HungTask,
    TaskRecord,
    format_bytes,
)
from prefect_gpu_dask.resources import GPU_RESOURCE
from prefect_gpu_dask.settings import RunnerSettings
from prefect_gpu_dask.worker import task_threads
from prefect_gpu_dask.worker.activity import Activity, ActivityWatch
from prefect_gpu_dask.worker.compute import GRAPH_THREAD_PREFIX
from prefect_gpu_dask.worker.metrics import serve_gauges
from prefect_gpu_dask.worker.probe import (
    AfterSampler,
    AllocatorBytes,
    MemoryProbe,
    MemorySample,
    allocator_reader,
    enable_rmm_statistics,
    process_sampler,
    with_allocators,
    worker_probe,
)
from prefect_gpu_dask.worker.quarantine import HealthWatch
from prefect_gpu_dask.worker.recycling import WorkerRecycling
from prefect_gpu_dask.worker.stall import StallWatch
from prefect_gpu_dask.worker.verdict import OutOfMemory, Verdict, out_of_memory, verdict_for

PLUGIN_NAME = "prefect-gpu-dask-guard"
PEAK_INTERVAL_S = 0.005
# Each peak reading takes the GIL and the driver from the task for a moment, so the
# interval doubles while tasks run, up to this.
PEAK_MAX_INTERVAL_S = 0.1

logger = logging.getLogger(__name__)


def release_allocator_caches() -> None:
    """Give cached device memory back to the driver, for libraries already loaded.

    Never imports anything: a library that is not imported (or still being imported by
    another thread) has no cache.
    """
    gc.collect()
    cupy = _compat.imported_module("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    torch = _compat.imported_module("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    # RMM pools are not flushed: their reservation counts as cached (probe.RmmCounters).


_no_cuda_library = False


def _create_cuda_context() -> bool:
    """Create this process's CUDA context, so a task is not blamed for it; False where
    neither CuPy nor Numba is installed (asked once: each failed import searches the
    whole ``sys.path``, and a worker with no context asks before every task)."""
    global _no_cuda_library
    if _no_cuda_library:
        return False
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
        _no_cuda_library = True
        return False


class PeakSampler:
    """One daemon thread per worker that tracks peak memory while guarded tasks run."""

    def __init__(
        self,
        probe: MemoryProbe,
        interval_s: float = PEAK_INTERVAL_S,
        max_interval_s: float = PEAK_MAX_INTERVAL_S,
        read: Callable[[], MemorySample] | None = None,
    ):
        self._read = read if read is not None else process_sampler(probe)
        self._first_interval = self._interval = interval_s
        self._max_interval = max(interval_s, max_interval_s)
        self._peaks: dict[int, int] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._restart = threading.Event()  # a task started: cut a long wait short
        self._thread: threading.Thread | None = None
        self._read_failed = False  # said once: the thread reads every few milliseconds

    def start(self, ticket: int, first: int) -> None:
        with self._lock:
            self._peaks[ticket] = first
            backed_off = self._interval > self._first_interval
            self._interval = self._first_interval  # a new task is watched closely again
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpu-peak", daemon=True)
            self._thread.start()
        # Wake the thread only when it must change what it waits for: each wake-up
        # takes the GIL from the task threads.
        if backed_off:
            self._restart.set()
        if not self._wake.is_set():
            self._wake.set()

    def stop(self, ticket: int, last: int) -> int:
        # The thread goes idle by itself (below): clearing ``_wake`` here would make the
        # next task's start wake it, a GIL handoff per task.
        with self._lock:
            return max(self._peaks.pop(ticket, last), last)

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
                    self._wake.clear()  # start() sets it again after adding its ticket
                    continue
                self._interval = min(2 * self._interval, self._max_interval)
            try:
                used = self._read().judged
            except Exception as exc:  # the thread's loop: a failing read must never end it
                if not self._read_failed:
                    self._read_failed = True
                    logger.warning(
                        "GPU memory peak not readable (%r): peaks are the before/after figures", exc
                    )
                used = 0
            with self._lock:
                for ticket, peak in self._peaks.items():
                    if used > peak:
                        self._peaks[ticket] = used


class _Allowance(NamedTuple):
    """Where a task had left growth outside every allocator: the pool threads alive
    then, and the threads its work had run on."""

    alive: frozenset[threading.Thread]
    used: frozenset[threading.Thread]


class GPUMemoryGuard(WorkerPlugin):
    """Worker plugin: measure, judge and report GPU memory around guarded tasks."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, settings: RunnerSettings | None = None):
        self.settings = settings if settings is not None else RunnerSettings()
        self.probe: MemoryProbe | None = None
        self.worker: Worker | None = None
        self.baseline: MemorySample | None = None
        self.context_bytes = 0  # this process's GPU memory with only its CUDA context
        self.recycling: WorkerRecycling | None = None
        self.tasks_run = 0
        self._tasks_of: collections.Counter[str | None] = collections.Counter()  # per flow run
        self._tickets = itertools.count(1)  # next() is atomic: worker threads begin at once
        self._sampler: PeakSampler | None = None
        self._activity: ActivityWatch | None = None
        self.health: HealthWatch | None = None
        self.stalls: StallWatch | None = None
        self._health_asked = False  # a flow run asked for checks this plugin's settings left off
        self._follow_lock: threading.Lock | None = None  # made in setup: the plugin is pickled
        self._read_process: Callable[[], MemorySample] | None = None
        self._read_after: AfterSampler | None = None
        self._read_allocators: Callable[[], AllocatorBytes] | None = None
        # (task name, worker thread) that already left growth outside every allocator:
        # libraries keep handles per thread. Threads, not their idents: a thread that
        # secedes (worker_client) is replaced, and the new one may get a dead one's
        # ident while its handles are new.
        self._grew: dict[tuple[str | None, threading.Thread], _Allowance] = {}
        # Guarded tasks running now, and those that ran beside another: RMM's (and the
        # pools') counters are the process's, so only a task that ran alone is judged by
        # them alone (``verdict.judge``).
        self._running: set[int] = set()
        self._beside: set[int] = set()
        self._running_lock: threading.Lock | None = None  # made in setup: the plugin is pickled

    # -- WorkerPlugin -------------------------------------------------------------
    async def setup(self, worker: Worker) -> None:
        self.worker = worker
        self._follow_lock = threading.Lock()
        self._running_lock = threading.Lock()
        try:
            self.probe = worker_probe(worker, self.settings.memory_probe)
        except Exception as exc:  # a plugin hook: NVML or a memory_probe unusable, guard off, worker fine
            logger.warning("GPU memory guard disabled on %s: %r", worker.address, exc)
            self.probe = None
        if self.probe is None:
            logger.info("No GPU on worker %s: GPU memory guard is a no-op", worker.address)
            return
        # The CUDA context is created lazily by the first guarded task (begin()): a
        # worker that never runs one pays nothing, and the cluster starts faster.
        self.recycling = WorkerRecycling(worker, self.settings.restart)
        self._count_rmm()  # dask-cuda's RMM setup (rmm_pool_size, rmm_async) ran before
        await self.recycling.wait_for_predecessor(self.probe)  # a replacement: the old memory goes first
        self._take_baseline()
        # Before a task only ``judged`` counts (the device-wide figures come after it).
        self._read_process = process_sampler(self.probe)
        self._read_after = AfterSampler(self.probe, process=self._read_process)
        self._read_allocators = allocator_reader(self.probe)
        self._sampler = PeakSampler(self.probe, read=self._read_process)
        reader = getattr(self.probe, "activity_reader", None)
        self._activity = ActivityWatch(reader()) if reader is not None else None
        read_process = self._read_process
        self.stalls = StallWatch(lambda: read_process().judged, self._gpu_busy, self._report_stall)
        serve_gauges(self)
        self._watch_health(worker, self.settings.health_check_s)
        self._health_asked = self.health is not None

    def _count_rmm(self) -> None:
        """RMM's statistics on, where this worker has RMM loaded (never imported here)."""
        if _compat.imported_module("rmm") is None:
            return
        try:
            enable_rmm_statistics()
        # RMM's C++ errors come as RuntimeError; an RMM without ``rmm.statistics`` as
        # ImportError or AttributeError. RMM unusable: the driver's figures still judge.
        except (RuntimeError, ImportError, AttributeError) as exc:
            logger.warning("RMM statistics could not be enabled on %s: %r", self._address(), exc)

    def _address(self) -> str | None:
        return self.worker.address if self.worker is not None else None

    def _take_baseline(self) -> None:
        assert self.probe is not None  # set up before the CUDA context is asked for
        self.baseline = self.probe.sample()

    def _watch_health(self, worker: Worker, interval_s: float | None) -> None:
        reader = getattr(self.probe, "health_reader", None)
        if interval_s is None or reader is None:
            return
        assert self.probe is not None  # it offered the reader
        try:
            monitor = HealthMonitor(reader())
        except nvml.READ_ERRORS as exc:  # NVML cannot judge this GPU: memory is still guarded
            logger.warning("GPU health checks off on %s: %r", worker.address, exc)
            return
        self.health = HealthWatch(monitor, worker, self.probe.gpu, interval_s)
        self.health.start()

    def _gpu_busy(self) -> bool:
        """Whether the GPU does any work now; True where the probe cannot say."""
        if self._activity is None:
            return True
        percent = self._activity.reader.device_utilization()
        return percent is None or percent > 0

    def _report_stall(self, hung: HungTask) -> None:
        assert self.worker is not None  # stalls are watched from setup on
        self.worker.loop.add_callback(self.worker.log_event, HUNG_TOPIC, hung.to_event())

    def watch_for_stall(self, ticket: int, settings: RunnerSettings, identity: dict[str, Any]) -> None:
        """Watch the task run starting on this thread for a stall (``stall.py``)."""
        if self.stalls is None or settings.stall_s is None or identity["task_run_id"] is None:
            return
        assert self.worker is not None  # stalls are watched from setup on
        hung = HungTask(
            task_run_id=identity["task_run_id"],
            task_run_name=identity["task_run_name"],
            flow_run_id=identity["flow_run_id"],
            key=str(self.worker.get_current_task()),
            worker=self.worker.address,
            worker_name=str(self.worker.name),
            pid=os.getpid(),
            timeout_s=float(settings.stall_s),
            running_s=float(settings.stall_s),
            stalled=True,
            fail=settings.on_stall == "fail",
        )
        self.stalls.watch(ticket, settings.stall_s, hung)

    def follow(self, settings: RunnerSettings) -> None:
        """What is per GPU, not per flow run, follows the strictest flow run using it:
        health checks as often as the shortest ``health_check_s`` asked for (a flow run
        with checks off leaves them to the others)."""
        every = settings.health_check_s
        if every is None or (self.health is not None and every >= self.health.interval_s):
            return  # the common case, one comparison per task
        assert self._follow_lock is not None and self.worker is not None  # an active guard is set up
        with self._follow_lock:
            if self.health is not None:
                self.health.tighten(every)
            elif not self._health_asked:
                self._health_asked = True
                self.worker.loop.add_callback(self._watch_health, self.worker, every)

    async def teardown(self, worker: Worker) -> None:
        if self.health is not None:
            self.health.close()

    # -- around one task ----------------------------------------------------------
    @property
    def activity(self) -> ActivityWatch | None:
        """What reads the GPU's utilisation, power and temperature (None: the probe cannot)."""
        return self._activity

    @property
    def active(self) -> bool:
        return self.probe is not None

    def _measuring(self) -> tuple[MemoryProbe, Callable[[], MemorySample], PeakSampler, threading.Lock]:
        """What an active guard measures with: all set by ``setup`` where it found a GPU."""
        probe, read, sampler, lock = self.probe, self._read_process, self._sampler, self._running_lock
        assert probe is not None and read is not None and sampler is not None and lock is not None
        return probe, read, sampler, lock

    def begin(self) -> tuple[int, MemorySample, float]:
        _, read_process, sampler, running_lock = self._measuring()
        assert self._read_allocators is not None
        ticket = next(self._tickets)
        self._count_rmm()  # RMM loaded by a task since (cuDF), or its resource replaced
        before = read_process()
        if before.process == 0 and _create_cuda_context():
            before = read_process()  # the context is the process's, not the task's
            self.context_bytes = max(before.process, 0)
        before = with_allocators(before, self._read_allocators())
        with running_lock:
            if self._running:
                self._beside.update(self._running)
                self._beside.add(ticket)
            self._running.add(ticket)
        sampler.start(ticket, before.judged)
        if self._activity is not None:
            self._activity.start(ticket)
        return ticket, before, time.perf_counter()

    def end(
        self,
        ticket: int,
        before: MemorySample,
        started: float,
        task: str | None = None,
        oom: OutOfMemory | None = None,
        settings: RunnerSettings | None = None,
        flow_run_id: str | None = None,
        threads: AbstractSet[threading.Thread] = frozenset(),
    ) -> tuple[Verdict, int, float, Activity | None]:
        """Judge the task that began with ``ticket``; ``task`` names it for the
        one-time library growth allowance (per task and worker thread, renewed when the
        process has new threads, or when the task's work ran on a thread it had not
        used before: ``threads``, from ``task_threads``; a library gives each thread
        handles of its own).
        ``settings``: those of the task's flow run (default: the plugin's), whose own
        guarded tasks here count towards its ``restart_after_tasks``.
        Returns the verdict, the peak, the duration and what else it did on the GPU."""
        probe, _, sampler, running_lock = self._measuring()
        assert self._read_allocators is not None
        duration = time.perf_counter() - started
        # Over the same span as the duration: the verdict's own readings are not the task's.
        activity = self._activity.stop(ticket) if self._activity is not None else None
        settings = settings if settings is not None else self.settings
        self.tasks_run += 1
        self._tasks_of[flow_run_id] += 1
        key = (task, threading.current_thread())
        with running_lock:
            self._running.discard(ticket)
            alone = ticket not in self._beside
            self._beside.discard(ticket)
        then = self._grew.get(key)
        used = threads or {key[1]}  # ``task_threads.recording`` starts with the task's own thread
        verdict = verdict_for(
            probe,
            before,
            settings,
            self._tasks_of[flow_run_id] if flow_run_id else self.tasks_run,
            release_allocator_caches,
            allocators=self._read_allocators,
            # Again on this thread, no thread new since and none new to this task's work:
            # no library's first use left.
            grew_before=then is not None and _pool_threads() <= then.alive and used <= then.used,
            oom=oom,
            replacement_bytes=self.context_bytes,  # a replacement makes its own context
            sample=self._read_after,
            alone=alone,
        )
        if verdict.status == LIBRARY:
            self._grew[key] = _Allowance(_pool_threads(), then.used.union(used) if then else frozenset(used))
        peak = sampler.stop(ticket, verdict.after.judged)
        return verdict, peak, duration, activity

    def abandon(self, ticket: int) -> None:
        """Stop watching the peak of a task whose judgement failed."""
        if self._running_lock is not None:
            with self._running_lock:
                self._running.discard(ticket)
                self._beside.discard(ticket)
        if self._sampler is not None:
            self._sampler.stop(ticket, 0)
        if self._activity is not None:
            self._activity.stop(ticket)

    def report(self, record: TaskRecord, restart: str | None = None) -> None:
        """Send ``record`` to the flow, and hand it to this worker's recycling under
        ``restart``, the policy of the record's flow run (default: the plugin's)."""
        assert self.worker is not None and self.recycling is not None  # an active guard is set up
        self.worker.log_event(RECORD_TOPIC, record.to_event())
        quarantined = self.health is not None and self.health.quarantine is not None
        self.recycling.hand(record, quarantined, restart or self.settings.restart)


# Names of the pools a task's chunks run on: the threads scheduler's (dask's default
# names) and ``compute_on_gpus``'s graph pool.
POOL_THREAD_PREFIXES = ("ThreadPoolExecutor-", GRAPH_THREAD_PREFIX)


def _pool_threads() -> frozenset[threading.Thread]:
    """Threads that may make library handles for a task: pools named as the threads
    scheduler's are, and threads that are not daemons. A pool started from a worker
    thread is a daemon like it, so pools are known by name. Other daemon threads are
    left out: services (Prefect's log and event workers, this guard's sampler) start
    them when they please, and Dask's own worker threads are part of the allowance's
    key already."""
    return frozenset(
        t for t in threading.enumerate() if not t.daemon or t.name.startswith(POOL_THREAD_PREFIXES)
    )


def guard_of(dask_worker: Worker | None) -> GPUMemoryGuard | None:
    """``dask_worker``'s guard, where it has one guarding a GPU."""
    guard = dask_worker.plugins.get(PLUGIN_NAME) if dask_worker is not None else None
    return guard if isinstance(guard, GPUMemoryGuard) and guard.active else None


def current_guard() -> GPUMemoryGuard | None:
    """The guard of the worker this code runs in, where it guards a GPU."""
    return guard_of(_compat.current_worker())


async def replacement_state(dask_worker: Worker) -> dict[str, Any]:
    """Who this worker is and its GPU memory: read from a replacement after a restart."""
    guard = guard_of(dask_worker)
    return {
        "pid": os.getpid(),
        "name": str(dask_worker.name),
        "baseline": guard.baseline.judged if guard is not None and guard.baseline is not None else None,
        "now": guard.probe.sample().judged if guard is not None and guard.probe is not None else None,
        "released_at": (
            guard.recycling.memory_released_at if guard is not None and guard.recycling is not None else None
        ),
    }


def _task_identity() -> dict[str, Any]:
    from prefect.context import FlowRunContext, TaskRunContext

    ctx = TaskRunContext.get()
    if ctx is None:
        return dict.fromkeys(("task_run_id", "task_run_name", "task_name", "flow_run_id")) | {"tags": ()}
    run = ctx.task_run
    flow_ctx = FlowRunContext.get()
    return {
        "task_run_id": str(run.id),
        "task_run_name": run.name,
        "task_name": ctx.task.name,
        "flow_run_id": str(run.flow_run_id) if run.flow_run_id else None,
        "tags": tuple(sorted(run.tags or [])),
        "flow_name": flow_ctx.flow.name if flow_ctx is not None and flow_ctx.flow is not None else None,
    }


def build_record(
    guard: GPUMemoryGuard,
    verdict: Verdict,
    peak: int,
    duration: float,
    identity: dict[str, Any],
    activity: Activity | None = None,
) -> TaskRecord:
    """The one place a ``TaskRecord`` is made."""
    probe = guard.probe
    assert probe is not None and guard.worker is not None  # only an active guard makes records
    share = (_compat.current_task_restrictions() or {}).get(GPU_RESOURCE)
    return TaskRecord(
        **identity,
        worker=guard.worker.address,
        worker_name=str(guard.worker.name),
        pid=os.getpid(),
        gpu_index=probe.gpu.index,
        gpu_uuid=probe.gpu.uuid,
        before=verdict.before.judged,
        after=verdict.after.judged,
        peak=peak,
        delta=verdict.delta,
        allocator_delta=verdict.allocator_delta,
        device_used=verdict.after.device_used,
        device_total=verdict.after.device_total,
        verdict=verdict.status,
        restart_reason=verdict.restart_reason,
        duration_s=round(duration, 6),
        time=time.time(),
        oom_requested=verdict.oom.requested if verdict.oom else None,
        oom_library=verdict.oom.library if verdict.oom else None,
        allocator=verdict.after.allocator,
        gpu_share=share,
        gpu_seconds=None if share is None else round(duration * share, 6),
        **(_activity_fields(activity) if activity is not None else {}),
    )


_ROUNDED = {"sm_util_mean": 1, "sm_util_peak": 1, "energy_j": 3}


def _activity_fields(activity: Activity) -> dict[str, Any]:
    values = activity._asdict()
    return {k: v if k not in _ROUNDED or v is None else round(v, _ROUNDED[k]) for k, v in values.items()}


def _log_record(record: TaskRecord) -> None:
    from prefect.logging import get_run_logger

    message = (
        f"GPU memory on {record.gpu_uuid} (#{record.gpu_index}): "
        f"before {format_bytes(record.before)}, after {format_bytes(record.after)}, "
        f"peak {format_bytes(record.peak)}, delta {format_bytes(record.delta)} "
        f"-> {record.verdict}"
    )
    if record.sm_util_mean is not None or record.energy_j is not None:
        util = "n/a" if record.sm_util_mean is None else f"{record.sm_util_mean:.0f}% ({record.util_scope})"
        energy = "n/a" if record.energy_j is None else f"{record.energy_j:.1f} J"
        message += f"; SM busy {util}, energy {energy}"
    run_logger = get_run_logger()
    if record.verdict == OOM:
        asked = "" if record.oom_requested is None else f" asking for {format_bytes(record.oom_requested)}"
        message += f" (CUDA out of memory in {record.oom_library}{asked})"
    if record.verdict == LIBRARY:
        message += (
            " (one-time growth outside every allocator: a library's or CUDA's first use on this"
            " thread; the same task growing again here would be a leak)"
        )
    if record.verdict == LEAK or record.restart_reason:
        run_logger.warning(
            "%s; worker %s will be recycled (%s)", message, record.worker, record.restart_reason
        )
    else:
        run_logger.info(message)


def _clear_frames(exc: BaseException) -> None:
    """Let every traceback along the exception's chain drop its frames' locals."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


@contextlib.contextmanager
def guarding(settings: RunnerSettings | None = None) -> Iterator[None]:
    """Measure the task run inside it with this worker's guard (a no-op without one),
    judged by ``settings``, its flow run's (the plugin's are the first runner's).

    The ``around`` the flow clones guarded tasks with (``taskwrap.with_around``).
    """
    guard = current_guard()
    if guard is None:
        yield
        return
    if settings is not None:
        guard.follow(settings)
    try:
        ticket, before, started = guard.begin()
    except Exception:  # the guard must never change what the task does: it runs unmeasured
        logger.exception(
            "GPU memory guard could not measure a task on %s; it runs unguarded", guard._address()
        )
        yield
        return
    if settings is not None and settings.stall_s is not None:
        guard.watch_for_stall(ticket, settings, _task_identity())
    oom = None
    threads: set[threading.Thread] = set()
    try:
        with task_threads.recording() as threads:
            yield
    except BaseException as exc:
        oom = out_of_memory(exc)
        # The traceback's frames hold the failed task's arrays: judged with them alive,
        # any failed task would look like a leak. The exception itself still propagates.
        _clear_frames(exc)
        raise
    finally:
        if guard.stalls is not None:
            guard.stalls.unwatch(ticket)
        try:
            identity = _task_identity()
            verdict, peak, duration, activity = guard.end(
                ticket,
                before,
                started,
                identity["task_name"],
                oom,
                settings,
                identity["flow_run_id"],
                threads,
            )
            record = build_record(guard, verdict, peak, duration, identity, activity)
            _log_record(record)
            guard.report(record, settings.restart if settings is not None else None)
        except Exception:  # the guard must never change what the task did
            guard.abandon(ticket)
            logger.exception("GPU memory guard failed around a task on %s", guard._address())
