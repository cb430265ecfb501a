"""A Prefect task run on a Dask worker: its settings and API client built once per
worker process, its screening (a quarantined GPU, a worker that died running it), and
Prefect's engine, which asks for tag concurrency slots only where a tag has a limit.

The worker side of ``flow.submission``: what the flow sends once per flow run
(``payload.Shared``) is unpickled here once per worker process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import cloudpickle

# Prefect sets up logging as ``prefect.main`` is first imported, which a task's own
# module does with ``from prefect import flow``, and again in full where the first set-up
# was made elsewhere. Imported here, before this process starts Prefect's API log and
# event workers: a set-up while one of them starts flushes its handler under the
# logging lock the worker's thread waits for, and both wait for good.
import prefect.main  # noqa: F401
from prefect.context import SettingsContext, SyncClientContext, hydrated_context
from prefect.events.worker import EventsWorker
from prefect.exceptions import ObjectNotFound
from prefect.logging.configuration import ensure_logging_setup
from prefect.logging.handlers import APILogWorker
from prefect.plugins import load_prefect_collections
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import Crashed
from prefect.task_engine import run_task_async, run_task_sync

from prefect_gpu_dask import _compat

if TYPE_CHECKING:
    from prefect import Task
    from prefect.client.schemas.objects import State
from prefect_gpu_dask.errors import WorkerDiedError
from prefect_gpu_dask.payload import Shared, SharedRef
from prefect_gpu_dask.worker.guard import current_guard
from prefect_gpu_dask.worker.quarantine import HealthWatch, screen
from prefect_gpu_dask.worker.recycling import admit, announce_end
from prefect_gpu_dask.worker.tag_limits import TagLimits

logger = logging.getLogger(__name__)


_worker_cache: OrderedDict[str, Any] = OrderedDict()
_worker_lock = threading.Lock()
WORKER_CACHE_SIZE = 256
DRAIN_EVENTS_S = 10.0  # the longest a flow run's end waits for a worker's events to leave


def _cached(token: str, build: Any) -> Any:
    """This worker process's object for ``token``, built once (LRU)."""
    with _worker_lock:
        if token in _worker_cache:
            _worker_cache.move_to_end(token)
            return _worker_cache[token]
        value = _worker_cache[token] = build()
        while len(_worker_cache) > WORKER_CACHE_SIZE:
            _worker_cache.popitem(last=False)
        return value


def _blob(shared: Shared | SharedRef) -> bytes:
    """``shared``'s blob: carried, or fetched from the scheduler, where the flow run
    left it for as long as it runs."""
    if isinstance(shared, Shared):
        return shared.blob
    blob = _compat.scheduler_metadata(list(shared.keys))
    if not isinstance(blob, bytes):
        raise RuntimeError(
            f"The scheduler holds no flow-run object {shared.token} for this task run "
            f"(under {list(shared.keys)}): its flow run has ended or another client removed it"
        )
    return blob


def _unshare(shared: Shared | SharedRef | Any) -> Any:
    if not isinstance(shared, (Shared, SharedRef)):
        return shared
    return _cached(shared.token, lambda: cloudpickle.loads(_blob(shared)))


def prepare_process() -> None:
    """Prefect's lazy per-process set-up, done before any engine runs here.

    Called under the worker lock. Task runs starting at once on a fresh worker each do
    this set-up without a lock, and both halves race:

    - two ``dictConfig`` calls: the second flushes the first's API log handler while the
      event loop that handler waits for needs the logging lock the second holds;
    - two ``model_rebuild`` calls of the run-context models: pydantic's rebuild is not
      thread-safe, and a run context built in between is validated as its parent class.
    """
    ensure_logging_setup()
    with hydrated_context(None):  # completes the run-context models, as the engine would
        pass


def prepare_process_once() -> None:
    """``prepare_process``, under the worker lock, for code that enters Prefect's
    ``hydrated_context`` on a worker outside a task run (an out-of-memory retry's attempt
    moved here). ``hydrated_context`` makes the same set-up unlocked, and on a worker new
    to the flow run it would race the flow run's preparation (``prepare_flow_run``).
    Once per process while the worker cache keeps it (again, harmlessly, after it is
    evicted); the lock is taken every time, so a preparation in progress is waited for."""
    _cached("process-prepared", prepare_process)


