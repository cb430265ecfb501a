"""When no worker offers what a task asks for: wait for one, then warn or fail.

No GPU worker *yet* is not no GPU. On a cluster that can still grow (a remote
scheduler, an adaptive or still-starting cluster) a ``gpu`` task keeps its resource
annotation, and Dask holds it until a worker offering the resources joins. Only after
``gpu_wait_s`` does ``on_missing_gpu`` apply:

- flow: ``ResourceWait`` keeps each waiting task's deadline and, at it, asks the
  scheduler once more; tasks nobody can serve yet are released;
- scheduler: ``release`` lets such a task run without its resource restrictions;
- worker: ``falling_back`` is the ``around`` that warns in the task run (``"cpu"``) or
  fails it (``"error"``) where the worker running it lacks the resources.

On a local cluster the runner started without GPUs and without adaptivity nothing can
join, so the route falls back at once and only the worker part runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from prefect_gpu_dask.routing import Resources, WorkerOffers, satisfiable


class MissingResourceError(RuntimeError):
    """A task asked for a resource (e.g. a GPU) that no worker in the cluster offers."""


# -- worker ----------------------------------------------------------------------------


def falling_back(
    message: str, fail: bool, unless_offered: Mapping[str, float] | None = None
) -> Callable[[], AbstractContextManager[None]]:
    """An ``around`` that announces a routing fallback in the task run, or fails it.

    With ``unless_offered``, a worker that offers those resources (the one the task
    waited for joined in time) runs the task as asked, without a word.
    """

    @contextmanager
    def announce() -> Any:
        if unless_offered is not None and satisfiable(unless_offered, [_worker_resources()]):
            yield
            return
        if fail:
            raise MissingResourceError(message)
        from prefect.logging import get_run_logger

        get_run_logger().warning(message)
        yield

    return announce


def _worker_resources() -> Mapping[str, float]:
    import distributed

    from prefect_gpu_dask._compat import worker_resources

    try:
        return worker_resources(distributed.get_worker())
    except ValueError:  # not on a Dask worker
        return {}


# -- scheduler -------------------------------------------------------------------------


def release(dask_scheduler: Any, keys: list[str]) -> list[str]:
    """Drop the resource restrictions of ``keys`` not started yet; return those released."""
    from prefect_gpu_dask._compat import drop_resource_restrictions

    return drop_resource_restrictions(dask_scheduler, keys, f"gpu-wait-over-{time.time()}")


# -- flow ------------------------------------------------------------------------------


class ResourceWait:
    """Deadlines of tasks submitted while no worker offered their resources.

    One daemon thread, started with the first waiting task, sleeps until the next
    deadline; the flow's submit never blocks on it.
    """

    def __init__(self, client: Any, offers: WorkerOffers, logger: Any, on_missing: str):
        self._client = client
        self._offers = offers
        self._logger = logger
        self._on_missing = on_missing
        self._waiting: dict[str, tuple[float, Resources, float]] = {}  # key -> deadline, asked, wait
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, key: str, resources: Mapping[str, float], wait_s: float) -> None:
        with self._lock:
            self._waiting[key] = (time.monotonic() + wait_s, dict(resources), wait_s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gpu-wait", daemon=True)
                self._thread.start()
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _run(self) -> None:
        while not self._closed:
            with self._lock:
                next_due = min((d for d, _, _ in self._waiting.values()), default=None)
            timeout = None if next_due is None else max(0.0, next_due - time.monotonic())
            self._wake.wait(timeout)
            self._wake.clear()
            if not self._closed:
                try:
                    self._expire()
                except Exception as exc:
                    if not self._closed:  # else the flow is ending and the client closing
                        self._logger.warning(
                            "Could not release task runs past their wait for a GPU worker "
                            "(is prefect-gpu-dask installed on the scheduler?); they wait on: %s",
                            exc,
                        )

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = {k: v for k, v in self._waiting.items() if v[0] <= now}
            for key in due:
                del self._waiting[key]
        if not due:
            return
        offered = self._offers.refresh()
        stranded = {k: v for k, v in due.items() if not satisfiable(v[1], offered)}
        if not stranded:
            return
        released = self._client.run_on_scheduler(release, keys=list(stranded))
        if not released:
            return
        asked = {str(stranded[k][1]) for k in released}
        wait_s = max(stranded[k][2] for k in released)
        self._logger.warning(
            "No worker offering %s joined within %g s: %d task run(s) now go where they can "
            "(on_missing_gpu=%r)",
            " or ".join(sorted(asked)),
            wait_s,
            len(released),
            self._on_missing,
        )
