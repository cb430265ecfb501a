"""Sending a Prefect task run to a Dask worker, without paying for settings every time.

The flow side; the worker side is ``worker.taskrun``.

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

from collections import OrderedDict
from typing import Any
from uuid import uuid4

import distributed
from prefect.context import EngineContext, SettingsContext, serialize_context
from prefect.utilities.engine import collect_task_run_inputs_sync

from prefect_gpu_dask import _compat
from prefect_gpu_dask.payload import Shared, seal
from prefect_gpu_dask.worker.entry import run_prefect_task

_SETTINGS = _compat.context_var(SettingsContext)
_ENGINE = _compat.context_var(EngineContext)
SHARED_KEPT = 1024  # fixed parts of the task runs submitted lately


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
