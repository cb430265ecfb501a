"""Which threads ran a guarded task's work: the task's own, and the pool threads its
chunks ran on (``compute_on_gpus``'s graph pool notes them).

CUDA libraries keep handles per thread, so the guard allows a library's first use once
per thread. A task whose chunks run on a long-lived pool may reach a pool thread new to
it on any run, long after the pool's threads were all started, so the guard asks which
threads this run used, not only which threads are new in the process.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

_used: ContextVar[set[threading.Thread] | None] = ContextVar("prefect_gpu_dask_task_threads", default=None)


@contextlib.contextmanager
def recording() -> Iterator[set[threading.Thread]]:
    """Note, for the task run inside it, the threads its work runs on (its own first)."""
    used = {threading.current_thread()}
    token = _used.set(used)
    try:
        yield used
    finally:
        # A run ending in another context than it began (never so in Prefect's engine)
        # leaves the record set there: the guard must not change what the task did.
        with contextlib.suppress(ValueError):
            _used.reset(token)


def noting(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, noting the thread it runs on for the task run that submits it (``fn``
    itself where no task run records)."""
    used = _used.get()
    if used is None:
        return fn

    def run(*args: Any, **kwargs: Any) -> Any:
        used.add(threading.current_thread())
        return fn(*args, **kwargs)

    return run
