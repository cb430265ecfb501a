"""The scheduler's part of a routing fallback: tasks past their wait for a worker.

Run through ``client.run_on_scheduler`` by ``flow.resource_wait.ResourceWait``:
``release`` lets tasks nobody can serve run without their resource restrictions,
``stranded`` says which tasks no worker can start, ``fail`` fails them with
``MissingResourceError``.
"""

from __future__ import annotations

import time
from typing import Any

from prefect_gpu_dask.errors import MissingResourceError
from prefect_gpu_dask.records import INTERRUPTED, STARTED_THERE


def release(dask_scheduler: Any, keys: list[str]) -> list[str]:
    """Drop the resource restrictions of ``keys`` not started yet; return those released."""
    from prefect_gpu_dask._compat import drop_resource_restrictions

    return drop_resource_restrictions(dask_scheduler, keys, f"gpu-wait-over-{time.time()}")


def stranded(dask_scheduler: Any, keys: list[str]) -> dict[str, Any]:
    """Which of ``keys`` no worker can start: waiting for resources nobody offers, or
    for any worker at all; and whether any worker is running. ``interrupted``: those a
    dead worker had (``InterruptedTasks``' marks): its address, and whether it said it
    had started the task run."""
    running = bool(dask_scheduler.running)
    tasks, interrupted = {}, {}
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        if ts is not None and (ts.state == "no-worker" or (ts.state == "queued" and not running)):
            tasks[key] = dict(ts.resource_restrictions or {})
            marks = ts.annotations or {}
            if marks.get(INTERRUPTED):
                interrupted[key] = (str(marks[INTERRUPTED]), bool(marks.get(STARTED_THERE)))
    return {"tasks": tasks, "workers": running, "interrupted": interrupted}


def fail(dask_scheduler: Any, keys: list[str], message: str) -> list[str]:
    """Fail ``keys`` still waiting for a worker with ``MissingResourceError(message)``;
    what depends on them fails with them, as after Dask's own no-workers timeout."""
    from distributed.protocol import pickle

    stimulus_id = f"prefect-gpu-dask-stranded-{time.time()}"
    failed, recommendations = [], {}
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        if ts is None or ts.state not in ("no-worker", "queued"):
            continue
        error = pickle.dumps(MissingResourceError(message))
        recommendations.update(
            dask_scheduler.transition(key, "erred", exception=error, cause=key, stimulus_id=stimulus_id)
        )
        failed.append(key)
    dask_scheduler.transitions(recommendations, stimulus_id)
    return failed
