"""A task whose worker died while running it fails instead of running a second time.

When a worker dies, Dask quietly reschedules the tasks it was running (up to
``distributed.scheduler.allowed-failures`` times). For a Prefect task run that means
the same task run executing twice, its side effects repeated, and the first attempt
never reported. This scheduler plugin marks such a task in its annotations (which
travel to the next worker with the task), and ``submission.run_prefect_task`` then
fails the task run with a message naming the dead worker instead of re-running it.
"""

from __future__ import annotations

from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

INTERRUPTED = "prefect-gpu-dask-worker-died"


class WorkerDiedError(RuntimeError):
    """The Dask worker running this task run died before it finished."""


class InterruptedTasks(SchedulerPlugin):
    name = "prefect-gpu-dask-interrupted"
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Any = None
        self.running_on: dict[Any, str] = {}

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def restart(self, scheduler: Any) -> None:
        self.running_on.clear()  # every task is forgotten

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if self.scheduler is None:
            return
        if finish == "processing":
            ts = self.scheduler.tasks.get(key)
            if ts is not None and ts.processing_on is not None:
                self.running_on[key] = ts.processing_on.address
        elif start == "processing":
            worker = self.running_on.pop(key, None)
            ts = self.scheduler.tasks.get(key)
            # remove_worker counts an unexpected death in ts.suspicious before releasing.
            if (
                finish == "released"
                and ts is not None
                and ts.suspicious
                and worker not in self.scheduler.workers
            ):
                ts.annotations = {**(ts.annotations or {}), INTERRUPTED: worker}


def died_on() -> str | None:
    """In a worker: the address of the worker that died running this task before, if any."""
    try:
        import distributed

        worker = distributed.get_worker()
        ts = worker.state.tasks.get(worker.get_current_task())
    except (ValueError, AttributeError, KeyError):
        return None
    return (ts.annotations or {}).get(INTERRUPTED) if ts is not None else None


def refusing(task: Any, worker: str) -> Any:
    """A copy of ``task`` that fails at once, saying which worker died, and never retries."""
    import copy
    import functools

    message = (
        f"Dask worker {worker} died while running this task run; it was not run a second "
        "time (that could repeat its side effects). Submit it again to re-run it."
    )

    @functools.wraps(task.fn)  # the same signature, so Prefect binds the same parameters
    def worker_died(*args: Any, **kwargs: Any) -> Any:
        raise WorkerDiedError(message)

    clone = copy.copy(task)
    clone.fn = worker_died
    clone.isasync = False
    clone.retries = 0
    return clone
