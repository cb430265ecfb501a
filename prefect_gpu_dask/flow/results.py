"""Fetching task runs' final states into the flow, reading ahead.

prefect-dask fetches a task run's Prefect state when its ``result()`` or ``wait()`` is
called: one gather per task run, through the scheduler to the worker that holds it,
each answered on that worker's event loop. On a host with one GPU that one worker
runs every task run's Prefect engine too, and its event loop waits for the GIL behind
them (docs/performance.md).

A flow reads results in the order it submitted them, mostly (``[f.result() for f in
futures]``, ``futures.result()``, ``wait(futures)``). So a fetch here also takes the
futures submitted right after it that have finished, in the same gather, where their
states are small: a task returning a large array leaves it where it is until the flow
asks for it. A future whose state came this way answers ``result()`` without Dask.

A state read ahead keeps its Dask key: a task that depends on it gets the value from
the worker (a restart's moved results are the exception, ``moved``). States arrive
unpickled, each with its own copy of every field name; ``compact`` shares them, as
states made in this process do.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

import distributed
from dask.utils import parse_bytes
from prefect.client.schemas.objects import State
from pydantic import BaseModel

from prefect_gpu_dask import _compat
from prefect_gpu_dask.scheduler.recycling import result_sizes

if TYPE_CHECKING:
    from prefect_dask.task_runners import PrefectDaskFuture

logger = logging.getLogger(__name__)

# How many futures submitted after the one asked for are looked at, and the largest
# state (Dask's ``sizeof`` on the worker) taken without being asked for.
READ_AHEAD = 64
READ_AHEAD_MAX_BYTES = parse_bytes("64 KiB")


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
# ... and where it reads a key: one Dask released or lost meanwhile.
READ_ERRORS: tuple[type[Exception], ...] = (*SCHEDULER_ERRORS, KeyError)
# ... and where it runs this package's code there: an older one, or none.
PACKAGE_ERRORS: tuple[type[Exception], ...] = (*SCHEDULER_ERRORS, ImportError, AttributeError)


# Held while a future's final state is set: one a restart moved into the flow
# (``recycling.move_into_flow``) is never replaced by one read ahead.
final_states_lock = threading.Lock()

# Futures whose final state is in the flow and whose Dask key was released: by a restart
# (``recycling.move_into_flow``), or read ahead while small (``ReadAhead``).
moved: weakref.WeakSet[PrefectDaskFuture[Any]] = weakref.WeakSet()


def is_moved(future: PrefectDaskFuture[Any]) -> bool:
    """Whether a future's final state is in the flow and its Dask key released."""
    return future in moved


def compact(value: Any, depth: int = 0) -> Any:
    """``value`` (an unpickled Prefect state, say) with the field names of each pydantic
    model in it shared (interned) instead of one copy per object, as a model validated
    in this process has them; its values are left as they are."""
    if isinstance(value, BaseModel) and depth < 8:
        try:
            fields = {sys.intern(k): compact(v, depth + 1) for k, v in value.__dict__.items()}
            object.__setattr__(value, "__dict__", fields)
            fields_set = {sys.intern(k) for k in value.__pydantic_fields_set__}
            object.__setattr__(value, "__pydantic_fields_set__", fields_set)
        except (AttributeError, TypeError):  # a model that keeps its fields otherwise
            pass
    return value


def settle(future: PrefectDaskFuture[Any], state: State[Any]) -> None:
    """``future``'s final state is ``state``, unless it has one already."""
    with final_states_lock:
        if _compat.future_final_state(future) is None:
            _compat.set_future_final_state(future, state)


