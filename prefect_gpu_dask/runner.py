"""``GPUDaskTaskRunner``: prefect-dask's runner, made GPU-aware.

It keeps ``prefect_dask.DaskTaskRunner``'s lifecycle (lazy client and cluster,
futures, ``map``, adapt, performance reports) and adds: the cluster it starts
(``cluster``), how task tags become Dask resources (``routing``), a cheaper path for
sending a task run to a worker (``submission``: prefect-dask re-serialises Prefect's
settings and flow context for every task), the per-task GPU memory guard (``guard`` +
``policy``, acted on by ``restarts``), and what the Prefect UI shows (``reporting``).
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from typing import Any, Literal

import dask
import distributed
from prefect.context import FlowRunContext, TagsContext
from prefect.utilities.collections import visit_collection
from prefect_dask import DaskTaskRunner
from prefect_dask.task_runners import PrefectDaskFuture

from prefect_gpu_dask import cluster as clusters
from prefect_gpu_dask import reporting
from prefect_gpu_dask.guard import RECORD_TOPIC, GPUMemoryGuard, guarded
from prefect_gpu_dask.policy import (
    GUARD_SCOPES,
    RESTART_POLICIES,
    GuardScope,
    GuardSettings,
    RestartPolicy,
)
from prefect_gpu_dask.restarts import RestartCoordinator
from prefect_gpu_dask.routing import TagRouter, satisfiable, uses_gpu
from prefect_gpu_dask.submission import TaskSubmitter

OnMissingGPU = Literal["cpu", "error"]
ON_MISSING_GPU = ("cpu", "error")
# How long a scheduler keeps a task nobody can run before failing it ("error" mode).
NO_WORKERS_TIMEOUT = "10s"
RESOURCE_REFRESH_S = 1.0
MISS_REFRESH_S = 0.1


class MissingResourceError(RuntimeError):
    """A task asked for a resource (e.g. a GPU) that no worker in the cluster offers."""


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def _with_fn(task: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Any:
    """A shallow copy of a Prefect task whose function is wrapped.

    ``functools.wraps`` keeps the signature, source and cache key of the original,
    so Prefect's parameter binding, caching and UI see the user's function.
    """
    clone = copy.copy(task)
    clone.fn = wrap(task.fn)
    return clone


def _announce_then_call(fn: Callable[..., Any], message: str, fail: bool) -> Callable[..., Any]:
    def say() -> None:
        if fail:
            raise MissingResourceError(message)
        from prefect.logging import get_run_logger

        get_run_logger().warning(message)

    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def announced_async(*args: Any, **kwargs: Any) -> Any:
            say()
            return await fn(*args, **kwargs)

        return announced_async

    @functools.wraps(fn)
    def announced(*args: Any, **kwargs: Any) -> Any:
        say()
        return fn(*args, **kwargs)

    return announced


class GPUDaskTaskRunner(DaskTaskRunner):
    """A Dask task runner that routes ``gpu``-tagged tasks to GPU workers and guards their memory.

    With no ``address``/``cluster_class`` it starts a ``dask_cuda.LocalCUDACluster``
    (one worker per GPU, each labelled ``GPU=1``) when NVML finds GPUs and dask-cuda is
    installed, and a CPU ``distributed.LocalCluster`` otherwise; both listen on
    127.0.0.1 only. ``gpu`` tasks then run on CPU workers with a warning
    (``on_missing_gpu="cpu"``) or fail at once (``"error"``).

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
    ):
        _choice("on_missing_gpu", on_missing_gpu, ON_MISSING_GPU)
        _choice("guard", guard, GUARD_SCOPES)
        _choice("restart", restart, RESTART_POLICIES)
        if security is not None and not isinstance(security, distributed.Security):
            raise ValueError(f"security={security!r} is not a distributed.Security")
        if address:
            clusters.check_address(
                address,
                secure=security is not None
                and bool(security.require_encryption or address.startswith("tls")),
                allow_insecure=allow_insecure,
            )
        self.guard_settings = GuardSettings(leak_threshold, memory_limit, restart_after_tasks, restart)
        self.router = TagRouter(tag_resources)
        self.security = security
        self.allow_insecure = allow_insecure
        self.on_missing_gpu: OnMissingGPU = on_missing_gpu
        self.guard: GuardScope = guard
        self.leak_threshold = leak_threshold
        self.memory_limit = memory_limit
        self.restart: RestartPolicy = restart
        self.restart_after_tasks = restart_after_tasks
        self._user_client_kwargs = dict(client_kwargs or {})
        if security is not None:
            client_kwargs = {**self._user_client_kwargs, "security": security}
        super().__init__(
            cluster=cluster,
            address=address,
            cluster_class=cluster_class,
            cluster_kwargs=cluster_kwargs,
            adapt_kwargs=adapt_kwargs,
            client_kwargs=client_kwargs,
            performance_report_path=performance_report_path,
        )
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._offered: list[dict[str, float]] = []
        self._offered_at = float("-inf")
        self._refreshing_offered = False
        self._wrapped_tasks: dict[tuple[int, str], tuple[Any, Any]] = {}
        self._futures: weakref.WeakValueDictionary[str, PrefectDaskFuture] = weakref.WeakValueDictionary()
        self._submit_lock = threading.RLock()
        self._restarts: RestartCoordinator | None = None
        self._guard_on = False
        self._flow_run_id: str | None = None
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
            tag_resources=self.router.tag_resources,
            on_missing_gpu=self.on_missing_gpu,
            guard=self.guard,
            leak_threshold=self.leak_threshold,
            memory_limit=self.memory_limit,
            restart=self.restart,
            restart_after_tasks=self.restart_after_tasks,
        )

    def duplicate(self) -> GPUDaskTaskRunner:
        return type(self)(**self._arguments())

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._arguments() == other._arguments()

    __hash__ = None  # type: ignore[assignment]  # mutable settings, like the parent

    def __reduce__(self) -> tuple[Any, ...]:
        # A runner travels to workers inside Prefect's context: send settings only,
        # never a live client, cluster or thread.
        return (functools.partial(type(self), **self._arguments()), ())

    # -- cluster ------------------------------------------------------------------
    @property
    def client(self):  # type: ignore[override]
        if self._client is None:
            self._start_local_cluster()
            client = DaskTaskRunner.client.fget(self)
            self._watch_worker_deaths(client)
            self._connect_guard(client)
        return self._client

    def _start_local_cluster(self) -> None:
        if self._cluster is not None or self.address:
            return
        try:
            distributed.get_client()
            return  # inside a Dask worker: the parent reuses that cluster
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
            if self.on_missing_gpu == "error"
            else {}
        )
        with dask.config.set(config):
            self._cluster = self._exit_stack.enter_context(cluster_class(**kwargs))

    def _watch_worker_deaths(self, client: distributed.Client) -> None:
        from prefect_gpu_dask.interrupted import InterruptedTasks

        try:
            client.register_plugin(InterruptedTasks(), name=InterruptedTasks.name)
        except Exception as exc:  # e.g. prefect-gpu-dask not installed on the scheduler
            self.logger.warning(
                "Could not install %s on the scheduler (%s): a task whose worker dies may run a second time",
                InterruptedTasks.name,
                exc,
            )

    def _connect_guard(self, client: distributed.Client) -> None:
        offered = self._offered_resources(force=True)
        if self.guard == "off":
            return
        if not any(uses_gpu(r) for r in offered) and not self.address:
            self.logger.info("No GPU workers in this cluster: the GPU memory guard is a no-op")
            return
        client.register_plugin(GPUMemoryGuard(self.guard_settings), name=GPUMemoryGuard.name)
        client.subscribe_topic(RECORD_TOPIC, self._on_record)
        self._restarts = RestartCoordinator(
            client,
            self.restart,
            detach=self._detach,
            lock=self._submit_lock,
            on_restart=self._on_restart,
            logger=self.logger,
            unfinished=self._unfinished,
        )
        self._guard_on = True

    def _offered_resources(
        self, force: bool = False, max_age: float = RESOURCE_REFRESH_S
    ) -> list[dict[str, float]]:
        """Resources each worker advertises, at most ``max_age`` seconds old."""
        now = time.monotonic()
        if force or now - self._offered_at > max_age:
            self._offered = _resources_of(self._client.scheduler_info(n_workers=-1))
            self._offered_at = now
        return self._offered

    def _offered_resources_soon(self) -> list[dict[str, float]]:
        """The last known resources; when older than ``RESOURCE_REFRESH_S``, asks the
        scheduler again in the background instead of on this submit.

        For routing a task that the last answer can run: the round trip (~8 ms from a
        busy flow process) fell on every gpu task submitted a second after the last.
        """
        if time.monotonic() - self._offered_at > RESOURCE_REFRESH_S and not self._refreshing_offered:
            self._refreshing_offered = True
            self._client.loop.add_callback(self._refresh_offered)
        return self._offered

    async def _refresh_offered(self) -> None:
        try:
            asked_at = time.monotonic()  # an answer is as old as its question
            self._offered = _resources_of(await self._client.scheduler.identity(n_workers=-1))
            self._offered_at = asked_at
        except Exception as exc:  # the next submit that needs it asks again
            self.logger.debug("Could not refresh worker resources: %s", exc)
        finally:
            self._refreshing_offered = False

    # -- submission ---------------------------------------------------------------
    def submit(self, task, parameters, wait_for=None, dependencies=None):  # type: ignore[override]
        if not self._started:
            raise RuntimeError("The task runner must be started before submitting work.")
        self.client  # noqa: B018  # start the cluster before routing needs its workers
        tags = task.tags | TagsContext.get().current_tags
        resources = self.router.resources_for_tags(tags)
        user = dask.get_annotations().get("resources")
        if user:
            resources = {**resources, **user}
        if self._flow_run_id is None and (ctx := FlowRunContext.get()) is not None:
            self._flow_run_id = str(ctx.flow_run.id)
        # Route under the lock a restart holds: a worker being recycled is not "missing".
        with self._submit_lock:
            task, resources = self._prepare(task, resources)
            annotate = dask.annotate(resources=resources) if resources else nullcontext()
            with annotate:
                wrapped = self._submitter.submit(
                    self._client,
                    task,
                    self._optimize_futures(parameters),
                    self._optimize_futures(wait_for) if wait_for else None,
                    dependencies,
                )
        future = PrefectDaskFuture(wrapped_future=wrapped, task_run_id=wrapped.task_run_id)
        self._futures[wrapped.key] = future
        return future

    def _prepare(self, task: Any, resources: dict[str, float]) -> tuple[Any, dict[str, float]]:
        """Wrap the task's function for the guard or the missing-resource policy.

        Returns the task to submit and the resources it may still ask for.
        """
        if resources and not self._satisfiable(resources):
            offered = self._offered_resources()
            message = (
                f"Task {task.name!r} asked for resources {resources} but no worker offers them "
                f"(workers offer {offered or 'nothing'})"
            )
            if self.on_missing_gpu == "cpu":
                notice = f"{message}: running on CPU instead (on_missing_gpu='cpu')"
            else:
                notice = f"{message} (on_missing_gpu='error')"
            fail = self.on_missing_gpu == "error"
            wrap = functools.partial(_announce_then_call, message=notice, fail=fail)
            return self._wrapped(task, notice, wrap), {}
        if self._guard_on and (self.guard == "all" or uses_gpu(resources)):
            return self._wrapped(task, "guard", guarded), resources
        return task, resources

    def _satisfiable(self, resources: dict[str, float]) -> bool:
        if satisfiable(resources, self._offered_resources_soon()):
            return True
        # A worker may just have joined: look again, but not on every submit.
        return satisfiable(resources, self._offered_resources(max_age=MISS_REFRESH_S))

    def _wrapped(self, task: Any, kind: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Any:
        key = (id(task), kind)
        cached = self._wrapped_tasks.get(key)
        if cached is None or cached[0] is not task:
            cached = self._wrapped_tasks[key] = (task, _with_fn(task, wrap))
        return cached[1]

    def _optimize_futures(self, expr: Any) -> Any:
        def visit(item: Any) -> Any:
            if isinstance(item, PrefectDaskFuture):
                # A detached future's result moved to the flow before a restart.
                return item._final_state if getattr(item, "_detached", False) else item.wrapped_future
            return item

        return visit_collection(expr, visit_fn=visit, return_data=True)

    def map(self, task, parameters, wait_for=None):  # type: ignore[override]
        return super().map(task, parameters, wait_for)

    # -- guard events and restarts ------------------------------------------------
    def _on_record(self, event: tuple[float, dict[str, Any]]) -> None:
        _, record = event
        if self._flow_run_id and record.get("flow_run_id") not in (None, self._flow_run_id):
            return
        if record["verdict"] == "leak":
            reporting.emit_leak_event(record)
        if record.get("restart_reason") and self._restarts is not None:
            self._restarts.request(record)

    def _on_restart(self, info: dict[str, Any]) -> None:
        reporting.emit_restart_event(info)

    def _unfinished(self) -> int:
        """Futures of this flow whose results the client has not seen yet."""
        futures = list(self._futures.values())
        return sum(not (getattr(f, "_detached", False) or f.wrapped_future.done()) for f in futures)

    def _detach(self, keys: Iterable[str]) -> None:
        """Pull the Prefect states held under ``keys`` into the flow, then let Dask forget them."""
        futures = {key: f for key in keys if (f := self._futures.get(key)) is not None}
        states = self._client.gather({k: f.wrapped_future for k, f in futures.items()}, errors="skip")
        for key, state in states.items():
            future = futures[key]
            future._final_state = state
            future._detached = True
            future.wrapped_future.release()

    def _records(self) -> list[dict[str, Any]]:
        events = self._client.get_events(RECORD_TOPIC)
        return [r for _, r in events if r.get("flow_run_id") == self._flow_run_id]

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
        try:
            distributed.get_worker()
            return
        except ValueError:
            pass
        from prefect.server.api.server import SubprocessASGIServer

        server = SubprocessASGIServer()
        server.start()  # already running for this flow: returns at once
        self._exit_stack.enter_context(temporary_settings({PREFECT_API_URL: server.api_url}))

    def __exit__(self, *exc_info: Any) -> None:
        try:
            # A client that lost its scheduler would wait out its reconnect timeout.
            connected = self._client is not None and self._client.status == "running"
            if self._restarts is not None:
                # A remote cluster outlives the flow: finish its restarts. A local one is closing.
                self._restarts.close(wait=connected and (self._cluster is None or bool(self.address)))
            if self._guard_on and self._flow_run_id and connected:
                records = self._records()
                restarts = self._restarts.restarts if self._restarts else []
                if records or restarts:
                    reporting.publish_artifacts(self._flow_run_id, records, restarts)
        except Exception:
            self.logger.exception("Could not publish the GPU memory report")
        finally:
            super().__exit__(*exc_info)


def _resources_of(scheduler_identity: Mapping[str, Any]) -> list[dict[str, float]]:
    """What each worker advertises, from the scheduler's ``identity`` answer."""
    return [w.get("resources") or {} for w in scheduler_identity["workers"].values()]
