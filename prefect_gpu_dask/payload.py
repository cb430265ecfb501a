"""What travels with a Prefect task run to its worker, past the scheduler: opaque blobs.

The scheduler unpickles every task it is sent. The task's Prefect objects travel here
sealed as bytes, so a scheduler never imports Prefect (nor needs it installed). Only
what Dask must see stays open: the parameters (they may hold futures) and the futures
to wait for. The function they are sent to is ``worker.entry.run_prefect_task``.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

import cloudpickle

SHARED_METADATA = "prefect-gpu-dask-shared"  # the scheduler's metadata key of the flow runs' blobs


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


class SharedRef:
    """A ``Shared`` as each task run carries it: its token and where its blob waits on
    the scheduler (``Client.set_metadata`` under ``keys``). A worker fetches the blob
    once per process; the task runs' payloads, which the scheduler keeps while their
    futures live, hold no copy of it."""

    __slots__ = ("token", "keys")

    def __init__(self, token: str, keys: tuple[str, ...]):
        self.token, self.keys = token, keys

    def __reduce__(self) -> tuple[Any, ...]:
        return (SharedRef, (self.token, self.keys))
