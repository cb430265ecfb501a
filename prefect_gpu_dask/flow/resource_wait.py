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

No worker at all is waited for the same way, for every task: ``watch_workers`` asks
the scheduler every second or so how many workers it has, and gives each task the flow
has waiting while it has none ``gpu_wait_s`` (from when the watch first saw it so) for
one to join. Those still waiting then end ``Failed`` with ``MissingResourceError``
naming the cluster and, where the runner started it, its workers' own start error
(``WorkerStartErrors``). Dask's ``distributed.scheduler.no-workers-timeout`` cannot do
this on a scheduler the runner only joins, and its error names neither.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prefect_gpu_dask import _compat
from prefect_gpu_dask.errors import MissingResourceError
from prefect_gpu_dask.flow.prefect_api import API_ERRORS
from prefect_gpu_dask.flow.results import PACKAGE_ERRORS, SCHEDULER_ERRORS, final_states_lock, settle
from prefect_gpu_dask.flow.routing import WorkerOffers
from prefect_gpu_dask.resources import Resources, satisfiable
from prefect_gpu_dask.scheduler.fallback import fail, release, stranded

if TYPE_CHECKING:
    import distributed
    from prefect.client.schemas.objects import State
    from prefect.tasks import Task
    from prefect_dask.task_runners import PrefectDaskFuture

# How often the watch asks the scheduler whether it has any worker: at most this long...
WATCH_TICK_S = 1.0
# ... and at least this long, a tenth of the wait between.
WATCH_MIN_TICK_S = 0.1
# What settling a dead worker's task runs raises: the scheduler's errors or the API's.
SETTLE_ERRORS: tuple[type[Exception], ...] = (*SCHEDULER_ERRORS, *API_ERRORS)
# How long a flow run's end waits for failed task runs' records to reach Prefect's API.
RECORD_WAIT_S = 10.0
# Where the flow keeps the Prefect task of a run it submitted: a run no worker ever
# started has no record in Prefect's API, and its ``Failed`` one is made from the task.
TASK_ATTRIBUTE = "_prefect_gpu_dask_task"
# Distributed's own words around a worker's start error: the error itself is the cause.
WRAPPERS = ("failed to start", "Worker failed to connect", "Cluster failed to start")


def remember_task(future: PrefectDaskFuture[Any], task: Task[..., Any]) -> None:
    """Keep the Prefect ``task`` that ``future``'s run runs, for ``FailedRuns``."""
    setattr(future, TASK_ATTRIBUTE, task)


