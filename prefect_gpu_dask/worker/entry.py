"""The Dask task of every Prefect task run: what the scheduler sees of it.

The scheduler unpickles every task it is sent. This module imports nothing of
Prefect's, and the task's Prefect objects travel sealed as bytes (``payload``), so a
scheduler never imports Prefect (nor needs it installed); a worker loads Prefect with
its first task run.
"""

from __future__ import annotations

from typing import Any

import cloudpickle

from prefect_gpu_dask.payload import Shared


def run_prefect_task(*, task: Shared, sealed: bytes, **run_kwargs: Any) -> Any:
    """Run one Prefect task run on this worker; returns the run's final ``State``."""
    from prefect_gpu_dask.worker.taskrun import run_task_run  # Prefect loads here, on the worker

    return run_task_run(task=task, **cloudpickle.loads(sealed), **run_kwargs)


async def prepare_for_flow_run(settings: Shared, dask_worker: Any = None) -> None:
    """Build a flow run's settings and API client on this worker, in a thread of its own,
    before its first task run arrives (``client.run`` starts this on the worker's event
    loop, which must not wait for it, and passes ``dask_worker``). The thread sees its
    worker as a task run's thread does."""
    import threading

    setup = threading.Thread(target=_prepare, args=(dask_worker, settings), name="prefect-flow-run-setup")
    setup.daemon = True
    setup.start()


async def end_flow_run_events(api_url: str) -> None:
    """As a flow run ends whose temporary Prefect server stops with its process (``client.run``
    on a cluster that outlives the flow run): this worker's events worker for that server
    sends what it holds, then stops, within ``DRAIN_EVENTS_S``. Prefect's events client
    sends again, whenever it reconnects, every event the server has not checkpointed: left
    running, it would send them to the next server at that URL (another flow run's, on the
    same port), whose database knows none of their flow runs."""
    import asyncio

    from prefect_gpu_dask.worker.taskrun import DRAIN_EVENTS_S, drain_events

    await asyncio.wait_for(asyncio.to_thread(drain_events, api_url), DRAIN_EVENTS_S)


def _prepare(dask_worker: Any, settings: Shared) -> None:
    """In the set-up thread: Prefect is imported here, not on the worker's event loop,
    which a first import would hold for seconds while tasks arrive."""
    from prefect_gpu_dask import _compat
    from prefect_gpu_dask.worker.taskrun import prepare_flow_run

    _compat.as_on_worker(dask_worker, prepare_flow_run, settings)
