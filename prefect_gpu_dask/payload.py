"""What the Dask scheduler sees of a Prefect task run: a function of this module and
opaque blobs.

The scheduler unpickles every task it is sent. This module imports nothing of
Prefect's, and the task's Prefect objects travel sealed as bytes, so a scheduler never
imports Prefect (nor needs it installed); a worker loads Prefect with its first task
run. Only what Dask must see stays open: the parameters (they may hold futures) and
the futures to wait for.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

import cloudpickle


class Shared:
    """An object pickled once on the flow side and unpickled once per worker process."""

    __slots__ = ("token", "blob")

    def __init__(self, value: Any):
        self.token = uuid4().hex
        self.blob = cloudpickle.dumps(value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_shared_from, (self.token, self.blob))


def _shared_from(token: str, blob: bytes) -> Shared:
    shared = Shared.__new__(Shared)
    shared.token, shared.blob = token, blob
    return shared


def seal(**prefect_objects: Any) -> bytes:
    """This task run's own Prefect objects (its inputs, its run context), as bytes."""
    return cloudpickle.dumps(prefect_objects)


def run_prefect_task(*, task: Shared, sealed: bytes, **run_kwargs: Any) -> Any:
    """The Dask task of every Prefect task run; returns the run's final ``State``."""
    from prefect_gpu_dask.submission import run_task_run  # Prefect loads here, on the worker

    return run_task_run(task=task, **cloudpickle.loads(sealed), **run_kwargs)
