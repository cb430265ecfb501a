"""The flow's ephemeral Prefect API, shared with its Dask workers.

A flow run without ``PREFECT_API_URL`` runs on an ephemeral Prefect server. Without
the URL every worker process would start a Prefect server of its own (seconds each)
just to report task states: the runner points them at the flow's.
"""

from __future__ import annotations

from contextlib import ExitStack

from prefect_gpu_dask._compat import current_worker


def share_ephemeral_api(exit_stack: ExitStack) -> None:
    """Set ``PREFECT_API_URL`` to the flow's ephemeral server until ``exit_stack`` closes
    (a no-op where an API is configured, ephemeral servers are off, or on a Dask worker)."""
    if current_worker() is not None:  # first: the engine enters a runner per task run there
        return
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        temporary_settings,
    )

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()  # already running for this flow: returns at once
    exit_stack.enter_context(temporary_settings({PREFECT_API_URL: server.api_url}))
