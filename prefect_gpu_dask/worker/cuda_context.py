"""A CUDA worker's context, made beside the worker's start instead of before it.

dask-cuda's ``dask_cuda.initialize`` preload makes the worker's CUDA context in the
worker's event loop, between its listening and its registration, so the whole cluster
start waits for CUDA's own start (the driver's ``cuInit`` and the primary context). A
worker forked from this package's server makes it in a thread of its own instead
(``_compat.make_cuda_contexts_with``): the worker registers, the runner's
plugins load and the first task arrives while the driver works, and the guard's first
reading waits for the context (``wait``), so no task is blamed for it. The driver
serialises the making of one primary context, so a task's own CUDA call made meanwhile
waits for the same context rather than making a second one. The thread then lives as
long as the process, as the event loop's thread did: a CUDA library may tie its
reference to the primary context to the thread that took it (cuda-core's newer releases
keep it per thread), and a thread that ended would let the context go.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_made = threading.Event()
_made.set()  # nothing in the making
_then: list[Callable[[], None]] = []
_seconds: float | None = None  # how long the last one took, where this module made it
WAIT_STEP_S = 0.2
# What a task waits for a context in the making at most; a driver that never returns
# is then the task's to meet (a hung CUDA call), where Prefect's timeout and the
# package's stall watch see it.
MOST_WAIT_S = 60.0


def make_beside(create: Callable[[], None]) -> None:
    """Run ``create`` (which makes this process's CUDA context) in a thread of its own;
    ``wait`` returns once it has returned or raised, and the callbacks given to ``then``
    meanwhile have run."""
    with _lock:
        _made.clear()
    threading.Thread(target=_make, args=(create,), name="cuda-context", daemon=True).start()


def _make(create: Callable[[], None]) -> None:
    global _seconds
    started = time.perf_counter()
    try:
        create()
    except Exception:  # as dask-cuda's own step, log and carry on: a task meets the error
        logger.exception("Could not make this worker's CUDA context")
    finally:
        _seconds = time.perf_counter() - started
        while True:  # what ``wait`` returns after includes the callbacks
            with _lock:
                callbacks, _then[:] = list(_then), []
                if not callbacks:
                    _made.set()
                    break
            for callback in callbacks:
                _run(callback)
    threading.Event().wait()  # holds the thread's reference to the context


def wait(timeout: float | None = None) -> bool:
    """Wait until no context is in the making; False if ``timeout`` passed first.

    In short waits: an exception raised into the waiting thread, as Prefect's timeout of
    a task run in a worker thread is, ends the wait even where the driver never returns.
    """
    if _made.is_set():  # every guarded task asks: no lock, no clock
        return True
    deadline = None if timeout is None else time.monotonic() + timeout
    while not _made.wait(WAIT_STEP_S if deadline is None else min(WAIT_STEP_S, deadline - time.monotonic())):
        if deadline is not None and time.monotonic() >= deadline:
            return False
    return True


def then(callback: Callable[[], None]) -> None:
    """Call ``callback`` once no context is in the making: now where none is, else in
    the thread that makes it, right after."""
    with _lock:
        if not _made.is_set():
            _then.append(callback)
            return
    _run(callback)


def made_in_s() -> float | None:
    """Seconds the context took in its own thread; None where none was made there."""
    return _seconds


def _run(callback: Callable[[], None]) -> None:
    try:
        callback()
    except Exception:
        logger.exception("A callback after the CUDA context was made failed")
