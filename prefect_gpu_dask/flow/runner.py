"""``GPUDaskTaskRunner``: prefect-dask's runner, made GPU-aware. It wires the parts and
implements none of them.

It keeps ``prefect_dask.DaskTaskRunner``'s lifecycle (lazy client and cluster,
futures, ``map``, adapt, performance reports) and adds: settings validated once
(``settings``), the cluster it starts or joins (``cluster``), how each task runs
(``routing``), a cheaper path for sending a task run to a worker (``submission``),
the plugins on the workers (the guard, the labels), the restart path it feeds
(``recycling``), and what the Prefect UI shows (``reporting``). Like any subclass it
uses prefect-dask's own ``_client``, ``_cluster``, ``_exit_stack`` and ``_started``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any, ParamSpec, TypeVar, overload

import dask
import distributed
from distributed.diagnostics.plugin import NannyPlugin, SchedulerPlugin, WorkerPlugin
from prefect.client.schemas.objects import RunInput
from prefect.context import FlowRunContext, TagsContext
from prefect.futures import PrefectFuture, PrefectFutureList
from prefect.tasks import Task
from prefect_dask import DaskTaskRunner
from prefect_dask.client import PrefectDaskClient
from prefect_dask.task_runners import PrefectDaskFuture

from prefect_gpu_dask._compat import current_worker
from prefect_gpu_dask.errors import MissingResourceError
from prefect_gpu_dask.flow import cluster as clusters
from prefect_gpu_dask.flow import reporting
from prefect_gpu_dask.flow.prefect_api import close_workers_events, count_when_done, share_ephemeral_api
from prefect_gpu_dask.flow.recycling import Recycler, unsubscribe
from prefect_gpu_dask.flow.resource_wait import FailedRuns, ResourceWait, WorkerStartErrors, remember_task
from prefect_gpu_dask.flow.results import SCHEDULER_ERRORS
from prefect_gpu_dask.flow.routing import TagRouter, WorkerOffers
from prefect_gpu_dask.flow.submission import TaskSubmitter
from prefect_gpu_dask.records import (
    RECORD_TOPIC,
    UNHEALTHY_TOPIC,
    GPUQuarantine,
    RestartRecord,
    TaskRecord,
)
from prefect_gpu_dask.resources import uses_gpu
from prefect_gpu_dask.scheduler.metrics import GPUMetrics
from prefect_gpu_dask.scheduler.shared import SharedBlobs
from prefect_gpu_dask.settings import (
    GuardScope,
    OnMissingGPU,
    OnStall,
    RestartPolicy,
    RunnerSettings,
    check_cluster_kwargs,
    check_connection,
    parse_threshold,
)
from prefect_gpu_dask.worker.guard import GPUMemoryGuard
from prefect_gpu_dask.worker.labels import GPULabels
from prefect_gpu_dask.worker.stream import PromptStream

P = ParamSpec("P")
R = TypeVar("R")
_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(TaskRecord))

__all__ = ["GPUDaskTaskRunner", "MissingResourceError"]


def _record(values: tuple[Any, ...]) -> TaskRecord:
    return TaskRecord(**dict(zip(_RECORD_FIELDS, values, strict=True)))


class GPUDaskTaskRunner(DaskTaskRunner):
    """A Dask task runner that routes ``gpu``-tagged tasks to GPU workers and guards their memory.

    It takes ``prefect_dask.DaskTaskRunner``'s arguments, plus ``security`` and
    ``allow_insecure`` for remote clusters and the GPU settings of ``RunnerSettings``
    (the README's table lists them all). With no ``address`` or ``cluster_class`` it
    joins the user's host cluster where one runs (``prefect-gpu-dask cluster start``),
    or starts a ``LocalCUDACluster`` (one worker per GPU) where it finds GPUs, and a CPU
    ``LocalCluster`` otherwise, where ``gpu`` tasks run with a warning
    (``on_missing_gpu="cpu"``) or fail (``"error"``). After a flow run, ``records``,
    ``restarts`` and ``quarantines`` say what the guard saw, which workers were
    recycled and which GPUs were found sick.

    Example:
        ```python
        from prefect import flow, task
        from prefect_gpu_dask import GPUDaskTaskRunner, array_module

        @task(tags=["gpu"])
        def total(n: int) -> float:
            xp = array_module()          # cupy on a GPU worker, numpy otherwise
            return float(xp.arange(n).sum())

        @flow(task_runner=GPUDaskTaskRunner())
        def nightly() -> float:
            return total.submit(1000).result()

        if __name__ == "__main__":
            assert nightly() == 499500.0
        ```
    """

    def __init__(
        self,
        cluster: distributed.deploy.Cluster | None = None,
        address: str | None = None,
        cluster_class: str | Callable[..., distributed.deploy.Cluster] | None = None,
        cluster_kwargs: dict[str, Any] | None = None,
        adapt_kwargs: dict[str, Any] | None = None,
        client_kwargs: dict[str, Any] | None = None,
        performance_report_path: str | None = None,
        *,
        security: distributed.Security | None = None,
        allow_insecure: bool = False,
        tag_resources: Mapping[str, Mapping[str, float]] | None = None,
        on_missing_gpu: OnMissingGPU = "cpu",
        guard: GuardScope = "gpu",
        leak_threshold: int | str = "256MiB",
        memory_limit: float = 0.9,
        restart: RestartPolicy = "worker",
        restart_after_tasks: int | None = None,
        memory_probe: str | Callable[[], Any] | None = None,
        oom_retries: int = 0,
        gpu_wait_s: float = 60.0,
        health_check_s: float | None = 30.0,
        host_gpu_lock: bool = True,
        host_cluster: bool = True,
        stall_s: float | None = None,
        on_stall: OnStall = "warn",
    ):
        self.settings = RunnerSettings(
            tag_resources=tag_resources if tag_resources is not None else {},
            on_missing_gpu=on_missing_gpu,
            guard=guard,
            leak_threshold=parse_threshold(leak_threshold),
            memory_limit=memory_limit,
            restart=restart,
            restart_after_tasks=restart_after_tasks,
            memory_probe=memory_probe,
            oom_retries=oom_retries,
            gpu_wait_s=gpu_wait_s,
            health_check_s=health_check_s,
            host_gpu_lock=host_gpu_lock,
            host_cluster=host_cluster,
            stall_s=stall_s,
            on_stall=on_stall,
        )
        check_connection(address, security, allow_insecure)
        check_cluster_kwargs(cluster_kwargs)
        self.router = TagRouter(self.settings.tag_resources)
        self.security = security
        self.allow_insecure = allow_insecure
        self._user_client_kwargs = dict(client_kwargs or {})
        if security is not None:
            client_kwargs = {**self._user_client_kwargs, "security": security}
        # On a Dask worker (where Prefect re-creates the runner), or off the main thread
        # (Prefect loads a deployment's flow in a worker thread), the cluster class is not
        # imported yet: some (dask-jobqueue's) set a signal handler at import, which only the
        # main thread may do. Elsewhere it is imported here, so a typo fails at once.
        parent_class: str | Callable[..., Any] | None = cluster_class
        deferred = clusters.import_later(cluster_class)  # only ever a dotted name
        if deferred and isinstance(cluster_class, str):
            parent_class = functools.partial(clusters.resolve_cluster_class, cluster_class)
        super().__init__(
            cluster=cluster,
            address=address,
            cluster_class=parent_class,
            cluster_kwargs=cluster_kwargs,
            adapt_kwargs=adapt_kwargs,
            client_kwargs=client_kwargs,
            performance_report_path=performance_report_path,
        )
        if deferred:
            self.cluster_class, self.resolved_cluster_class = cluster_class, None
        self._offers: WorkerOffers | None = None
        self._recycler: Recycler | None = None
        self._resource_wait: ResourceWait | None = None
        self._submitter: TaskSubmitter | None = None
        self._can_grow = True  # workers may still join: tasks wait for their resources
        # As given: the client property sets address and adapt_kwargs as it connects, as
        # prefect-dask's does, and duplicate() must make the runner the user made.
        self._given_address, self._given_adapt_kwargs = address, dict(adapt_kwargs or {})
        self._guard_on = False
        self._flow_run_id: str | None = None
        self._on_ephemeral_api = False  # the flow run reports to the ephemeral server it shares
        self._flow_name: str | None = None  # keys the right-sizing history
        self._live: reporting.LivePublisher | None = None
        # This flow run's records as the subscription delivers them: reading them back with
        # get_events would fetch every flow run's records the scheduler keeps (up to
        # distributed.admin.low-level-log-length), a cost that grows with the cluster's age.
        # Each record's values only (a record's own attribute dict costs four times as much).
        self._heard: list[tuple[Any, ...]] = []
        self._made_cluster = False  # a cluster this runner built closes with the flow
        # What restarts and quarantines said once the flow run ended (``_forget_flow_run``).
        self._ended_restarts: tuple[RestartRecord, ...] = ()
        self._ended_quarantines: tuple[GPUQuarantine, ...] = ()

    # -- settings round-trip ------------------------------------------------------
    def _arguments(self) -> dict[str, Any]:
        """Every constructor argument but the live ``cluster`` object."""
        return dict(
            address=self._given_address,
            cluster_class=self.cluster_class,
            cluster_kwargs=self.cluster_kwargs,
            adapt_kwargs=self._given_adapt_kwargs,
            client_kwargs=self._user_client_kwargs,
            performance_report_path=self.performance_report_path,
            security=self.security,
            allow_insecure=self.allow_insecure,
            **self.settings.arguments(),
        )

    def duplicate(self) -> GPUDaskTaskRunner:
        # Prefect's flow engine runs the duplicate: a cluster the user passed in comes along.
        user_cluster = None if self._made_cluster else self._cluster
        return type(self)(cluster=user_cluster, **self._arguments())

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._arguments() == other._arguments()

    __hash__ = None  # type: ignore[assignment]  # mutable settings, like the parent

    def __reduce__(self) -> tuple[Any, ...]:
        # A runner travels to workers inside Prefect's context: send settings only,
        # never a live client, cluster or thread.
        return (functools.partial(type(self), **self._arguments()), ())

    # -- what happened ------------------------------------------------------------
    @property
    def restarts(self) -> tuple[RestartRecord, ...]:
        """Workers this runner recycled, in order."""
        return self._recycler.restarts if self._recycler is not None else self._ended_restarts

    @property
    def records(self) -> tuple[TaskRecord, ...]:
        """The guard's records of this flow run's tasks, in the order the scheduler got them.

        Heard through the runner's subscription, which delivers a task's record before
        its completion (the worker logs it first, and the client handles its stream in
        order).
        """
        if self._flow_run_id is None or not self._guard_on:
            return ()
        return tuple(r for r in map(_record, self._heard) if r.flow_run_id == self._flow_run_id)

    @property
    def quarantines(self) -> tuple[GPUQuarantine, ...]:
        """GPUs found unhealthy in this runner's cluster, the latest word on each."""
        if self._client is None or not self._guard_on:
            return self._ended_quarantines
        latest = {}
        for _, event in self._client.get_events(UNHEALTHY_TOPIC):
            record = GPUQuarantine.from_event(event)
            latest[record.worker] = record
        return tuple(sorted(latest.values(), key=lambda q: q.time))

    @property
    def worker_offers(self) -> WorkerOffers | None:
        """What the cluster's workers advertise, as routing last heard it."""
        return self._offers

    # -- cluster ------------------------------------------------------------------
    @property
    def client(self) -> PrefectDaskClient:
        if self._client is None:
            # Before the first subscription: on a shared cluster, another flow run's
            # hung-task and leak events reach this client too, and must not be taken for ours.
            self._note_flow_run()
            # A nanny of a cluster started here logs its worker's start error, which a
            # task that no worker can run then names.
            start_errors = WorkerStartErrors().attach()
            try:
                client = self._connect()
            finally:
                if self._made_cluster:
                    self._exit_stack.callback(start_errors.detach)
                else:
                    start_errors.detach()
            self._offers = offers = WorkerOffers.of_client(client)
            self._recycler = recycler = Recycler(
                client, self.settings.restart, self.logger, on_restart=self._on_restart, ours=self._ours
            )
            self._resource_wait = resource_wait = ResourceWait(
                client,
                offers,
                self.logger,
                self.settings.on_missing_gpu,
                on_interrupted=recycler.crash_interrupted,
                address=client.scheduler.address,
                start_errors=start_errors.texts,
                failed_runs=FailedRuns(recycler._futures.get, lambda: self._flow_run_id, self.logger),
            )
            # No worker at all: every task waits gpu_wait_s for one, on any cluster; a worker
            # being recycled is coming back.
            resource_wait.watch_workers(
                recycler.unfinished_keys,
                self.settings.gpu_wait_s,
                restarting=lambda: bool(recycler._pending),
            )
            recycler.start()
            self._submitter = submitter = TaskSubmitter(client, recycler, resource_wait, self.settings)
            self._register_plugins(client, offers, recycler)
            submitter.prepare_workers()
            return client
        return self._client

    def _connect(self) -> PrefectDaskClient:
        """prefect-dask's client, to this user's host cluster where it runs and answers,
        else to the cluster this runner starts or was given."""
        given = self.address, self.client_kwargs
        host = clusters.join_host_cluster(self)
        if host is not None:
            try:
                client = super().client
                self._can_grow = False  # its workers are all there
                return client
            except OSError as exc:  # alive but not answering: the flow run still runs
                self.logger.warning(
                    "Could not join the host cluster at %s (pid %d): %s; starting a cluster of this "
                    "flow run's own",
                    host.address,
                    host.pid,
                    exc,
                )
                self.address, self.client_kwargs = given
        self._can_grow = clusters.start(self)
        return super().client

    def _register_plugins(self, client: distributed.Client, offers: WorkerOffers, recycler: Recycler) -> None:
        """The labels and the prompt stream on every worker, the shared blobs' keeper on the
        scheduler, and the guard where the cluster has (or may get) a GPU.

        Registered on the scheduler: workers that join later get them too, and each
        decides for itself whether it has a GPU to label or guard.
        """
        self._register_optional(
            client, GPULabels(self.settings), GPULabels.name, "label GPU workers with their model and memory"
        )
        # Before any task run leaves its blobs there (``payload.SharedRef``).
        self._register_optional(
            client, SharedBlobs(), SharedBlobs.name, "keep the flow runs' task objects through a restart"
        )
        self._register_optional(
            client, PromptStream(), PromptStream.name, "let workers send to the scheduler promptly"
        )
        offered = offers.refresh()
        if self.settings.guard == "off":
            return
        if not offered:
            self.logger.warning(
                "The Dask cluster at %s has no worker yet: a task run that none joins for within "
                "gpu_wait_s=%g s fails",
                client.scheduler.address,
                self.settings.gpu_wait_s,
            )
        elif not any(uses_gpu(r) for r in offered) and not self._can_grow:
            self.logger.info("No GPU workers in this cluster: the GPU memory guard is a no-op")
            return
        self._live = reporting.LivePublisher(self.logger)
        # Counts what the guards report, for the scheduler's /metrics.
        self._register_optional(client, GPUMetrics(), GPUMetrics.name, "serve GPU metrics on the scheduler")
        # Heard before the guards start: a GPU found sick at setup is reported at once.
        client.subscribe_topic(RECORD_TOPIC, self._on_record)
        client.subscribe_topic(UNHEALTHY_TOPIC, self._on_unhealthy)
        client.register_plugin(GPUMemoryGuard(self.settings), name=GPUMemoryGuard.name)
        self._guard_on = True
        for quarantine in self.quarantines:  # found before this flow, on a shared cluster
            recycler.quarantined(quarantine)

    def _register_optional(
        self,
        client: distributed.Client,
        plugin: SchedulerPlugin | WorkerPlugin | NannyPlugin,
        name: str,
        serves: str,
    ) -> None:
        """Register ``plugin`` as ``name``: a feature (``serves``) the flow run can do without."""
        try:
            client.register_plugin(plugin, name=name)
        # A boundary: the plugin's setup runs on every worker (or the scheduler), where any
        # error of its own may come back, e.g. prefect-gpu-dask not installed there.
        except Exception as exc:
            self.logger.warning("Could not %s: %s", serves, exc)

    # -- submission ---------------------------------------------------------------
    # The overloads are prefect-dask's DaskTaskRunner's, which narrow TaskRunner's return
    # type to PrefectDaskFuture: mypy reports that on any subclass that mirrors them.
    @overload  # type: ignore[override]
    def submit(
        self,
        task: Task[P, Coroutine[Any, Any, R]],
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectDaskFuture[R]] | None = None,
        dependencies: dict[str, set[RunInput]] | None = None,
    ) -> PrefectDaskFuture[R]: ...

    @overload
    def submit(
        self,
        task: Task[Any, R],
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectDaskFuture[R]] | None = None,
        dependencies: dict[str, set[RunInput]] | None = None,
    ) -> PrefectDaskFuture[R]: ...

    def submit(  # type: ignore[misc]  # prefect-dask's implementation signature, as it is
        self,
        task: Task[P, R] | Task[P, Coroutine[Any, Any, R]],
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectDaskFuture[R]] | None = None,
        dependencies: dict[str, set[RunInput]] | None = None,
    ) -> PrefectDaskFuture[R]:
        if not self._started:
            raise RuntimeError("The task runner must be started before submitting work.")
        self._note_flow_run()
        self.client  # noqa: B018  # start the cluster before routing needs its workers
        # The client property built them with the client; only a flow run's end drops them.
        recycler, submitter = self._recycler, self._submitter
        if recycler is None or submitter is None:
            raise RuntimeError("The task runner's flow run has ended: enter it again to submit work.")
        # Routed under the recycler's hold: a worker being recycled is not "missing".
        with recycler.submissions():
            route = self.router.route(
                task.name,
                task.tags | TagsContext.get().current_tags,
                dask.get_annotations().get("resources"),
                self._offers,
                self.settings.on_missing_gpu,
                self._wait_s(),
                guard=self.settings.guard if self._guard_on else "off",
                timeout_s=task.timeout_seconds,
                oom_retries=self.settings.oom_retries,
                host_gpu_lock=self.settings.host_gpu_lock,
            )
            future = submitter.submit(task, route, parameters, wait_for, dependencies)
        remember_task(future, task)  # a run no worker starts gets its Failed record from it
        if self._on_ephemeral_api:  # its process keeps the server up until it is recorded
            count_when_done(future)
        return future

    @overload  # type: ignore[override]  # prefect-dask's overloads, as for submit
    def map(
        self,
        task: Task[P, Coroutine[Any, Any, R]],
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectFuture[Any]] | None = None,
    ) -> PrefectFutureList[PrefectDaskFuture[R]]: ...

    @overload
    def map(
        self,
        task: Task[P, R],
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectFuture[Any]] | None = None,
    ) -> PrefectFutureList[PrefectDaskFuture[R]]: ...

    def map(  # type: ignore[misc]  # prefect-dask's implementation signature, as it is
        self,
        task: Task[P, R],
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectFuture[Any]] | None = None,
    ) -> PrefectFutureList[PrefectDaskFuture[R]]:
        return super().map(task, parameters, wait_for)

    def _wait_s(self) -> float:
        """How long a task waits for a worker offering its resources: none where none can join."""
        return self.settings.gpu_wait_s if self._can_grow else 0.0

    def _note_flow_run(self) -> None:
        """Remember the flow run this runner serves, from the context it runs in."""
        ctx = FlowRunContext.get()
        if self._flow_run_id is None and ctx is not None and ctx.flow_run is not None:
            self._flow_run_id = str(ctx.flow_run.id)
            self._flow_name = ctx.flow.name if ctx.flow is not None else None

    def _ours(self, flow_run_id: str | None) -> bool:
        """Whether an event naming ``flow_run_id`` is about this runner's flow run."""
        return not self._flow_run_id or flow_run_id in (None, self._flow_run_id)

    # -- what the workers report --------------------------------------------------
    def _on_record(self, event: tuple[float, dict[str, Any]]) -> None:
        # Kept for the flow run (``records``): its texts (worker, flow run, verdict...)
        # shared between records, not one copy each as they arrive.
        record = TaskRecord.from_event(
            {k: sys.intern(v) if isinstance(v, str) else v for k, v in event[1].items()}
        )
        if not self._ours(record.flow_run_id):
            return
        self._heard.append(tuple(getattr(record, name) for name in _RECORD_FIELDS))
        # Both None only once the flow run ended: an event heard late changes nothing.
        if self._live is not None:
            self._live.publish(record)  # the artifact and the leak event, in the flow's context
        if record.restart_reason and self._recycler is not None:
            self._recycler.request(record.worker, record.restart_reason, record)

    def _on_unhealthy(self, event: tuple[float, dict[str, Any]]) -> None:
        quarantine = GPUQuarantine.from_event(event[1])
        # None only once the flow run ended: an event heard late changes nothing.
        if self._recycler is not None:
            self._recycler.quarantined(quarantine)
        if self._offers is not None:
            self._offers.refresh_soon()
        if self._live is not None:
            self._live.quarantined(quarantine)

    def _on_restart(self, restart: RestartRecord) -> None:
        # The recycler's thread calls this while the flow run holds them all.
        offers, recycler, resource_wait = self._offers, self._recycler, self._resource_wait
        if restart.lost and offers is not None and recycler is not None and resource_wait is not None:
            # What waited for that worker may have nowhere left to run. Submissions asking
            # for resources, routed from here on, see the worker gone and wait as for a
            # missing GPU; those routed before are tracked once the hold is taken.
            try:
                offers.refresh()
            except SCHEDULER_ERRORS as exc:  # the cluster closing, say: the stale answer expires soon
                self.logger.debug("Could not refresh the workers' offers: %r", exc)
            with recycler.submissions():
                unfinished = recycler.unfinished_keys()
            resource_wait.strand(unfinished, self._wait_s())
        reporting.emit_restart_event(restart)

    # -- context ------------------------------------------------------------------
    def __enter__(self) -> GPUDaskTaskRunner:
        super().__enter__()
        if current_worker() is None:  # a worker's engine enters a copy per task run
            self._on_ephemeral_api = share_ephemeral_api(self._exit_stack)
            try:
                clusters.start_worker_processes_soon(self)
            # A process or socket refused, the cluster class not importable: the first task
            # starts it, or reports why it cannot.
            except (OSError, ImportError, ValueError, RuntimeError) as exc:
                self.logger.debug("Could not start the worker processes' fork server early: %r", exc)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        # Only a runner that held a client ends a flow run; a worker enters a copy per task run.
        ran_flow = self._client is not None or self._made_cluster
        try:
            # A client that lost its scheduler would wait out its reconnect timeout.
            connected = self._client is not None and self._client.status == "running"
            if self._resource_wait is not None:
                self._resource_wait.close()
            if self._recycler is not None:
                # A remote cluster outlives the flow: finish its restarts. A local one is closing.
                self._recycler.close(wait=connected and not self._made_cluster)
            if self._submitter is not None and connected and not self._made_cluster:
                self._submitter.close()  # a scheduler that outlives the flow run keeps none of it
                if self._on_ephemeral_api:  # its workers outlive this process's server
                    close_workers_events(self._client)
            if self._live is not None:
                self._live.close()
            if self._guard_on and self._flow_run_id and connected:
                records, restarts, quarantines = self.records, self.restarts, self.quarantines
                self._ended_quarantines = quarantines
                if records or restarts or quarantines:
                    reporting.publish_artifacts(
                        self._flow_run_id, records, restarts, quarantines, self._flow_name, self.logger
                    )
            if self._guard_on and self._client is not None:
                unsubscribe(self._client, RECORD_TOPIC, UNHEALTHY_TOPIC)
        except Exception:
            self.logger.exception("Could not publish the GPU memory report")
        finally:
            try:
                super().__exit__(*exc_info)
            finally:
                if ran_flow:
                    self._forget_flow_run()

    def _forget_flow_run(self) -> None:
        """Drop what served the ended flow run but its records, restarts and quarantines.

        Prefect's own services (the API log and event workers) run asyncio tasks started
        in the flow run's context, which holds this runner: it outlives the flow run, and
        would keep the closed client, the cluster it closed (its scheduler's tasks and event
        log, on a local cluster) and the submitter's per-flow-run objects with it. A runner
        entered again starts or joins its cluster anew, as a new one does."""
        self._submitter = self._resource_wait = self._offers = None
        recycler = self._recycler
        if recycler is not None and (recycler._thread is None or not recycler._thread.is_alive()):
            self._ended_restarts, self._recycler = recycler.restarts, None
        if self._recycler is None:  # nothing left that would use the client
            self._client = None
        if self._made_cluster:  # closed with the flow run; duplicate() never passes it on
            self._cluster = None
            # prefect-dask leaves it untyped: mypy takes its type from its first assignment.
            self._connect_to = None  # type: ignore[assignment]
