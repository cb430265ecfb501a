"""Sending a Prefect task run to a Dask worker as its ``Route`` says, without paying
for settings every time.

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

import contextlib
import functools
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any
from uuid import UUID, uuid4

import dask
import distributed
from prefect.context import EngineContext, SettingsContext, serialize_context
from prefect.utilities.collections import visit_collection
from prefect.utilities.engine import collect_task_run_inputs_sync
from prefect_dask.task_runners import PrefectDaskFuture

from prefect_gpu_dask import _compat
from prefect_gpu_dask.flow.recycling import RecyclableFuture, Recycler, resolved
from prefect_gpu_dask.flow.resource_wait import ResourceWait
from prefect_gpu_dask.flow.results import PACKAGE_ERRORS, SCHEDULER_ERRORS
from prefect_gpu_dask.flow.routing import Route
from prefect_gpu_dask.payload import SHARED_METADATA, Shared, SharedRef, seal
from prefect_gpu_dask.records import TASK_RUN
from prefect_gpu_dask.scheduler.shared import forget_namespace
from prefect_gpu_dask.settings import RunnerSettings
from prefect_gpu_dask.worker.deadline import deadline
from prefect_gpu_dask.worker.entry import prepare_for_flow_run, run_prefect_task
from prefect_gpu_dask.worker.fallback import falling_back
from prefect_gpu_dask.worker.guard import guarding
from prefect_gpu_dask.worker.host_gpu_lock import claiming_gpu
from prefect_gpu_dask.worker.oom_retry import oom_retry_condition, placing
from prefect_gpu_dask.worker.taskwrap import stacked, with_around

if TYPE_CHECKING:
    from prefect.tasks import Task

    from prefect_gpu_dask.worker.taskwrap import Around

logger = logging.getLogger(__name__)

SHARED_KEPT = 1024  # fixed parts of the task runs submitted lately
CLONES_KEPT = 1024  # tasks dressed lately, with what runs around them


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
    """Turns a Prefect task, its ``Route`` and its parameters into one ``Client.submit``.

    The route is applied as it is: the task is cloned with what runs around its
    function on the worker (``dressed``), submitted asking for the route's resources,
    its deadline handed to ``ResourceWait`` where it waits for them, and its future to
    the ``Recycler``, which may move its result out of a worker it restarts.

    What is fixed for a flow run travels as ``Shared`` blobs: the task object, the
    settings and the flow-run context (whose result-store block regenerates its JSON
    schema on every dump). Only the task run's own parameters and ids are pickled per
    task. The blobs wait on the scheduler (its metadata, under this submitter's
    namespace, until ``close``) and a task run carries their tokens (``SharedRef``):
    the scheduler keeps every task run's payload while its future lives, in the flow's
    own process on a local cluster, and a copy of each blob per task run was most of
    what a big flow's process held per task run.
    """

    def __init__(
        self,
        client: distributed.Client,
        recycler: Recycler,
        resource_wait: ResourceWait,
        settings: RunnerSettings,
    ) -> None:
        self._client = client
        self._settings = settings
        self._recycler = recycler
        self._resource_wait = resource_wait
        self._stand_ins: dict[type, tuple[Any, _Serialized]] = {}
        # Bounded: task objects made on the fly must not all stay alive here.
        self._shared: OrderedDict[tuple[str, int], tuple[Any, Shared]] = OrderedDict()
        self._clones: OrderedDict[tuple[Any, ...], tuple[Task[..., Any], Task[..., Any]]] = OrderedDict()
        self._namespace = uuid4().hex
        self._refs: dict[str, SharedRef] = {}  # token -> its ref, once its blob is on the scheduler

    def submit(
        self,
        task: Task[..., Any],
        route: Route,
        parameters: dict[str, Any],
        wait_for: Any,
        dependencies: dict[str, Any] | None,
    ) -> RecyclableFuture:
        """Send one run of ``task`` as ``route`` says."""
        task = self.dressed(task, route)
        # Each time: a client that reconnected has a new stream (worker.stream says why).
        _compat.send_promptly(self._client.scheduler_comm)
        marks = {TASK_RUN: True, **({"resources": route.resources} if route.resources else {})}
        with dask.annotate(**marks):
            wait_for = _resolved(wait_for) if wait_for else None
            future, task_run_id = self._send(task, _resolved(parameters), wait_for, dependencies)
        key = str(future.key)  # the key _send gave it
        if route.wait_s:
            self._resource_wait.add(key, route.resources, route.wait_s)
        tracked = RecyclableFuture(wrapped_future=future, task_run_id=task_run_id)
        self._recycler.track(key, tracked)
        return tracked

    def dressed(self, task: Task[..., Any], route: Route) -> Task[..., Any]:
        """``task`` with what ``route`` says runs around its function on the worker (a
        fallback's warning or failure, the guard, the deadline watchdog, out-of-memory
        retries and their placement), or as it is."""
        arounds: dict[str, Around] = {}
        if route.claim:  # outermost: the guard measures the task, not its wait for the GPU
            arounds["host-gpu"] = functools.partial(claiming_gpu, self._settings.memory_probe)
        if route.fallback is not None and route.message is not None:  # a route with one says why
            arounds[route.message] = falling_back(route.message, route.fallback == "error", route.waited_for)
        if route.guard:
            # The flow run's own thresholds and policy, whatever other flows on the worker asked for.
            arounds["guard"] = functools.partial(guarding, self._settings)
        if route.deadline:
            arounds["deadline"] = deadline
        if not arounds and not route.oom_retries:
            return task
        # A retry's placement asks for the route's resources, which the tags in context may change.
        placement = (route.oom_retries, tuple(sorted(route.resources.items()))) if route.oom_retries else ()
        key = (id(task), " + ".join(arounds), placement)
        cached = self._clones.get(key)
        if cached is None or cached[0] is not task:
            # One clone per task object and purpose: Prefect's engine and the pickle cache
            # (``_share``) key on the task object.
            cached = self._clones[key] = (task, self._clone(task, route, arounds))
            while len(self._clones) > CLONES_KEPT:
                self._clones.popitem(last=False)
        return cached[1]

    @staticmethod
    def _clone(task: Task[..., Any], route: Route, arounds: dict[str, Around]) -> Task[..., Any]:
        if not route.oom_retries:
            return with_around(task, stacked(*arounds.values()))
        return with_around(
            task,
            stacked(*arounds.values()),
            placing(route.resources),
            retries=task.retries + route.oom_retries,
            retry_condition_fn=oom_retry_condition(route.oom_retries, task.retries, task.retry_condition_fn),
        )

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

    def _ref(self, shared: Shared) -> SharedRef:
        """``shared`` as a task run carries it, its blob left on the scheduler first."""
        ref = self._refs.get(shared.token)
        if ref is None:
            keys = (SHARED_METADATA, self._namespace, shared.token)
            self._client.set_metadata(list(keys), shared.blob)
            ref = self._refs[shared.token] = SharedRef(shared.token, keys)
        return ref

    def close(self) -> None:
        """Take this flow run's blobs off the scheduler: its task runs have ended."""
        if not self._refs:
            return
        self._refs.clear()
        try:
            self._client.run_on_scheduler(forget_namespace, self._namespace)
        except PACKAGE_ERRORS as exc:  # a scheduler without this package, a lost connection
            logger.debug("Could not take this flow run's blobs off the scheduler: %r", exc)
            try:
                self._client.set_metadata([SHARED_METADATA, self._namespace], None)
            except SCHEDULER_ERRORS as again:
                logger.warning("This flow run's task objects stay on the scheduler: %r", again)

    def _shared_settings(self) -> Shared:
        """This flow run's settings as its task runs carry them (``serialize_context``'s
        ``settings_context``)."""
        settings = self._stand_in(SettingsContext)
        return self._share("settings", settings, settings.serialize() if settings is not None else {})

    def prepare_workers(self) -> None:
        """Let every worker build this flow run's settings and API client now, while the
        flow goes on: each worker's first task run would wait for them."""
        try:
            self._client.run(prepare_for_flow_run, self._shared_settings(), wait=False)
        except PACKAGE_ERRORS as exc:  # e.g. a worker without this package: its first task run builds them
            logger.debug("Workers not prepared for this flow run: %r", exc)

    def context(
        self, task: Task[..., Any], task_run_id: UUID, dependencies: dict[str, Any]
    ) -> dict[str, Any]:
        settings = self._stand_in(SettingsContext)
        engine = self._stand_in(EngineContext)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_compat.use(settings, SettingsContext))
            if engine is not None:
                stack.enter_context(_compat.use(engine, EngineContext))
            context = serialize_context(
                asset_ctx_kwargs={
                    "task": task,
                    "task_run_id": task_run_id,
                    "task_inputs": dependencies,
                    "copy_to_child_ctx": True,
                }
            )
        # The same Shared as prepare_workers sent: keyed on the same stand-in.
        shared_settings = self._share("settings", settings, context["settings_context"])
        context["settings_context"] = self._ref(shared_settings)
        if engine is not None:
            context["flow_run_context"] = self._ref(self._share("flow", engine, context["flow_run_context"]))
        return context

    def _send(
        self,
        task: Task[..., Any],
        parameters: dict[str, Any],
        wait_for: Any,
        dependencies: dict[str, Any] | None,
    ) -> tuple[distributed.Future, UUID]:
        """The Dask future of one run of ``task``, and its task run id."""
        task_run_id = uuid4()
        inputs = {
            name: collect_task_run_inputs_sync(value, future_cls=distributed.Future)
            for name, value in parameters.items()
        }
        if dependencies:
            inputs = {name: deps.union(dependencies.get(name, set())) for name, deps in inputs.items()}
        future = self._client.submit(
            run_prefect_task,
            task=self._ref(self._share("task", task, task)),
            task_run_id=task_run_id,
            parameters=parameters,
            wait_for=wait_for,
            sealed=seal(dependencies=inputs, context=self.context(task, task_run_id, inputs)),
            key=f"{task.name}-{task_run_id.hex}",
            pure=False,
        )
        # As prefect-dask's client does: a task given this future as a parameter finds
        # its upstream task run (its task inputs, its upstream assets) through it.
        future.task_run_id = task_run_id  # type: ignore[attr-defined]  # prefect-dask's attribute
        return future, task_run_id


def _resolved(expr: Any) -> Any:
    """``expr`` with each of the flow's futures replaced by what a task depending on it
    is given (``recycling.resolved``)."""

    def visit(item: Any) -> Any:
        return resolved(item) if isinstance(item, PrefectDaskFuture) else item

    return visit_collection(expr, visit_fn=visit, return_data=True)
