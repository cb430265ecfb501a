"""The restart path on a worker: drain, resume, wait for a dead process's GPU memory,
and refuse a task run whose previous worker died running it.

``drain``/``resume``/``replacement_state`` run on the worker's event loop through
``client.run``; ``wait_for_released_memory`` runs in the guard's ``setup`` of a
replacement worker; ``announce_start`` and ``refusal`` run in the worker thread of a
task run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

from distributed.core import Status

from prefect_gpu_dask.errors import WorkerDiedError
from prefect_gpu_dask.records import INTERRUPTED, STARTED_THERE, STARTED_TOPIC

logger = logging.getLogger("prefect_gpu_dask.recycling")

# A drained worker whose flow never restarts it (the flow ended, restart="never"
# elsewhere) takes tasks again after this long.
DRAIN_EXPIRY_S = 120.0
RELEASE_WAIT_S = 15.0
# Worker-side states of tasks assigned to this worker that have not started running.
NOT_STARTED = {"waiting", "ready", "constrained"}

_drains: weakref.WeakKeyDictionary[Any, object] = weakref.WeakKeyDictionary()


def drain(dask_worker: Any, expiry_s: float = DRAIN_EXPIRY_S) -> dict[str, Any]:
    """Stop a worker from starting tasks; say what it still runs and what never started.

    The worker reports ``closing_gracefully``, as in ``retire_workers``: the scheduler
    sends it nothing new, tasks already queued there wait, running ones finish, and it
    still serves its results. Unlike ``paused``, the memory monitor never undoes it.
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


async def wait_for_released_memory(pids: Callable[[], list[int]], timeout_s: float = RELEASE_WAIT_S) -> float:
    """Hold a new worker's tasks off until dead processes' GPU memory is gone.

    The driver frees a killed process's memory asynchronously; a new worker that
    allocates before then can OOM (dask-cuda #859, #1075). Returns the seconds waited.
    """
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if all(os.path.exists(f"/proc/{pid}") for pid in pids()):
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    logger.warning("GPU memory of a previous worker was not released in %.0f s", timeout_s)
    return time.monotonic() - started


def replacement_state(guard_name: str, dask_worker: Any = None) -> dict[str, Any]:
    """Who this worker is and its GPU memory now: read from a replacement after a restart."""
    guard = dask_worker.plugins.get(guard_name)
    probe = getattr(guard, "probe", None)
    baseline = getattr(guard, "baseline", None)
    return {
        "pid": os.getpid(),
        "name": str(dask_worker.name),
        "baseline": baseline.judged if baseline is not None else None,
        "now": probe.sample().judged if probe is not None else None,
        "released_at": getattr(guard, "memory_released_at", None),
    }


def announce_start() -> tuple[str | None, bool]:
    """In a task, before its Prefect engine starts: tell the scheduler this task run is
    starting on this worker (``InterruptedTasks`` remembers it until the task leaves the
    worker). Returns the worker that died running this task before, if any, and whether
    that worker had started it (rather than only queued it)."""
    try:
        import distributed

        worker = distributed.get_worker()
        key = worker.get_current_task()
        ts = worker.state.tasks.get(key)
    except (ValueError, AttributeError, KeyError):
        return None, False
    if isinstance(key, str):
        worker.log_event(STARTED_TOPIC, {"key": key})
    marks = (ts.annotations or {}) if ts is not None else {}
    return marks.get(INTERRUPTED), bool(marks.get(STARTED_THERE))


def refusal(worker: str) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """An ``around`` for ``taskwrap.with_around`` that fails the task run, naming the dead worker."""
    from prefect_gpu_dask.worker.taskwrap import raising

    return raising(
        WorkerDiedError(
            f"Dask worker {worker} died while running this task run; it was not run a second "
            "time (that could repeat its side effects). Submit it again to re-run it."
        )
    )
