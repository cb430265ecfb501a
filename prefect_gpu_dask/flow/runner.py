"""``GPUDaskTaskRunner``: prefect-dask's runner, made GPU-aware. It wires the parts and
implements none of them.

It keeps ``prefect_dask.DaskTaskRunner``'s lifecycle (lazy client and cluster,
futures, ``map``, adapt, performance reports) and adds: the cluster it starts
(``cluster``), where each task runs (``routing``), a cheaper path for sending a task
run to a worker (``submission``), the per-task GPU memory guard on the workers
(``guard``), the restart path it feeds (``recycling``), and what the Prefect UI shows
(``reporting``). Like any subclass it uses prefect-dask's own ``_client``,
``_cluster``, ``_exit_stack`` and ``_started``.
"""

from __future__ import annotations

import contextvars
import functools
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import dask
import distributed
from prefect.context import FlowRunContext, TagsContext
from prefect.utilities.collections import visit_collection
from prefect_dask import DaskTaskRunner
from prefect_dask.task_runners import PrefectDaskFuture

from prefect_gpu_dask import forkserver
from prefect_gpu_dask.errors import MissingResourceError
from prefect_gpu_dask.flow import cluster as clusters
from prefect_gpu_dask.flow import reporting
from prefect_gpu_dask.flow.recycling import RecyclableFuture, Recycler, resolved
from prefect_gpu_dask.flow.resource_wait import ResourceWait
from prefect_gpu_dask.flow.routing import Route, TagRouter, WorkerOffers
from prefect_gpu_dask.flow.submission import TaskSubmitter
from prefect_gpu_dask.records import (
    HUNG_TOPIC,
    RECORD_TOPIC,
    UNHEALTHY_TOPIC,
    GPUQuarantine,
    HungTask,
    RestartRecord,
    TaskRecord,
)
from prefect_gpu_dask.resources import uses_gpu
from prefect_gpu_dask.scheduler.recycling import InterruptedTasks
from prefect_gpu_dask.settings import (
    GuardScope,
    OnMissingGPU,
    RestartPolicy,
    RunnerSettings,
    check_connection,
)
from prefect_gpu_dask.worker.deadline import deadline
from prefect_gpu_dask.worker.fallback import falling_back
from prefect_gpu_dask.worker.guard import PLUGIN_NAME, GPUMemoryGuard, guarding
from prefect_gpu_dask.worker.labels import GPULabels
from prefect_gpu_dask.worker.oom_retry import oom_retry_condition, placing
from prefect_gpu_dask.worker.taskwrap import stacked, with_around

CLONES_KEPT = 1024
# How long a scheduler keeps a task nobody can run before failing it ("error" mode).
NO_WORKERS_TIMEOUT = "10s"


__all__ = ["GPUDaskTaskRunner", "MissingResourceError"]


