"""On a SQLite database, Prefect's API server begins its write transactions IMMEDIATE.

Prefect's API server imports every ``prefect.collections`` entry point as it starts
(to register their blocks); this package's is this module, so every server started
where the package is installed (the embedded one a flow run starts, ``prefect server
start``) loads it. It changes one thing there: a transaction opened to write begins
with SQLite's ``BEGIN IMMEDIATE``, taking the write lock first and waiting for it on
the server's ``busy_timeout``. Prefect's default, ``BEGIN DEFERRED``, fails at once
when the transaction read before writing and another connection wrote in between; the
server answers 503 and the client waits 2 s or more before asking again. On the
embedded server this is what creating a flow run meets while the server records the
last one's task runs. PostgreSQL servers are not touched.

Prefect's server loads collections while it registers block types at start, which it
does unless ``PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION`` is off (``prefect-gpu-dask
doctor`` says so). A database session opened on another connection inside such a transaction
would now wait for that transaction's lock, as it already would inside Prefect's own
``with_for_update`` ones; the server's paths the tests run open none.

Reads do not begin a transaction and are not affected: SQLite's write-ahead log lets
them run beside a writer. ``PREFECT_GPU_DASK_SQLITE_IMMEDIATE=false`` leaves Prefect's
default in place.
"""

from __future__ import annotations

import os
import sys

from prefect_gpu_dask import _compat

OPT_OUT = "PREFECT_GPU_DASK_SQLITE_IMMEDIATE"


def turned_off() -> bool:
    return os.environ.get(OPT_OUT, "true").strip().lower() in ("0", "false", "no", "off")


def wanted() -> bool:
    """Not turned off, and in a process that runs Prefect's server (a client imports
    neither the server's database layer nor anything of it, and needs nothing)."""
    return not turned_off() and "prefect.server.database.configurations" in sys.modules


if wanted():
    _compat.begin_sqlite_write_transactions_immediate()
