"""When no worker offers what a task asks for: wait for one, then warn or fail.

No GPU worker *yet* is not no GPU. On a cluster that can still grow (a remote
scheduler, an adaptive or still-starting cluster) a ``gpu`` task keeps its resource
annotation, and Dask holds it until a worker offering the resources joins. Only after
``gpu_wait_s`` does ``on_missing_gpu`` apply: ``ResourceWait`` keeps each waiting
task's deadline and, at it, asks the scheduler once more; tasks nobody can serve yet
are released to run where they can (``scheduler.fallback``), and the task run warns or
fails where it runs (``worker.fallback``).

On a local cluster the runner started without GPUs and without adaptivity nothing can
join, so the route falls back at once and only the worker part runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from prefect_gpu_dask.flow.routing import WorkerOffers
from prefect_gpu_dask.resources import Resources, satisfiable
from prefect_gpu_dask.scheduler.fallback import fail, release, stranded


class ResourceWait:
    """Deadlines of tasks that no worker can start yet.

    Two kinds wait: tasks submitted while no worker offered their resources (``add``),
    and a flow's unfinished tasks after a worker was lost (``strand``), which may wait
    for any worker at all. At the deadline those still waiting get ``on_missing``:
    ``"cpu"`` runs them without their resources where a worker is left; otherwise they
    fail with ``MissingResourceError``; a task run that a dead worker was running goes
    to ``on_interrupted`` first (its worker's address and whether it said it had
    started it, per key, and why it cannot run), which gives it its final state. One
    daemon thread, started with the first waiting task, sleeps until the next deadline;
    the flow's submit never blocks on it.
    """

    def __init__(
        self,
        client: Any,
        offers: WorkerOffers,
        logger: Any,
        on_missing: str,
        on_interrupted: Callable[[Mapping[str, tuple[str, bool]], str], object] = lambda runs, why: None,
    ):
        self._client = client
        self._on_interrupted = on_interrupted
        self._offers = offers
        self._logger = logger
        self._on_missing = on_missing
        # key -> deadline, resources asked (None: whatever the scheduler holds), wait
        self._waiting: dict[str, tuple[float, Resources | None, float]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, key: str, resources: Mapping[str, float], wait_s: float) -> None:
        self._watch({key: dict(resources)}, wait_s)

    def strand(self, keys: list[str], wait_s: float) -> None:
        """Give ``keys`` (unfinished tasks that a lost worker may leave with nowhere to
        run) ``wait_s`` for a worker that can start them."""
        self._watch(dict.fromkeys(keys), wait_s)

    def _watch(self, keys: Mapping[str, Resources | None], wait_s: float) -> None:
        with self._lock:
            for key, resources in keys.items():
                self._waiting[key] = (time.monotonic() + wait_s, resources, wait_s)
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
        asked = {k: v for k, v in due.items() if v[1] is not None and not satisfiable(v[1], offered)}
        if asked:
            self._release(asked)
        unknown = [k for k, v in due.items() if v[1] is None]
        if unknown:
            self._settle(unknown, max(due[k][2] for k in unknown))

    def _release(self, stranded_: dict[str, tuple[float, Resources | None, float]]) -> None:
        released = self._client.run_on_scheduler(release, keys=list(stranded_))
        if not released:
            return
        asked = {str(stranded_[k][1]) for k in released}
        wait_s = max(stranded_[k][2] for k in released)
        self._logger.warning(
            "No worker offering %s joined within %g s: %d task run(s) now go where they can "
            "(on_missing_gpu=%r)",
            " or ".join(sorted(asked)),
            wait_s,
            len(released),
            self._on_missing,
        )

    def _settle(self, keys: list[str], wait_s: float) -> None:
        found = self._client.run_on_scheduler(stranded, keys=keys)
        tasks: dict[str, Resources] = found["tasks"]
        if not tasks:
            return
        if found["workers"] and self._on_missing == "cpu":
            runnable = [k for k, resources in tasks.items() if resources]
            released = self._client.run_on_scheduler(release, keys=runnable) if runnable else []
            if released:
                self._logger.warning(
                    "A lost worker left %d task run(s) that no worker offering their resources "
                    "could take within %g s: they now go where they can (on_missing_gpu='cpu')",
                    len(released),
                    wait_s,
                )
            tasks = {k: v for k, v in tasks.items() if k not in released}
            if not tasks:
                return
        if found["workers"]:
            asked = " or ".join(sorted({str(v) for v in tasks.values() if v})) or "their resources"
            message = (
                f"No worker offering {asked} is left in the cluster, and none joined within "
                f"{wait_s:g} s (on_missing_gpu={self._on_missing!r})"
            )
        else:
            message = f"No Dask worker is left in the cluster, and none joined within {wait_s:g} s"
        if interrupted := {k: v for k, v in found.get("interrupted", {}).items() if k in tasks}:
            # Before the scheduler fails them: a flow waiting on one must find its final state.
            try:
                self._on_interrupted(interrupted, message)
            except Exception:  # they fail as missing workers all the same: nothing waits for ever
                self._logger.exception("Could not settle the task runs a dead worker was running")
        failed = self._client.run_on_scheduler(fail, keys=list(tasks), message=message)
        if failed:
            self._logger.error("%s: %d task run(s) fail", message, len(failed))