class ReadAhead:
    """One flow run's futures in submission order, and the fetch that reads ahead."""

    def __init__(
        self, client: distributed.Client, window: int | None = None, max_bytes: int = READ_AHEAD_MAX_BYTES
    ):
        window = READ_AHEAD if window is None else window
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window!r}")
        self.client = client
        self.window = window
        self.max_bytes = max_bytes
        self._lock = threading.RLock()  # a future's death may forget it while this thread holds it
        self._next = 0
        self._position: dict[str, int] = {}
        self._by_position: dict[int, weakref.ref[PrefectDaskFuture[Any]]] = {}

    def track(self, key: str, future: PrefectDaskFuture[Any]) -> None:
        """``future`` (for Dask's ``key``) was submitted now."""
        with self._lock:
            position = self._next
            self._next += 1
            self._position[key] = position
            self._by_position[position] = weakref.ref(future, functools.partial(self._forgotten, key))

    def fetch(self, future: PrefectDaskFuture[Any], timeout: float | None = None) -> bool:
        """Wait for ``future`` and give it its final state, with the finished, small ones
        submitted after it. False where it did not finish well within ``timeout`` (an
        error, a cancellation, still running): the caller's own path says why."""
        wrapped = future.wrapped_future
        if not wrapped.done():
            # Not ``distributed.wait``: it needs the client current, and ``as_current`` sets
            # Dask's scheduler for the whole process, in-process workers' tasks included.
            try:
                next(iter(distributed.as_completed([wrapped], loop=self.client.loop, timeout=timeout)))
            except TimeoutError:
                return False
        if wrapped.status != "finished":
            return False
        key = str(wrapped.key)  # the runner's keys are strings (``submission``)
        wanted = {key: future, **self._small(key, self._finished_after(key))}
        try:
            states = self.client.gather({key: f.wrapped_future for key, f in wanted.items()}, errors="skip")
        except Exception:
            if len(wanted) == 1:
                raise
            # Something about the others: the caller's own path fetches this one alone.
            logger.debug("Reading ahead of %s failed", wrapped.key, exc_info=True)
            return False
        done = []
        with final_states_lock:
            for key, state in states.items():
                if isinstance(state, State) and _compat.future_final_state(wanted[key]) is None:
                    _compat.set_future_final_state(wanted[key], compact(state))
                    done.append(key)
        for key in done:
            self._forget(key)
        return _compat.future_final_state(future) is not None

    def _finished_after(self, key: str) -> dict[str, PrefectDaskFuture[Any]]:
        with self._lock:
            start = self._position.get(key)
            after = range(start + 1, start + 1 + self.window) if start is not None else range(0)
            refs = [ref for position in after if (ref := self._by_position.get(position)) is not None]
        futures = [f for ref in refs if (f := ref()) is not None and _compat.future_final_state(f) is None]
        return {str(f.wrapped_future.key): f for f in futures if f.wrapped_future.status == "finished"}

    def _small(
        self, beside: str, futures: dict[str, PrefectDaskFuture[Any]]
    ) -> dict[str, PrefectDaskFuture[Any]]:
        """Those of ``futures`` whose workers said they hold small, plain data, on a
        worker that holds ``beside`` too: a worker lost takes the one asked for with
        them, so none is waited for longer. Dask's own ``nbytes`` cannot say: it sizes
        a Prefect state without what it holds."""
        if not futures:
            return {}
        try:
            sizes = self.client.run_on_scheduler(result_sizes, list(futures), beside)
        except ImportError as exc:  # a scheduler without this package: read nothing ahead
            logger.warning("Task run states are fetched one by one: the scheduler cannot size them (%r)", exc)
            self.window = 0
            return {}
        except READ_ERRORS:  # a connection dropped, say: this time, nothing ahead
            logger.debug("Could not size results ahead of %s", beside, exc_info=True)
            return {}
        return {key: f for key, f in futures.items() if sizes.get(key, self.max_bytes + 1) <= self.max_bytes}

    def _forgotten(self, key: str, _: weakref.ref[PrefectDaskFuture[Any]]) -> None:
        """A tracked future died: ``key``'s place is no longer looked at."""
        self._forget(key)

    def _forget(self, key: str) -> None:
        with self._lock:
            position = self._position.pop(key, None)
            if position is not None:
                self._by_position.pop(position, None)
