"""Retries for CUDA out-of-memory errors: how many, and where each one runs.

Prefect's engine runs a task run's retries in the same process, so an out-of-memory
retry would go back to the GPU that just ran out. Here the retry stays the task run's
own (``AwaitingRetry``/``Retrying`` -> ``Running`` in the UI, one run count) while
its function runs on the GPU worker with the most free memory that offers what the
task asked for: in place when that is its own worker, else on that worker, under that
worker's guard. A worker whose memory did not come back after the failure is being
drained for a restart, so it is never chosen while another worker can serve; where
it is the only one, the retry runs in place and the restart follows the task run.

The flow clones a ``gpu`` task with ``oom_retry_condition`` (Prefect's engine asks it on
the worker, after each failed attempt) and ``placing``, which runs in the task run's
worker thread and, for a moved attempt, in the chosen worker's (``_attempt``);
``free_gpu_bytes`` runs on each candidate's event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any
from uuid import uuid4

from prefect_gpu_dask._compat import current_worker
from prefect_gpu_dask.resources import scheduler_identity
from prefect_gpu_dask.worker.guard import guard_of
from prefect_gpu_dask.worker.taskwrap import Place
from prefect_gpu_dask.worker.verdict import out_of_memory

logger = logging.getLogger(__name__)


def oom_retry_condition(
    oom_retries: int, retries: int, condition: Callable[..., Any] | None
) -> Callable[[Any, Any, Any], bool]:
    """A ``retry_condition_fn`` for a task cloned with ``retries + oom_retries`` retries:
    out-of-memory failures use up to ``oom_retries`` of them, other failures up to
    ``retries``, and only where the task's own ``condition`` (if any) agrees."""
    used: dict[Any, list[int]] = {}

    def retry(task: Any, task_run: Any, state: Any) -> bool:
        counts = used.setdefault(task_run.id, [0, 0])
        if out_of_memory(state.data if isinstance(state.data, BaseException) else None):
            counts[0] += 1
            again = counts[0] <= oom_retries
        else:
            counts[1] += 1
            again = counts[1] <= retries and (condition is None or _holds(condition, task, task_run, state))
        if not again:
            used.pop(task_run.id, None)  # its last attempt
        return again

    return retry


def _holds(condition: Callable[..., Any], *args: Any) -> bool:
    if inspect.iscoroutinefunction(condition):
        from prefect.utilities.asyncutils import run_coro_as_sync

        return bool(run_coro_as_sync(condition(*args)))
    return bool(condition(*args))


def placing(resources: Mapping[str, float]) -> Place:
    """A ``place`` for ``taskwrap.with_around``: an attempt after an out-of-memory
    failure runs on the GPU worker with the most free memory offering ``resources``."""
    asked = dict(resources)
    ran_out: set[Any] = set()  # task runs whose last attempt here ran out of memory

    def place(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        run_id = _task_run_id()
        target = None
        if run_id in ran_out:
            ran_out.discard(run_id)
            target = roomiest_elsewhere(asked)
        try:
            if target is None:
                return fn(*args, **kwargs)
            return _run_on(target, fn, args, kwargs, asked)
        except Exception as exc:
            if run_id is not None and out_of_memory(exc) is not None:
                ran_out.add(run_id)
            raise

    return place


def _task_run_id() -> Any:
    from prefect.context import TaskRunContext

    ctx = TaskRunContext.get()
    return None if ctx is None else ctx.task_run.id


def free_gpu_bytes(dask_worker: Any) -> int | None:
    """Free bytes on this worker's GPU, as its guard's probe reads them (None: no GPU)."""
    guard = guard_of(dask_worker)
    if guard is None or guard.probe is None:
        return None
    sample = guard.probe.sample()
    return sample.device_total - sample.device_used


def choose(here: str, here_serving: bool, free: Mapping[str, int | None]) -> str | None:
    """The worker an out-of-memory retry should run on, or None for in place.

    ``free``: free GPU bytes of each candidate worker (this one included while it is
    ``here_serving``). Ties go to this worker: moving costs a round trip.
    """
    known = {address: nbytes for address, nbytes in free.items() if nbytes is not None}
    if here_serving and here in known:
        best = max(known, key=lambda address: (known[address], address == here))
        return None if best == here else best
    others = {address: nbytes for address, nbytes in known.items() if address != here}
    return max(others, key=others.__getitem__) if others else None


def roomiest_elsewhere(resources: Mapping[str, float]) -> str | None:
    """Where this worker's out-of-memory retry should run (None: here)."""
    from distributed import get_client
    from distributed.core import Status

    worker = current_worker()
    here = worker.address
    here_serving = worker.status == Status.running  # not drained for a restart
    client = get_client()
    try:
        workers = scheduler_identity(client)["workers"]
        candidates = [
            address
            for address, info in workers.items()
            if (address == here and here_serving)
            or (
                address != here
                and info.get("status") == Status.running.name
                and all(info["resources"].get(name, 0) >= amount for name, amount in resources.items())
            )
        ]
        if not candidates or candidates == [here]:
            return None
        free = client.run(free_gpu_bytes, workers=candidates, on_error="return")
    except (OSError, asyncio.TimeoutError, KeyError) as exc:  # the retry still runs, in place
        logger.warning("Could not compare free GPU memory for an out-of-memory retry: %r", exc)
        return None
    target = choose(here, here_serving, {a: v if isinstance(v, int) else None for a, v in free.items()})
    if target is not None:
        logger.info("Out-of-memory retry moves from %s to %s (%s free GPU bytes)", here, target, free[target])
    return target


def _run_on(
    target: str, fn: Callable[..., Any], args: Any, kwargs: Any, resources: Mapping[str, float]
) -> Any:
    """Run one attempt of the current task run on ``target`` and wait for it."""
    from distributed import worker_client
    from prefect.context import serialize_context

    context = serialize_context()
    with worker_client() as client:  # secedes: this thread waits without a pool slot
        future = client.submit(
            _attempt,
            fn,
            args,
            kwargs,
            context,
            key=f"{getattr(fn, '__name__', 'task')}-oom-retry-{uuid4().hex}",
            workers=[target],
            allow_other_workers=False,
            resources=dict(resources) or None,
            pure=False,
        )
        return future.result()


def _attempt(fn: Callable[..., Any], args: Any, kwargs: Any, context: dict[str, Any]) -> Any:
    """On the chosen worker: the attempt, inside the task run's own Prefect context
    (its logs and the guard's record name the task run)."""
    from prefect.context import hydrated_context

    from prefect_gpu_dask.worker.taskrun import prepare_process_once

    prepare_process_once()
    with hydrated_context(context):
        return fn(*args, **kwargs)
