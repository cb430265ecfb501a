"""Task runs' final states in the flow: the errors a call to the cluster raises, and
the lock and set that keep a state a restart moved into the flow (``flow.recycling``).

Results are fetched as prefect-dask fetches them: ``PrefectDaskFuture.result`` and
``wait``, one gather per task run.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import TYPE_CHECKING, Any

import distributed
from prefect.client.schemas.objects import State

from prefect_gpu_dask import _compat

if TYPE_CHECKING:
    from prefect_dask.task_runners import PrefectDaskFuture

# What a call to the scheduler (or through it, to a worker) raises where the connection
# dropped, the cluster is closing or the answer came too late; ``asyncio.TimeoutError``
# is ``TimeoutError`` from Python 3.11 on.
SCHEDULER_ERRORS: tuple[type[Exception], ...] = (
    OSError,  # distributed's CommClosedError too
    TimeoutError,
    asyncio.TimeoutError,
    distributed.CancelledError,
    RuntimeError,  # a client whose event loop closed
)
# ... and where it runs this package's code there: an older one, or none.
PACKAGE_ERRORS: tuple[type[Exception], ...] = (*SCHEDULER_ERRORS, ImportError, AttributeError)


# Held while a future's final state is set: one a restart moved into the flow
# (``recycling.move_into_flow``) is never replaced by another.
final_states_lock = threading.Lock()

# Futures whose final state is in the flow and whose Dask key was released by a restart
# (``recycling.move_into_flow``).
moved: weakref.WeakSet[PrefectDaskFuture[Any]] = weakref.WeakSet()


def is_moved(future: PrefectDaskFuture[Any]) -> bool:
    """Whether a future's final state is in the flow and its Dask key released."""
    return future in moved


def settle(future: PrefectDaskFuture[Any], state: State[Any]) -> None:
    """``future``'s final state is ``state``, unless it has one already."""
    with final_states_lock:
        if _compat.future_final_state(future) is None:
            _compat.set_future_final_state(future, state)
