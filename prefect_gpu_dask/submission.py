"""Sending a Prefect task run to a Dask worker, without paying for settings every time.

prefect-dask serialises the whole Prefect context for every task, and the worker
rebuilds it. Profiled, almost all of that is the settings context: dumping it on the
flow side and re-validating it (pydantic-settings re-reads the environment) on the
worker, per task. Settings do not change within a flow run, so
here they are dumped once per settings object and rebuilt once per worker process,
keyed by a token made when they are first dumped. Everything else (flow run, tags,
assets, task run) is serialised per task exactly as prefect-dask does, and sealed
(``payload``) so that the scheduler never unpickles a Prefect object.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from typing import Any
from uuid import uuid4

import cloudpickle
import distributed
from prefect.context import (
    EngineContext,
    SettingsContext,
    SyncClientContext,
    hydrated_context,
    serialize_context,
)
from prefect.exceptions import ObjectNotFound
from prefect.logging.configuration import ensure_logging_setup
from prefect.states import Crashed
from prefect.task_engine import run_task_async, run_task_sync
from prefect.utilities.engine import collect_task_run_inputs_sync

from prefect_gpu_dask import _compat
from prefect_gpu_dask.payload import Shared, run_prefect_task, seal
from prefect_gpu_dask.quarantine import screen
from prefect_gpu_dask.recycling.worker import WorkerDiedError, announce_start, refusal
from prefect_gpu_dask.taskwrap import with_around

_SETTINGS = _compat.context_var(SettingsContext)
_ENGINE = _compat.context_var(EngineContext)
_CLIENTS = _compat.context_var(SyncClientContext)


class _Serialized:
    """Stands in for a context object while Prefect serialises the current context.

    Everything reads through to the real object; only ``serialize()`` is answered
    from the copy made the first time.
    """

    def __init__(self, real: Any):
        self._real = real
        self._serialized = real.serialize()

    def serialize(self, include_secrets: bool = True) -> dict[str, Any]:
        return self._serialized

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class TaskSubmitter:
    """Flow side: turns a Prefect task + parameters into one ``Client.submit`` call.

    What is fixed for a flow run travels as ``Shared`` blobs: the task object, the
    settings and the flow-run context (whose result-store block regenerates its JSON
    schema on every dump). Only the task run's own
    parameters and ids are pickled per task.
    """

    def __init__(self) -> None:
        self._stand_ins: dict[type, tuple[Any, _Serialized]] = {}
        # Bounded: task objects made on the fly must not all stay alive here.
        self._shared: OrderedDict[tuple[str, int], tuple[Any, Shared]] = OrderedDict()

    def _stand_in(self, context_type: Any) -> _Serialized | None:
        current = context_type.get()
        if current is None:
            return None
        cached = self._stand_ins.get(context_type)
        if cached is None or cached[0] is not current:
            cached = self._stand_ins[context_type] = (current, _Serialized(current))
        return cached[1]

    def _share(self, kind: str, owner: Any, value: Any) -> Shared:
        cached = self._shared.get((kind, id(owner)))
        if cached is None or cached[0] is not owner:
            cached = self._shared[(kind, id(owner))] = (owner, Shared(value))
            while len(self._shared) > SHARED_KEPT:
                self._shared.popitem(last=False)
        return cached[1]

    def context(self, task: Any, task_run_id: Any, dependencies: dict[str, Any]) -> dict[str, Any]:
        settings = self._stand_in(SettingsContext)
        engine = self._stand_in(EngineContext)
        resets = [(_SETTINGS, _SETTINGS.set(settings))]
        if engine is not None:
            resets.append((_ENGINE, _ENGINE.set(engine)))
        try:
            context = serialize_context(
                asset_ctx_kwargs={
                    "task": task,
                    "task_run_id": task_run_id,
                    "task_inputs": dependencies,
                    "copy_to_child_ctx": True,
                }
            )
        finally:
            for var, token in reversed(resets):
                var.reset(token)
        context["settings_context"] = self._share("settings", settings, context["settings_context"])
        if engine is not None:
            context["flow_run_context"] = self._share("flow", engine, context["flow_run_context"])
        return context

    def submit(
        self,
        client: distributed.Client,
        task: Any,
        parameters: dict[str, Any],
        wait_for: Any,
        dependencies: dict[str, Any] | None,
    ) -> distributed.Future:
        task_run_id = uuid4()
        inputs = {
            name: collect_task_run_inputs_sync(value, future_cls=distributed.Future)
            for name, value in parameters.items()
        }
        if dependencies:
            inputs = {name: deps.union(dependencies.get(name, set())) for name, deps in inputs.items()}
        future = client.submit(
            run_prefect_task,
            task=self._share("task", task, task),
            task_run_id=task_run_id,
            parameters=parameters,
            wait_for=wait_for,
            sealed=seal(dependencies=inputs, context=self.context(task, task_run_id, inputs)),
            key=f"{task.name}-{task_run_id.hex}",
            pure=False,
        )
        future.task_run_id = task_run_id
        return future


_worker_cache: OrderedDict[str, Any] = OrderedDict()
_worker_lock = threading.Lock()
WORKER_CACHE_SIZE = 256
SHARED_KEPT = 1024  # flow side: fixed parts of the task runs submitted lately


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


def _unshare(shared: Shared | Any) -> Any:
    if not isinstance(shared, Shared):
        return shared
    return _cached(shared.token, lambda: cloudpickle.loads(shared.blob))


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


def _settings_and_client(shared: Shared) -> tuple[SettingsContext, SyncClientContext]:
    """Settings and an open API client for this flow run, made once per worker process.

    Re-validating settings re-reads the environment, and a fresh ``SyncPrefectClient``
    builds a new SSL context; the engine would build two clients per task unless one
    is already in context.
    """

    def build() -> tuple[SettingsContext, SyncClientContext]:
        prepare_process()
        settings = SettingsContext(**cloudpickle.loads(shared.blob))
        reset = _SETTINGS.set(settings)
        try:
            clients = SyncClientContext()
            clients.client.__enter__()  # kept open for the life of the worker
        finally:
            _SETTINGS.reset(reset)
        return settings, clients

    return _cached(f"settings-{shared.token}", build)


def run_task_run(*, task: Shared, context: dict[str, Any], **run_kwargs: Any) -> Any:
    """Worker side: run one Prefect task run, returning its final ``State``."""
    task = _unshare(task)
    task = screen(task, _compat.current_task_restrictions())  # a sick GPU's work goes elsewhere
    settings, clients = _settings_and_client(context.pop("settings_context"))
    dead, started_there = announce_start()
    if dead is not None:
        # Dask sends back every task the dead worker held. One that never started there
        # runs now; one whose run already ended (the flow timed it out, then recycled the
        # worker) returns that state; one that was running crashes, naming the worker.
        try:
            state = clients.client.read_task_run(run_kwargs["task_run_id"]).state
        except ObjectNotFound:
            state = None
        if state is not None and state.is_final():
            return state
        if started_there or (state is not None and state.is_running()):
            task = with_around(task, refusal(dead), retries=0)
    context["flow_run_context"] = _unshare(context.get("flow_run_context"))
    # Set the context variables directly: one object serves all worker threads.
    settings_reset = _SETTINGS.set(settings)
    clients_reset = _CLIENTS.set(clients)
    try:
        if task.isasync:
            return asyncio.run(run_task_async(task=task, context=context, return_type="state", **run_kwargs))
        return run_task_sync(task=task, context=context, return_type="state", **run_kwargs)
    except WorkerDiedError as exc:
        # The engine has recorded the crash; the flow gets the same state back.
        return Crashed(message=str(exc))
    finally:
        _CLIENTS.reset(clients_reset)
        _SETTINGS.reset(settings_reset)