class GPUDaskTaskRunner(DaskTaskRunner):
    """A Dask task runner that routes ``gpu``-tagged tasks to GPU workers and guards their memory.

    With no ``address``/``cluster_class`` it starts a ``dask_cuda.LocalCUDACluster``
    (one worker per GPU, each labelled ``GPU=1``) when NVML finds GPUs and dask-cuda is
    installed, and a CPU ``distributed.LocalCluster`` otherwise; both listen on
    127.0.0.1 only. ``gpu`` tasks then run on CPU workers with a warning
    (``on_missing_gpu="cpu"``) or fail at once (``"error"``). On a cluster that can
    still grow (an ``address``, a ``cluster``, a non-local ``cluster_class`` or
    ``adapt_kwargs``) they first wait ``gpu_wait_s`` for a GPU worker to join.

    Args:
        cluster, address, cluster_class, cluster_kwargs, adapt_kwargs, client_kwargs,
            performance_report_path: as in ``prefect_dask.DaskTaskRunner``.
        security: a ``distributed.Security`` for ``tls://`` clusters.
        allow_insecure: allow a plaintext ``tcp://`` address to a non-loopback host.
        tag_resources: extra tag -> resources map, e.g. ``{"nvme": {"NVME": 1}}``.
        on_missing_gpu: ``"cpu"`` (run unrestricted, warn) or ``"error"`` (fail fast).
        guard: which tasks the GPU memory guard measures: ``"gpu"`` (GPU-tagged),
            ``"all"``, or ``"off"``.
        leak_threshold: bytes or a size string a task may leave on its GPU.
        memory_limit: fraction of GPU memory above which a worker is recycled.
        restart: ``"worker"`` (only the leaking one), ``"cluster"`` or ``"never"``.
        restart_after_tasks: recycle a GPU worker after this many guarded tasks.
        memory_probe: a callable returning a ``MemoryProbe`` (or its import path
            ``"package.module:factory"``) for the guard to read instead of NVML.
        oom_retries: retries for ``gpu`` task runs that fail on CUDA out-of-memory,
            on top of the task's own ``retries``.
        gpu_wait_s: seconds a task waits for a worker offering its resources on a
            cluster that can still grow, before ``on_missing_gpu`` applies.
        health_check_s: seconds between each GPU worker's NVML health checks (ECC,
            row remapping, critical Xids, a lost GPU, hardware slowdown), which also
            run before every ``gpu`` task; ``None`` turns them off. A sick GPU is
            quarantined: its ``gpu`` tasks move to healthy GPUs, or fail at once
            (``UnhealthyGPUError``) when none is left.

    After a flow run, ``runner.records`` holds its ``TaskRecord``s,
    ``runner.restarts`` the ``RestartRecord``s of the workers it recycled and
    ``runner.quarantines`` the ``GPUQuarantine``s of GPUs found unhealthy.

    Examples:
        Route a task to a GPU; it runs on CPU where there is none:
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

        Join a remote GPU cluster over TLS:
        ```python
        from distributed import Security
        GPUDaskTaskRunner(
            address="tls://gpu-scheduler:8786",
            security=Security(tls_ca_file="ca.pem", tls_client_cert="client.pem",
                              tls_client_key="client-key.pem", require_encryption=True),
        )
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
    ):
        self.settings = RunnerSettings(
            tag_resources=tag_resources if tag_resources is not None else {},
            on_missing_gpu=on_missing_gpu,
            guard=guard,
            leak_threshold=leak_threshold,
            memory_limit=memory_limit,
            restart=restart,
            restart_after_tasks=restart_after_tasks,
            memory_probe=memory_probe,
            oom_retries=oom_retries,
            gpu_wait_s=gpu_wait_s,
            health_check_s=health_check_s,
        )
        check_connection(address, security, allow_insecure)
        self.router = TagRouter(self.settings.tag_resources)
        self.security = security
        self.allow_insecure = allow_insecure
        self._user_client_kwargs = dict(client_kwargs or {})
        if security is not None:
            client_kwargs = {**self._user_client_kwargs, "security": security}
        # On a Dask worker (where Prefect re-creates the runner) the cluster class is not
        # imported: some (dask-jobqueue's) set a signal handler at import, which only the
        # main thread may do. The flow side imports it here, so a typo fails at once.
        deferred = isinstance(cluster_class, str) and _on_dask_worker()
        super().__init__(
            cluster=cluster,
            address=address,
            cluster_class=functools.partial(clusters.resolve_cluster_class, cluster_class)
            if deferred
            else cluster_class,
            cluster_kwargs=cluster_kwargs,
            adapt_kwargs=adapt_kwargs,
            client_kwargs=client_kwargs,
            performance_report_path=performance_report_path,
        )
        if deferred:
            self.cluster_class, self.resolved_cluster_class = cluster_class, None
        # Bounded: a flow that makes tasks on the fly (with_options in a loop) must not
        # keep every one of them alive.
        self._clones: OrderedDict[tuple[Any, ...], tuple[Any, Any]] = OrderedDict()
        self._offers: WorkerOffers | None = None
        self._recycler: Recycler | None = None
        self._resource_wait: ResourceWait | None = None
        self._can_grow = True  # workers may still join: tasks wait for their resources
        self._guard_on = False
        self._flow_run_id: str | None = None
        self._flow_name: str | None = None  # keys the right-sizing history
        self._flow_context: contextvars.Context | None = None
        self._live: reporting.LivePublisher | None = None
        self._made_cluster = False  # a cluster this runner built closes with the flow
        self._submitter = TaskSubmitter()

    # -- settings round-trip ------------------------------------------------------
    def _arguments(self) -> dict[str, Any]:
        """Every constructor argument but the live ``cluster`` object."""
        return dict(
            address=self.address,
            cluster_class=self.cluster_class,
            cluster_kwargs=self.cluster_kwargs,
            adapt_kwargs=self.adapt_kwargs,
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
        return self._recycler.restarts if self._recycler is not None else ()

    @property
    def records(self) -> tuple[TaskRecord, ...]:
        """The guard's records of this flow run's tasks, as the scheduler keeps them."""
        if self._client is None or self._flow_run_id is None or not self._guard_on:
            return ()
        events = self._client.get_events(RECORD_TOPIC)
        records = (TaskRecord.from_event(event) for _, event in events)
        return tuple(r for r in records if r.flow_run_id == self._flow_run_id)

    @property
    def quarantines(self) -> tuple[GPUQuarantine, ...]:
        """GPUs found unhealthy in this runner's cluster, the latest word on each."""
        if self._client is None or not self._guard_on:
            return ()
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
    def client(self):  # type: ignore[override]
        if self._client is None:
            self._start_local_cluster()
            # prefect-dask calls an existing cluster's adapt() without awaiting it: the
            # cluster this runner built or was given was made adaptive just above.
            adapt_kwargs, self.adapt_kwargs = self.adapt_kwargs, {}
            try:
                client = DaskTaskRunner.client.fget(self)
            finally:
                self.adapt_kwargs = adapt_kwargs
            self._offers = WorkerOffers.of_client(client)
            self._can_grow = not (
                self._made_cluster
                and isinstance(self._cluster, distributed.LocalCluster)
                and not self.adapt_kwargs
            )
            self._resource_wait = ResourceWait(
                client, self._offers, self.logger, self.settings.on_missing_gpu
            )
            self._recycler = Recycler(
                client,
                self.settings.restart,
                guard_name=PLUGIN_NAME,
                logger=self.logger,
                on_restart=self._on_restart,
            )
            self._flow_context = contextvars.copy_context()
            self._watch_worker_deaths(client)
            self._label_gpus(client)
            client.subscribe_topic(HUNG_TOPIC, self._on_hung)
            self._connect_guard(client)
        return self._client

    def _start_local_cluster(self) -> None:
        if self._cluster is not None and self.adapt_kwargs:
            clusters.adapt(self._cluster, self.adapt_kwargs)  # the user's cluster, made adaptive
        if self._cluster is not None or self.address:
            return
        try:
            distributed.get_client()
            return  # a default client (inside a Dask worker: the parent's): prefect-dask uses it
        except ValueError:
            pass
        if self.cluster_class:
            cluster_class = clusters.resolve_cluster_class(self.cluster_class)
        else:
            cluster_class = clusters.default_cluster_class(self.logger)
        kwargs = clusters.local_cluster_kwargs(cluster_class, self.cluster_kwargs)
        if self.security is not None:
            kwargs.setdefault("security", self.security)
        name = clusters.cluster_class_name(cluster_class)
        self.logger.info("Creating a new Dask cluster with `%s`", name)
        config = (
            {"distributed.scheduler.no-workers-timeout": NO_WORKERS_TIMEOUT}
            if self.settings.on_missing_gpu == "error" and not self.adapt_kwargs
            else {}
        )
        local = clusters.is_local_cpu_cluster(cluster_class) or clusters.is_local_cuda_cluster(cluster_class)
        if local and kwargs.get("processes", True):
            cuda = clusters.is_local_cuda_cluster(cluster_class)
            self._exit_stack.enter_context(forkserver.worker_processes(cuda))
        with dask.config.set(config):
            self._cluster = self._exit_stack.enter_context(cluster_class(**kwargs))
        self._made_cluster = True
        if self.adapt_kwargs:
            clusters.adapt(self._cluster, self.adapt_kwargs)

    def _watch_worker_deaths(self, client: distributed.Client) -> None:
        try:
            client.register_plugin(InterruptedTasks(), name=InterruptedTasks.name)
        except Exception as exc:  # e.g. prefect-gpu-dask not installed on the scheduler
            self.logger.warning(
                "Could not install %s on the scheduler (%s): a task whose worker dies may run a second time",
                InterruptedTasks.name,
                exc,
            )

    def _label_gpus(self, client: distributed.Client) -> None:
        try:
            client.register_plugin(GPULabels(self.settings), name=GPULabels.name)
        except Exception as exc:  # e.g. prefect-gpu-dask not installed on the workers
            self.logger.warning("Could not label GPU workers with their model and memory: %s", exc)

    def _connect_guard(self, client: distributed.Client) -> None:
        offered = self._offers.refresh()
        if self.settings.guard == "off":
            return
        if not any(uses_gpu(r) for r in offered) and not self._can_grow:
            self.logger.info("No GPU workers in this cluster: the GPU memory guard is a no-op")
            return
        # Registered on the scheduler: workers that join later get it too, and each
        # decides for itself whether it has a GPU to guard.
        self._live = reporting.LivePublisher(self.logger)
        # Heard before the guards start: a GPU found sick at setup is reported at once.
        client.subscribe_topic(RECORD_TOPIC, self._on_record)
        client.subscribe_topic(UNHEALTHY_TOPIC, self._on_unhealthy)
        client.register_plugin(GPUMemoryGuard(self.settings), name=PLUGIN_NAME)
        self._guard_on = True
        for quarantine in self.quarantines:  # found before this flow, on a shared cluster
            self._recycler.leave_alone(quarantine.worker, "its GPU is quarantined")

    # -- submission ---------------------------------------------------------------
    def submit(self, task, parameters, wait_for=None, dependencies=None):  # type: ignore[override]
        if not self._started:
            raise RuntimeError("The task runner must be started before submitting work.")
        self.client  # noqa: B018  # start the cluster before routing needs its workers
        if self._flow_run_id is None and (ctx := FlowRunContext.get()) is not None:
            self._flow_run_id = str(ctx.flow_run.id)
            self._flow_name = ctx.flow.name if ctx.flow is not None else None
        # Route under the recycler's hold: a worker being recycled is not "missing".
        with self._recycler.submissions():
            route = self.router.route(
                task.name,
                task.tags | TagsContext.get().current_tags,
                dask.get_annotations().get("resources"),
                self._offers,
                self.settings.on_missing_gpu,
                self.settings.gpu_wait_s if self._can_grow else 0.0,
            )
            task = self._task_for(task, route)
            annotate = dask.annotate(resources=route.resources) if route.resources else nullcontext()
            with annotate:
                wrapped = self._submitter.submit(
                    self._client,
                    task,
                    self._optimize_futures(parameters),
                    self._optimize_futures(wait_for) if wait_for else None,
                    dependencies,
                )
        if route.wait_s:
            self._resource_wait.add(wrapped.key, route.resources, route.wait_s)
        future = RecyclableFuture(wrapped_future=wrapped, task_run_id=wrapped.task_run_id)
        self._recycler.track(wrapped.key, future)
        return future

    def _task_for(self, task: Any, route: Route) -> Any:
        """The task as it is submitted: with what runs around it on the worker (a
        fallback notice, the guard, the deadline watchdog), or as it is."""
        arounds: dict[str, Callable[[], AbstractContextManager[Any]]] = {}
        if route.fallback is not None:
            waited_for = route.resources if route.wait_s else None
            arounds[route.message] = falling_back(route.message, route.fallback == "error", waited_for)
        if (route.fallback is None or route.wait_s) and (
            self._guard_on and (self.settings.guard == "all" or route.gpu)
        ):
            arounds["guard"] = guarding
        if task.timeout_seconds:
            arounds["deadline"] = deadline
        attributes: dict[str, Any] = {}
        placed = None
        if route.gpu and self.settings.oom_retries:
            if route.fallback is None or route.wait_s:
                placed = placing(route.resources)
            attributes = {
                "retries": task.retries + self.settings.oom_retries,
                "retry_condition_fn": oom_retry_condition(
                    self.settings.oom_retries, task.retries, task.retry_condition_fn
                ),
            }
        if not arounds and not attributes:
            return task
        # A retry's placement asks for the route's resources, which the tags in context may change.
        placement = tuple(sorted(route.resources.items())) if placed else ()
        key = (id(task), " + ".join([*arounds, *attributes]), placement)
        cached = self._clones.get(key)
        if cached is None or cached[0] is not task:
            # One clone per task object and purpose: Prefect's engine and the submitter's
            # pickle cache key on the task object.
            clone = with_around(task, stacked(*arounds.values()), placed, **attributes)
            cached = self._clones[key] = (task, clone)
            while len(self._clones) > CLONES_KEPT:
                self._clones.popitem(last=False)
        return cached[1]

    def _optimize_futures(self, expr: Any) -> Any:
        def visit(item: Any) -> Any:
            return resolved(item) if isinstance(item, PrefectDaskFuture) else item

        return visit_collection(expr, visit_fn=visit, return_data=True)

    def map(self, task, parameters, wait_for=None):  # type: ignore[override]
        return super().map(task, parameters, wait_for)

    # -- records and restarts -----------------------------------------------------
    def _on_record(self, event: tuple[float, dict[str, Any]]) -> None:
        record = TaskRecord.from_event(event[1])
        if self._flow_run_id and record.flow_run_id not in (None, self._flow_run_id):
            return
        if self._live is not None:  # the artifact and the leak event, in the flow's context
            self._live.publish(record)
        if record.restart_reason:
            self._recycler.request(record.worker, record.restart_reason, record)

    def _on_restart(self, restart: RestartRecord) -> None:
        reporting.emit_restart_event(restart)
        if restart.lost:  # what waited for that worker may have nowhere left to run
            wait_s = self.settings.gpu_wait_s if self._can_grow else 0.0
            self._resource_wait.strand(self._recycler.unfinished_keys(), wait_s)

    def _on_unhealthy(self, event: tuple[float, dict[str, Any]]) -> None:
        quarantine = GPUQuarantine.from_event(event[1])
        self._recycler.leave_alone(quarantine.worker, "its GPU is quarantined")
        self._offers.refresh_soon()
        if quarantine.withdrawn:
            self.logger.error(
                "Quarantined %s. Its gpu tasks go to the %d other GPU worker(s)",
                quarantine.describe(),
                quarantine.healthy_gpu_workers,
            )
        else:
            self.logger.error(
                "Quarantined %s. No healthy GPU is left: gpu tasks fail with UnhealthyGPUError",
                quarantine.describe(),
            )
        # Off Dask's event loop: the event goes out through the flow's Prefect client.
        threading.Thread(
            target=self._flow_context.copy().run,
            args=(reporting.emit_unhealthy_event, quarantine),
            name="gpu-unhealthy",
            daemon=True,
        ).start()

    def _on_hung(self, event: tuple[float, dict[str, Any]]) -> None:
        hung = HungTask.from_event(event[1])
        if self._flow_run_id and hung.flow_run_id not in (None, self._flow_run_id):
            return
        # Off Dask's event loop: marking the task run is a call to the Prefect API.
        threading.Thread(
            target=self._flow_context.copy().run, args=(self._time_out, hung), name="gpu-timeout", daemon=True
        ).start()

    def _time_out(self, hung: HungTask) -> None:
        """Mark a task run stuck past its deadline ``TimedOut`` and recycle its worker.

        The run will not run again: its worker's death sends it back to the scheduler,
        and the next worker finds the task run already final and returns that state.
        """
        from prefect.client.orchestration import get_client
        from prefect.states import Failed

        message = (
            f"Task run exceeded timeout of {hung.timeout_s:g} second(s) and was still running "
            f"{hung.running_s:g} s after its start, blocked outside Python on worker {hung.worker}; "
            "the worker is recycled"
        )
        self.logger.error("Task run %r: %s", hung.task_run_name, message)
        try:
            with get_client(sync_client=True) as api:
                api.set_task_run_state(
                    uuid.UUID(hung.task_run_id), Failed(name="TimedOut", message=message), force=True
                )
        except Exception:
            self.logger.exception("Could not mark task run %r TimedOut", hung.task_run_name)
        self._recycler.request(
            hung.worker,
            f"hung: {hung.task_run_name} past its {hung.timeout_s:g} s timeout",
            stuck=(hung.key,),
            worker_name=hung.worker_name,
        )

    def __enter__(self) -> GPUDaskTaskRunner:
        super().__enter__()
        self._share_ephemeral_api()
        return self

    def _share_ephemeral_api(self) -> None:
        """Point Dask workers at the flow's own ephemeral Prefect API.

        Without a ``PREFECT_API_URL`` every worker process would start a Prefect server
        of its own (seconds each) just to report task states.
        """
        from prefect.settings import (
            PREFECT_API_URL,
            PREFECT_SERVER_EPHEMERAL_ENABLED,
            temporary_settings,
        )

        if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
            return
        if _on_dask_worker():
            return
        from prefect.server.api.server import SubprocessASGIServer

        server = SubprocessASGIServer()
        server.start()  # already running for this flow: returns at once
        self._exit_stack.enter_context(temporary_settings({PREFECT_API_URL: server.api_url}))

    def __exit__(self, *exc_info: Any) -> None:
        try:
            # A client that lost its scheduler would wait out its reconnect timeout.
            connected = self._client is not None and self._client.status == "running"
            if self._resource_wait is not None:
                self._resource_wait.close()
            if self._recycler is not None:
                # A remote cluster outlives the flow: finish its restarts. A local one is closing.
                self._recycler.close(wait=connected and not self._made_cluster)
            if self._live is not None:
                self._live.close()
            if self._guard_on and self._flow_run_id and connected:
                records, restarts, quarantines = self.records, self.restarts, self.quarantines
                if records or restarts or quarantines:
                    reporting.publish_artifacts(
                        self._flow_run_id, records, restarts, quarantines, self._flow_name, self.logger
                    )
        except Exception:
            self.logger.exception("Could not publish the GPU memory report")
        finally:
            super().__exit__(*exc_info)


def _on_dask_worker() -> bool:
    try:
        distributed.get_worker()
        return True
    except ValueError:
        return False
