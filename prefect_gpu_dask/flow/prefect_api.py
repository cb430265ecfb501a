"""The flow's ephemeral Prefect API: shared with its Dask workers, and kept up until it
has recorded the task runs they ran.

A flow run without ``PREFECT_API_URL`` runs on an ephemeral Prefect server. Without
the URL every worker process would start a Prefect server of its own (seconds each)
just to report task states: the runner points them at the flow's.

Task runs reach that server as events, which its task-run recorder writes behind the
flow, and Prefect stops the server when the flow's process exits: a script that ends
right after a flow run of many task runs would leave most of them unrecorded, or
``Running`` in the UI for good. So before Prefect stops it, the process waits until the
server holds a final state (or Prefect's ``NotReady``, a run whose upstream failed) for
every task run this package's runners saw end on a worker, for as long as the count
keeps rising (``RECORD_STALL_S``), ``RECORD_WAIT_S`` at most.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import OrderedDict
from contextlib import ExitStack
from typing import Any

import httpx
from prefect.exceptions import PrefectException

from prefect_gpu_dask import _compat

# What a call to the Prefect API (or an event for it) raises: the server unreachable or
# refusing, an object it does not know (``ObjectNotFound``), an answer or event that does
# not validate (pydantic's ``ValidationError`` is a ``ValueError``).
API_ERRORS: tuple[type[Exception], ...] = (httpx.HTTPError, PrefectException, OSError, ValueError)

RECORD_WAIT_S = 120.0
RECORD_STALL_S = 10.0  # the count stopped rising: what is left will not come
RECORD_POLL_S = 0.2
SAY_AFTER_S = 1.0
KEPT_RUNS = 100_000  # a long-lived process remembers its latest task runs only
IDS_PER_QUERY = 500
FINAL_STATE_TYPES = ["COMPLETED", "FAILED", "CRASHED", "CANCELLED"]
ENDED_UNRUN = ["NotReady"]  # Pending for good: its upstream failed

# Under Prefect's logger: its console handler shows the wait to whoever ran the script.
logger = logging.getLogger("prefect.prefect_gpu_dask")
_ran: OrderedDict[str, None] = OrderedDict()  # task run ids that ended on a worker, oldest first
_lock = threading.Lock()
_api_url: str | None = None


def share_ephemeral_api(exit_stack: ExitStack) -> bool:
    """Set ``PREFECT_API_URL`` to the flow's ephemeral server until ``exit_stack`` closes
    (a no-op where an API is configured, ephemeral servers are off, or on a Dask worker).
    Returns whether the flow run reports to this process's ephemeral server (a subflow's
    runner, under its parent's URL, too)."""
    global _api_url
    if _compat.current_worker() is not None:  # first: the engine enters a runner per task run there
        return False
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        temporary_settings,
    )

    configured = PREFECT_API_URL.value()
    if configured:
        return _api_url is not None and configured == _api_url
    if not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return False
    server = _compat.started_ephemeral_api_server()
    if server is None:  # each worker then starts a server of its own, as under prefect-dask
        return False
    with _lock:
        if _api_url != server.api_url:
            atexit.register(wait_until_recorded, server.api_url)  # runs before the server stops
            _api_url = server.api_url
    exit_stack.enter_context(temporary_settings({PREFECT_API_URL: server.api_url}))
    return True


def close_workers_events(client: Any) -> None:
    """As a flow run on this process's temporary server ends on a cluster that outlives
    it: each worker sends the events it holds for that server and closes its events
    worker for it (``worker.entry.end_flow_run_events``). Another flow run's temporary
    server may later take the same port: it gets none of this one's events."""
    from prefect_gpu_dask.flow.results import PACKAGE_ERRORS
    from prefect_gpu_dask.worker.entry import end_flow_run_events

    if _api_url is None:
        return
    try:
        client.run(end_flow_run_events, _api_url)
    except (*PACKAGE_ERRORS, *API_ERRORS) as exc:  # a worker gone, or without this package
        logger.warning("Could not close the workers' events for %s: %r", _api_url, exc)


def ran_on_a_worker(task_run_id: Any) -> None:
    """A task run whose Dask task finished: its engine ran on a worker and sent its states."""
    with _lock:
        _ran[str(task_run_id)] = None
        while len(_ran) > KEPT_RUNS:
            _ran.popitem(last=False)


def count_when_done(future: Any) -> None:
    """Count ``future``'s task run once its Dask task finishes (not if it is cancelled or
    fails before its engine ends: no final state may ever come for it)."""

    def done(dask_future: Any) -> None:
        if dask_future.status == "finished":
            ran_on_a_worker(future.task_run_id)

    future.wrapped_future.add_done_callback(done)


def _recorded(client: Any, ids: list[str]) -> int | None:
    """How many of ``ids`` the server holds as ended (None: it did not answer; Prefect's
    client raises for an answer that is not a success)."""
    import httpx

    total = 0
    for start in range(0, len(ids), IDS_PER_QUERY):
        chunk = {"id": {"any_": ids[start : start + IDS_PER_QUERY]}}
        for state in ({"type": {"any_": FINAL_STATE_TYPES}}, {"name": {"any_": ENDED_UNRUN}}):
            try:
                answer = client.request(
                    "POST", "/task_runs/count", json={"task_runs": {**chunk, "state": state}}
                )
                total += int(answer.json())
            except (httpx.HTTPError, ValueError, TypeError):
                return None
    return total


def wait_until_recorded(api_url: str, wait_s: float = RECORD_WAIT_S, stall_s: float = RECORD_STALL_S) -> int:
    """Wait until ``api_url`` holds every task run that ran, ended; returns how many it
    still lacks (0: all there)."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with _lock:
        ids = list(_ran)
    if not ids:
        return 0
    started = last_rise = time.monotonic()
    recorded, said = 0, False
    try:
        with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
            while True:
                now_recorded = _recorded(client, ids)
                now = time.monotonic()
                if now_recorded is not None:
                    if now_recorded >= len(ids):
                        return 0
                    if now_recorded > recorded:
                        recorded, last_rise = now_recorded, now
                if now - last_rise > stall_s or now - started > wait_s:
                    logger.warning(
                        "Prefect's temporary server recorded %d of %d task runs before stopping",
                        recorded,
                        len(ids),
                    )
                    return len(ids) - recorded
                if not said and now - started > SAY_AFTER_S:
                    said = True
                    logger.info(
                        "Waiting for Prefect's temporary server to record %d more task runs before it stops",
                        len(ids) - recorded,
                    )
                time.sleep(RECORD_POLL_S)
    except httpx.HTTPError:  # the server is gone
        return len(ids) - recorded
    except KeyboardInterrupt:  # the user stops waiting: Prefect stops the server next
        return len(ids) - recorded
