"""The one way this package changes what a Prefect task runs: a clone around its function.

Routing fallbacks, the memory guard, the deadline watchdog, out-of-memory retries on
another GPU and the refusals (a quarantined GPU, a dead worker) each need the task run
to go through Prefect's engine as usual (states, logs, retries, the UI) while something
happens around the user's code. ``with_around`` makes a shallow copy of the task whose
function runs inside a context manager, sync or async alike. ``functools.wraps`` keeps
the original's name and signature, so Prefect binds the same parameters and the UI
shows the user's function; ``__prefect_task_source__`` points Prefect (3.9 and later)
at the user's function for task keys and ``task_input_hash`` cache keys.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, TypeVar

T = TypeVar("T")
Around = Callable[[], AbstractContextManager[Any]]
# Runs one call of a task's (wrapped) function, wherever it chooses: ``place(fn, args, kwargs)``.
Place = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


def around_fn(fn: Callable[..., Any], around: Around, place: Place | None = None) -> Callable[..., Any]:
    """``fn`` run inside ``with around():``; an exception raised on entering skips it.

    ``place`` runs each call of that (sync) function: where it runs is its choice, and
    ``around`` runs there with it. Async functions run every call in place: a call
    moved elsewhere blocks its thread while it waits, which an event loop must not.
    """
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            with around():
                return await fn(*args, **kwargs)

        wrapper: Callable[..., Any] = run_async
    else:

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with around():
                return fn(*args, **kwargs)

        wrapper = run
        if place is not None:

            @functools.wraps(fn)
            def placed(*args: Any, **kwargs: Any) -> Any:
                return place(run, args, kwargs)

            wrapper = placed
    wrapper.__prefect_task_source__ = getattr(fn, "__prefect_task_source__", fn)  # type: ignore[attr-defined]
    return wrapper


def stacked(*arounds: Around) -> Around:
    """One ``around`` that enters each of ``arounds`` in order (the first outermost)."""
    if not arounds:
        return contextlib.nullcontext
    if len(arounds) == 1:
        return arounds[0]

    @contextlib.contextmanager
    def enter_all() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for around in arounds:
                stack.enter_context(around())
            yield

    return enter_all


def raising(error: BaseException) -> Around:
    """An ``around`` that raises ``error`` instead of running the task's function."""

    @contextlib.contextmanager
    def refuse() -> Iterator[None]:
        raise error
        yield  # never reached: the task's function does not run

    return refuse


def with_around(task: T, around: Around, place: Place | None = None, **attributes: Any) -> T:
    """A shallow copy of a Prefect ``task`` whose function runs inside ``around()``.

    ``place`` chooses where each call of that function runs (the out-of-memory
    retries' placement). ``attributes`` override task attributes on the copy (e.g.
    ``retries=0``).
    """
    clone = copy.copy(task)
    clone.fn = around_fn(task.fn, around, place)  # type: ignore[attr-defined]
    for name, value in attributes.items():
        setattr(clone, name, value)
    return clone


def refused(task: T, error: BaseException) -> T:
    """A copy of ``task`` whose run fails with ``error`` without running its function,
    and is not retried."""
    return with_around(task, raising(error), retries=0)
