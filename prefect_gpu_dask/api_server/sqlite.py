"""On a SQLite database, Prefect's API server begins its write transactions IMMEDIATE
and records task runs as their events come, in batches under load, losing none.

Prefect's API server imports every ``prefect.collections`` entry point as it starts
(to register their blocks); this package's is this module, so every server started
where the package is installed (the embedded one a flow run starts, ``prefect server
start``) loads it. On SQLite it changes two things there; PostgreSQL servers are not
touched.

1. A transaction opened to write begins with SQLite's ``BEGIN IMMEDIATE``, taking the
   write lock first and waiting for it on the server's ``busy_timeout``. Prefect's
   default, ``BEGIN DEFERRED``, fails at once when the transaction read before writing
   and another connection wrote in between; the server answers 503 and the client waits
   2 s or more before asking again. On the embedded server this is what creating a flow
   run meets while the server records the last one's task runs. A database session
   opened on another connection inside such a transaction would now wait for that
   transaction's lock, as it already would inside Prefect's own ``with_for_update``
   ones; the server's paths the tests run open none. Reads do not begin a transaction
   and are not affected: SQLite's write-ahead log lets them run beside a writer.
   ``PREFECT_GPU_DASK_SQLITE_IMMEDIATE=false`` leaves Prefect's default in place.
2. The task-run recorder, which turns the task-run events clients send into the task
   runs and states the UI shows, writes events as they come, up to
   ``RECORDER_BATCH_SIZE`` a transaction (``api_server.recorder``): an event that comes
   while a writer is free is written at once, and what comes during a write goes in the
   next, together. Prefect's default is one event a transaction, a commit each; its
   batches wait for their size or a flush interval (a second at least), so a quiet
   server recorded a flow run's task runs about 0.7 s after it ended. Its queue in the
   server's in-memory message broker, and the event persister's, grow instead of
   dropping events when they fall 10,000 behind. One at a time, a burst of short task
   runs outran the recorder on 2 CPU cores and the dropped events' task runs stayed
   Pending in the UI for good. A user's
   ``PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE`` caps the writes; its
   ``…_FLUSH_INTERVAL`` is the pause before a failed write is tried again.
   ``PREFECT_GPU_DASK_RECORDER_BATCHES=false`` leaves Prefect's recorder as it is.

Prefect's server loads collections while it registers block types at start, which it
does unless ``PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION`` is off (``prefect-gpu-dask
doctor`` says so); it starts the task-run recorder after that.
"""

from __future__ import annotations

import sys

from prefect_gpu_dask import _compat
from prefect_gpu_dask.switches import switched_on

OPT_OUT = "PREFECT_GPU_DASK_SQLITE_IMMEDIATE"
RECORDER_OPT_OUT = "PREFECT_GPU_DASK_RECORDER_BATCHES"
RECORDER_BATCH_SIZE = 100
RECORDER_FLUSH_S = 1.0  # before a failed write is tried again; Prefect reads it as whole seconds


def turned_off(variable: str = OPT_OUT) -> bool:
    return not switched_on(variable)


def in_server() -> bool:
    """A process that runs Prefect's server (a client imports neither the server's
    database layer nor anything of it, and needs nothing)."""
    return "prefect.server.database.configurations" in sys.modules


def on_sqlite() -> bool:
    from prefect.settings import get_current_settings

    url = get_current_settings().server.database.connection_url
    return url is not None and url.get_secret_value().startswith("sqlite")


def wanted() -> bool:
    return not turned_off() and in_server()


if wanted():
    _compat.begin_sqlite_write_transactions_immediate()
if in_server() and not turned_off(RECORDER_OPT_OUT) and on_sqlite():
    from prefect_gpu_dask.api_server import recorder

    _compat.default_task_run_recorder_batches(RECORDER_BATCH_SIZE, RECORDER_FLUSH_S)
    _compat.write_task_run_events_as_they_come(recorder.consumer)
    _compat.keep_every_recorded_event()
