"""The flow's ephemeral Prefect API: shared with its Dask workers, and kept up until it
has recorded the task runs sent to it.

A flow run without ``PREFECT_API_URL`` runs on an ephemeral Prefect server. Without
the URL every worker process would start a Prefect server of its own (seconds each)
just to report task states: the runner points them at the flow's.

Task runs reach that server as events, which its task-run recorder writes behind the
flow, and Prefect stops the server when the flow's process exits (``atexit``): a script
that ends right after a flow run of many task runs would leave most of them unrecorded,
or ``Running`` in the UI for good. So before Prefect stops it, the process waits until
the server has recorded a final state for every task run this package's runners sent
it, for as long as the count keeps rising (``RECORD_STALL_S``), ``RECORD_WAIT_S`` at most.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import OrderedDict
from contextlib import ExitStack

from prefect_gpu_dask._compat import current_worker

RECORD_WAIT_S = 120.0
RECORD_STALL_S = 10.0  # the count stopped rising: what is left will not come
RECORD_POLL_S = 0.2
SAY_AFTER_S = 1.0
KEPT_FLOW_RUNS = 256  # a long-lived process remembers its latest flow runs only
FINAL_STATE_TYPES = ["COMPLETED", "FAILED", "CRASHED", "CANCELLED"]

# Under Prefect's logger: its console handler shows the wait to whoever ran the script.
logger = logging.getLogger("prefect.prefect_gpu_dask")
_sent: OrderedDict[str, int] = OrderedDict()  # flow run id -> task runs sent to the ephemeral API
_lock = threading.Lock()
_api_url: str | None = None


def share_ephemeral_api(exit_stack: ExitStack) -> bool:
    """Set ``PREFECT_API_URL`` to the flow's ephemeral server until ``exit_stack`` closes
    (a no-op where an API is configured, ephemeral servers are off, or on a Dask worker).
    Returns whether it did: the flow run reports to the ephemeral server."""
    global _api_url
    if current_worker() is not None:  # first: the engine enters a runner per task run there
        return False
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        temporary_settings,
    )

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return False
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()  # already running for this flow: returns at once
    with _lock:
        if _api_url != server.api_url:
            # Registered after the server's own ``stop``, so it runs before it.
            atexit.register(wait_until_recorded, server.api_url)
            _api_url = server.api_url
    exit_stack.enter_context(temporary_settings({PREFECT_API_URL: server.api_url}))
    return True


def count_sent(flow_run_id: str | None) -> None:
    """One more task run of ``flow_run_id`` sent to the ephemeral server."""
    if flow_run_id is None:
        return
    with _lock:
        _sent[flow_run_id] = _sent.pop(flow_run_id, 0) + 1
        while len(_sent) > KEPT_FLOW_RUNS:
            _sent.popitem(last=False)


def wait_until_recorded(api_url: str, wait_s: float = RECORD_WAIT_S, stall_s: float = RECORD_STALL_S) -> int:
    """Wait until ``api_url`` holds a final state for each task run sent to it; returns
    how many it still lacks (0: all there)."""
    with _lock:
        sent = dict(_sent)
    if not sent:
        return 0
    import httpx

    expected = sum(sent.values())
    query = {
        "flow_runs": {"id": {"any_": list(sent)}},
        "task_runs": {"state": {"type": {"any_": FINAL_STATE_TYPES}}},
    }
    started = last_rise = time.monotonic()
    recorded, said = -1, False
    with httpx.Client(base_url=api_url, timeout=10.0) as client:
        while True:
            try:
                now_recorded = int(client.post("/task_runs/count", json=query).json())
            except (httpx.HTTPError, ValueError, TypeError):
                return expected - max(recorded, 0)  # the server is gone or cannot say
            now = time.monotonic()
            if now_recorded >= expected:
                return 0
            if now_recorded > recorded:
                recorded, last_rise = now_recorded, now
            if now - last_rise > stall_s or now - started > wait_s:
                logger.warning(
                    "Prefect's temporary server recorded %d of %d task runs before stopping",
                    max(recorded, 0),
                    expected,
                )
                return expected - max(recorded, 0)
            if not said and now - started > SAY_AFTER_S:
                said = True
                logger.info(
                    "Waiting for Prefect's temporary server to record %d more task runs before it stops",
                    expected - recorded,
                )
            time.sleep(RECORD_POLL_S)