def worker_start_error(exc: BaseException) -> str | None:
    """The error under distributed's "Nanny failed to start" (and the like) in
    ``exc``'s chain of causes, as "Type: text"; None where there is none beneath."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        chain.append(link)
        link = link.__cause__ or link.__context__
    root = chain[-1]
    if len(chain) == 1 or any(w in str(root) for w in WRAPPERS):
        return None
    return f"{type(root).__name__}: {root}"


class WorkerStartErrors(logging.Handler):
    """The last few errors a nanny in this process logged starting or restarting its
    worker (a ``LocalCluster``'s, a ``LocalCUDACluster``'s): the worker's own error,
    such as a preload that does not import, where distributed raises only "Nanny
    failed to start" or starts no worker at all. On ``distributed.nanny`` from
    ``attach`` to ``detach``."""

    LOGGER = "distributed.nanny"

    def __init__(self, kept: int = 3):
        super().__init__(level=logging.ERROR)
        self._texts: deque[str] = deque(maxlen=kept)

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        text = worker_start_error(error) if error is not None else None
        if text is None and error is not None:
            text = f"{type(error).__name__}: {error}"
        if text and text not in self._texts:
            self._texts.append(text)

    def texts(self) -> list[str]:
        return list(self._texts)

    def attach(self) -> WorkerStartErrors:
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def detach(self) -> None:
        logging.getLogger(self.LOGGER).removeHandler(self)


class FailedRuns:
    """Gives task runs that no worker could start their Prefect ``Failed`` state: as
    their futures' final state (before Dask fails their keys, so a flow that sees the
    error finds the state too), and in Prefect's API, where a run no worker started has
    no record yet and gets one. ``future_of``: the flow's future for a Dask key."""

    def __init__(
        self,
        future_of: Callable[[str], PrefectDaskFuture[Any] | None],
        flow_run_id: Callable[[], str | None],
        logger: logging.Logger,
    ):
        self._future_of = future_of
        self._flow_run_id = flow_run_id
        self._logger = logger
        # Made in the flow's thread: the API calls run in its context (settings, API URL).
        self._context = contextvars.copy_context()
        self._recorded = threading.Event()  # no record under way
        self._recorded.set()

    def settle(self, keys: Iterable[str], message: str) -> dict[str, PrefectDaskFuture[Any]]:
        """Give ``keys``' futures that have no final state yet a ``Failed`` one."""
        from prefect.states import Failed

        settled = {}
        for key in keys:
            future = self._future_of(key)
            if future is None or _compat.future_final_state(future) is not None:
                continue
            state: State[Any] = Failed(message=message, data=MissingResourceError(message))
            settle(future, state)
            if _compat.future_final_state(future) is state:
                settled[key] = future
        return settled

    @staticmethod
    def unsettle(futures: Iterable[PrefectDaskFuture[Any]]) -> None:
        """Take back the ``Failed`` state of futures whose task a worker took after all."""
        with final_states_lock:
            for future in futures:
                _compat.set_future_final_state(future, None)

    def record(self, futures: Iterable[PrefectDaskFuture[Any]], message: str) -> None:
        """Write the ``Failed`` state of ``futures``' task runs to Prefect's API."""
        futures = list(futures)
        if not futures:
            return
        self._recorded.clear()
        try:
            self._context.copy().run(self._record, futures, message)
        finally:
            self._recorded.set()

    def wait_recorded(self, timeout: float) -> None:
        """Let a record under way reach the API before the flow run ends (at most ``timeout``)."""
        self._recorded.wait(timeout)

    def _record(self, futures: list[PrefectDaskFuture[Any]], message: str) -> None:
        import httpx
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound, PrefectException
        from prefect.states import Failed

        flow_run_id = self._flow_run_id()
        try:
            with get_client(sync_client=True) as api:
                for future in futures:
                    run_id = uuid.UUID(str(future.task_run_id))
                    try:
                        api.read_task_run(run_id)
                    except ObjectNotFound:  # no worker ever started it: its record is made here
                        task = getattr(future, TASK_ATTRIBUTE, None)
                        if task is not None and flow_run_id is not None:
                            api.create_task_run(
                                task,
                                flow_run_id=uuid.UUID(flow_run_id),
                                dynamic_key=str(run_id),
                                id=run_id,
                                name=f"{task.name}-{run_id.hex[:3]}",
                                state=Failed(message=message),
                            )
                        continue
                    api.set_task_run_state(run_id, Failed(message=message), force=True)
        # The API down, refusing, or without the flow run: the flow has their states; only
        # the API's record is missing.
        except (httpx.HTTPError, OSError, PrefectException) as exc:
            self._logger.warning(
                "Could not record %d failed task run(s) in Prefect's API: %r", len(futures), exc
            )


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
        client: distributed.Client,
        offers: WorkerOffers,
        logger: logging.Logger,
        on_missing: str,
        on_interrupted: Callable[[Mapping[str, tuple[str, bool]], str], object] = lambda runs, why: None,
        *,
        address: str = "",
        start_errors: Callable[[], list[str]] = list,
        failed_runs: FailedRuns | None = None,
    ):
        self._client = client
        self._address = address
        self._start_errors = start_errors
        self._failed_runs = failed_runs
        self._on_interrupted = on_interrupted
        self._offers = offers
        self._logger = logger
        self._on_missing = on_missing
        # key -> deadline, resources asked (None: whatever the scheduler holds), wait
        self._waiting: dict[str, tuple[float, Resources | None, float]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._stop = threading.Event()  # ends the workers' watch
        self._thread: threading.Thread | None = None

    def add(self, key: str, resources: Mapping[str, float], wait_s: float) -> None:
        self._watch({key: dict(resources)}, wait_s)

    def strand(self, keys: list[str], wait_s: float) -> None:
        """Give ``keys`` (unfinished tasks that a lost worker may leave with nowhere to
        run) ``wait_s`` for a worker that can start them."""
        self._watch(dict.fromkeys(keys), wait_s)

    def watch_workers(
        self,
        unfinished: Callable[[], list[str]],
        wait_s: float,
        restarting: Callable[[], bool] = lambda: False,
    ) -> None:
        """While the scheduler has no worker (and no restart of one is under way), give
        the flow's ``unfinished`` task runs ``wait_s`` for a worker to join; a daemon
        thread asks it every second or so (a tenth of ``wait_s`` where that is less)."""
        tick = min(WATCH_TICK_S, max(WATCH_MIN_TICK_S, wait_s / 10))
        thread = threading.Thread(
            target=self._watch_workers,
            args=(unfinished, wait_s, restarting, tick),
            name="no-worker-watch",
            daemon=True,
        )
        thread.start()

    def _watch_workers(
        self, unfinished: Callable[[], list[str]], wait_s: float, restarting: Callable[[], bool], tick: float
    ) -> None:
        while not self._stop.wait(tick):
            try:
                if not restarting() and not self._has_workers():
                    # Those already waiting keep their deadline; one that passed it and
                    # still waits (its state then did not let it fail) waits again.
                    self._watch(dict.fromkeys(unfinished()), wait_s, replace=False)
            except SCHEDULER_ERRORS as exc:  # a closing client, a scheduler gone: the next tick asks again
                if not self._closed:
                    self._logger.debug("Could not ask the scheduler for its workers: %r", exc)

    def _has_workers(self) -> bool:
        identity = self._client.sync(self._client.scheduler.identity, n_workers=0)
        return bool(identity.get("n_workers"))

    def _watch(self, keys: Mapping[str, Resources | None], wait_s: float, replace: bool = True) -> None:
        added = False
        with self._lock:
            for key, resources in keys.items():
                if replace or key not in self._waiting:
                    self._waiting[key] = (time.monotonic() + wait_s, resources, wait_s)
                    added = True
            if added and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gpu-wait", daemon=True)
                self._thread.start()
        if added:
            self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._failed_runs is not None:
            self._failed_runs.wait_recorded(RECORD_WAIT_S)

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
                # The thread's loop: whatever one pass met, the next one still fails what
                # waits past its deadline (nothing may wait for ever).
                except Exception as exc:
                    if not self._closed:  # else the flow is ending and the client closing
                        self._logger.warning(
                            "Could not release task runs past their wait for a GPU worker "
                            "(is prefect-gpu-dask installed on the scheduler?); trying again: %r",
                            exc,
                            exc_info=not isinstance(exc, PACKAGE_ERRORS),
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
        if asked and offered:
            self._release(asked)
        # With no worker at all, released tasks would wait on: they fail as stranded ones do.
        unknown = [k for k, v in due.items() if v[1] is None or (k in asked and not offered)]
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
        cluster = f"the cluster at {self._address}" if self._address else "the cluster"
        if found["workers"]:
            asked = " or ".join(sorted({str(v) for v in tasks.values() if v})) or "their resources"
            message = (
                f"No worker offering {asked} is left in {cluster}, and none joined within "
                f"{wait_s:g} s (on_missing_gpu={self._on_missing!r})"
            )
        else:
            message = f"No Dask worker is left in {cluster}, and none joined within {wait_s:g} s"
            if errors := self._start_errors():
                message += f"; its workers failed to start: {' | '.join(errors)}"
        if interrupted := {k: v for k, v in found.get("interrupted", {}).items() if k in tasks}:
            # Before the scheduler fails them: a flow waiting on one must find its final state.
            try:
                self._on_interrupted(interrupted, message)
            except SETTLE_ERRORS:  # they fail as missing workers all the same
                self._logger.exception("Could not settle the task runs a dead worker was running")
        # Their futures end Failed before Dask fails their keys: a flow woken by the error
        # finds the state as well.
        settled = self._failed_runs.settle(tasks, message) if self._failed_runs is not None else {}
        failed = self._client.run_on_scheduler(fail, keys=list(tasks), message=message)
        if failed:
            self._logger.error("%s: %d task run(s) fail", message, len(failed))
        if self._failed_runs is not None:
            self._failed_runs.unsettle(f for k, f in settled.items() if k not in failed)  # a worker took it
            self._failed_runs.record((settled[k] for k in failed if k in settled), message)
