"""Sending a Prefect task run to a Dask worker, without paying for settings every time.

prefect-dask serialises the whole Prefect context for every task, and the worker
rebuilds it. Profiled, almost all of that is the settings context: ~15 ms to dump
on the flow side and ~20 ms to re-validate (pydantic-settings re-reads the
environment) on the worker, per task. Settings do not change within a flow run, so
here they are dumped once per settings object and rebuilt once per worker process,
keyed by a content hash. Everything else (flow run, tags, assets, task run) is
serialised per task exactly as prefect-dask does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any
from uuid import uuid4

import distributed
from prefect.context import SettingsContext, SyncClientContext, serialize_context
from prefect.task_engine import run_task_async, run_task_sync
from prefect.utilities.engine import collect_task_run_inputs_sync


class _SerializedSettings:
    """Stands in for the current ``SettingsContext`` while Prefect serialises the rest."""

    def __init__(self, real: SettingsContext, serialized: dict[str, Any]):
        self._real = real
        self._serialized = serialized
        self.settings = real.settings
        self.profile = real.profile

    def serialize(self, include_secrets: bool = True) -> dict[str, Any]:
        return self._serialized

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class TaskSubmitter:
    """Flow side: turns a Prefect task + parameters into one ``Client.submit`` call."""

    def __init__(self) -> None:
        self._settings_for: tuple[SettingsContext, str, _SerializedSettings] | None = None

    def _settings(self) -> tuple[str, _SerializedSettings]:
        current = SettingsContext.get()
        cached = self._settings_for
        if cached is None or cached[0] is not current:
            serialized = current.serialize()
            token = hashlib.sha256(
                json.dumps(serialized, sort_keys=True, default=str).encode()
            ).hexdigest()
            cached = self._settings_for = (current, token, _SerializedSettings(current, serialized))
        return cached[1], cached[2]

    def context(
        self, task: Any, task_run_id: Any, dependencies: dict[str, Any]
    ) -> tuple[str, dict]:
        token, stand_in = self._settings()
        reset = SettingsContext.__var__.set(stand_in)  # type: ignore[arg-type]
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
            SettingsContext.__var__.reset(reset)
        return token, context

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
            inputs = {
                name: deps.union(dependencies.get(name, set())) for name, deps in inputs.items()
            }
        token, context = self.context(task, task_run_id, inputs)
        future = client.submit(
            run_prefect_task,
            task=task,
            task_run_id=task_run_id,
            parameters=parameters,
            wait_for=wait_for,
            dependencies=inputs,
            context=context,
            settings_token=token,
            key=f"{task.name}-{task_run_id.hex}",
            pure=False,
        )
        future.task_run_id = task_run_id
        return future


_worker_contexts: OrderedDict[str, tuple[SettingsContext, SyncClientContext]] = OrderedDict()
_worker_lock = threading.Lock()


def _worker_contexts_for(
    token: str, serialized: dict[str, Any]
) -> tuple[SettingsContext, SyncClientContext]:
    """This process's settings and API client for ``token``, built once.

    A fresh ``SyncPrefectClient`` costs ~20 ms (mostly a new SSL context) and the
    engine builds two per task unless one is already in context.
    """
    with _worker_lock:
        cached = _worker_contexts.get(token)
        if cached is None:
            settings = SettingsContext(**serialized)
            reset = SettingsContext.__var__.set(settings)
            try:
                clients = SyncClientContext()
                clients.client.__enter__()  # kept open for the life of the worker
            finally:
                SettingsContext.__var__.reset(reset)
            cached = _worker_contexts[token] = (settings, clients)
            while len(_worker_contexts) > 8:
                _worker_contexts.popitem(last=False)
        return cached


def run_prefect_task(
    *, task: Any, context: dict[str, Any], settings_token: str, **run_kwargs: Any
) -> Any:
    """Worker side: run one Prefect task run, returning its final ``State``."""
    settings, clients = _worker_contexts_for(settings_token, context.pop("settings_context"))
    # Set the context variables directly: one object serves all worker threads.
    settings_reset = SettingsContext.__var__.set(settings)
    clients_reset = SyncClientContext.__var__.set(clients)
    try:
        if task.isasync:
            return asyncio.run(
                run_task_async(task=task, context=context, return_type="state", **run_kwargs)
            )
        return run_task_sync(task=task, context=context, return_type="state", **run_kwargs)
    finally:
        SyncClientContext.__var__.reset(clients_reset)
        SettingsContext.__var__.reset(settings_reset)
