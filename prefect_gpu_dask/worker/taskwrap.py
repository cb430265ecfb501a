"""The one way this package changes what a Prefect task runs: a clone around its function.

Routing fallbacks, the memory guard and the lost-worker refusal each need the task run
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


def around_fn(fn: Callable[..., Any], around: Around) -> Callable[..., Any]:
    """``fn`` run inside ``with around():``; an exception raised on entering skips it."""
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


def with_around(
    task: T,
    around: Around,
    placed: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
    **attributes: Any,
) -> T:
    """A shallow copy of a Prefect ``task`` whose function runs inside ``around()``.

    ``placed`` wraps that function once more to choose where each call runs (the
    out-of-memory retries' placement). ``attributes`` override task attributes on the
    copy (e.g. ``retries=0``).
    """
    clone = copy.copy(task)
    fn = around_fn(task.fn, around)
    clone.fn = placed(fn) if placed is not None else fn  # type: ignore[attr-defined]
    for name, value in attributes.items():
        setattr(clone, name, value)
    return clone
