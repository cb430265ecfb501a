"""A ``dask worker --preload``: the worker process writes every thread's stack to its
log on SIGUSR1 (``faulthandler``), for a test whose worker no longer answers
``client.run`` (its event loop is stuck)."""

import faulthandler
import signal
import sys


def dask_setup(worker) -> None:  # noqa: ARG001 - distributed's preload hook
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
