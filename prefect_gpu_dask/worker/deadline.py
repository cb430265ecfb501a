"""A task run's ``timeout_seconds``, kept on the worker even when the task is stuck in C.

Prefect's engine times a task out by raising in its thread, which only lands once the
thread runs Python again: a task blocked in a C call (a hung kernel, a stuck
collective, a dead file system) outlives its timeout for as long as the call lasts. The
flow clones every task that has ``timeout_seconds`` with ``taskwrap.with_around(task,
deadline)``: a watchdog timer per task run that, if the task is still running a moment
after its timeout, sends a ``HungTask`` record to the flow. The flow marks the task run
``TimedOut`` and recycles the worker holding the stuck thread (``flow.recycling``).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from prefect_gpu_dask._compat import current_worker
from prefect_gpu_dask.records import HUNG_TOPIC, HungTask

# Prefect's own timeout gets this long to land before the task counts as stuck.
GRACE_S = 1.0


def _report(worker: Any, hung: HungTask) -> None:
    worker.loop.add_callback(worker.log_event, HUNG_TOPIC, hung.to_event())


@contextlib.contextmanager
def deadline() -> Iterator[None]:
    """Watch the task run inside it against its ``timeout_seconds`` (a no-op without one,
    or outside a Dask worker)."""
    from prefect.context import TaskRunContext

    ctx = TaskRunContext.get()
    seconds = ctx.task.timeout_seconds if ctx is not None else None
    worker = current_worker()
    if ctx is None or not seconds or worker is None:
        yield
        return
    run = ctx.task_run
    hung = HungTask(
        task_run_id=str(run.id),
        task_run_name=run.name,
        flow_run_id=str(run.flow_run_id) if run.flow_run_id else None,
        key=str(worker.get_current_task()),
        worker=worker.address,
        worker_name=str(worker.name),
        pid=os.getpid(),
        timeout_s=float(seconds),
        running_s=float(seconds) + GRACE_S,
    )
    timer = threading.Timer(seconds + GRACE_S, _report, args=(worker, hung))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
