"""The errors a task run fails with when the cluster cannot run it as asked.

Raised on a worker or the scheduler, and seen by the flow.
"""

from __future__ import annotations

from typing import Any


class MissingResourceError(RuntimeError):
    """A task asked for a resource (e.g. a GPU) that no worker in the cluster offers."""


class UnhealthyGPUError(RuntimeError):
    """A ``gpu`` task reached a quarantined GPU and no healthy one is left in the cluster."""


class WorkerDiedError(BaseException):
    """The Dask worker running this task run died before it finished.

    A ``BaseException``, like Prefect's own ``TerminationSignal``: Prefect's engine
    reports it as a crash (``Crashed``: infrastructure lost, not the task's code failing),
    and never retries it.
    """


def worker_died_message(worker: str, why: str = "") -> str:
    """What a task run that ``worker`` died running says, wherever it is refused;
    ``why``: why no other worker runs it, where none is left."""
    why = f". {why}" if why else ""
    return (
        f"Dask worker {worker} died while running this task run{why}; it was not run a second "
        "time (that could repeat its side effects). Submit it again to re-run it."
    )


def died_running(started_there: bool, state: Any) -> bool:
    """Whether a dead worker was running a task run: it said it had started it, or
    Prefect's API shows it running (``state``: its state there, None where it has none).
    Such a run is never run a second time."""
    return started_there or (state is not None and state.is_running())