def _settings_and_client(shared: Shared | SharedRef) -> tuple[SettingsContext, SyncClientContext]:
    """Settings and an open API client for this flow run, made once per worker process.

    Re-validating settings re-reads the environment, and a fresh ``SyncPrefectClient``
    builds a new SSL context; the engine would build two clients per task unless one
    is already in context.
    """

    def build() -> tuple[SettingsContext, SyncClientContext]:
        prepare_process()
        settings = SettingsContext(**cloudpickle.loads(_blob(shared)))
        with _compat.use(settings):
            clients = SyncClientContext()
            clients.client.__enter__()  # kept open for the life of the worker
        return settings, clients

    return _cached(f"settings-{shared.token}", build)


@contextmanager
def _in_flow_run(settings: SettingsContext, clients: SyncClientContext) -> Iterator[None]:
    """A flow run's settings and client as this thread's context. Set on the context
    variables directly: one object serves all worker threads. Its events go to its own
    API: flow runs sharing this worker may each report to an API of their own, and
    Prefect's events worker would otherwise send them all to the first one's
    (``_compat.events_per_api_url``)."""
    with _compat.use(settings), _compat.use(clients), _compat.events_per_api_url():
        yield


def prepare_flow_run(shared_settings: Shared) -> None:
    """What a flow run's first task run on this worker would otherwise wait for: its
    settings and API client (``_settings_and_client``), Prefect's API log and event
    workers, started as the engine would start them, and, once per process, the
    collections Prefect looks up blocks in (its flow-run context holds a result-storage
    block). Tasks arriving meanwhile wait for the same build (``_cached``), never make a
    second one."""
    try:
        with _in_flow_run(*_settings_and_client(shared_settings)):
            APILogWorker.instance()
            EventsWorker.instance()
            load_prefect_collections()
    except Exception:  # run for the flow on each worker: the first task run builds them then, and reports
        logger.warning("Could not prepare this worker for a flow run", exc_info=True)


def drain_events(api_url: str) -> None:
    """Send what this process's events worker for ``api_url`` holds, then stop it: the next
    event for that URL gets a new one (``entry.end_flow_run_events``)."""
    with _compat.events_per_api_url(), temporary_settings({PREFECT_API_URL: api_url}):
        events = EventsWorker.instance()
    events.drain()


def _health() -> HealthWatch | None:
    guard = current_guard()
    return guard.health if guard is not None else None


def _api_state(clients: SyncClientContext, task_run_id: Any) -> Any:
    try:
        return clients.client.read_task_run(task_run_id).state
    except ObjectNotFound:
        return None


def _tag_limits(shared: Shared | SharedRef, clients: SyncClientContext) -> TagLimits:
    return _cached(f"tag-limits-{shared.token}", lambda: TagLimits(clients.client))


def run_task_run(
    *, task: Shared | SharedRef, context: dict[str, Any], **run_kwargs: Any
) -> State[Any] | None:
    """Worker side: run one Prefect task run, returning its final ``State``."""
    unshared: Task[..., Any] = _unshare(task)
    # A sick GPU's work goes elsewhere.
    screened: Task[..., Any] = screen(unshared, _compat.current_task_restrictions(), _health)
    shared_settings = context.pop("settings_context")
    settings, clients = _settings_and_client(shared_settings)
    admitted, final = admit(screened, lambda: _api_state(clients, run_kwargs["task_run_id"]))
    if final is not None:  # its worker died after the run ended: the flow gets that state again
        return final
    assert admitted is not None  # admit gives a task to run or the run's final state
    context["flow_run_context"] = _unshare(context.get("flow_run_context"))
    with _in_flow_run(settings, clients):
        try:
            with _compat.tag_slot_requests_where(_tag_limits(shared_settings, clients).exists):
                state: State[Any] | None  # the engine's type: return_type="state" gives one
                if admitted.isasync:
                    state = asyncio.run(
                        run_task_async(task=admitted, context=context, return_type="state", **run_kwargs)
                    )
                else:
                    state = run_task_sync(task=admitted, context=context, return_type="state", **run_kwargs)
            announce_end(state)  # before the result: a worker dying after it still told how it ended
            return state
        except WorkerDiedError as exc:
            # The engine has recorded the crash; the flow gets the same state back.
            return Crashed(message=str(exc))
