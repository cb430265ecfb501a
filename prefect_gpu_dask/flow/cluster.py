"""Which Dask cluster the runner starts or joins, and where a started one may listen.

With no ``address`` and no ``cluster_class`` the runner asks NVML how many GPUs this
host has: one or more (and dask-cuda installed) gives a ``LocalCUDACluster`` with one
worker per GPU, each labelled ``GPU=1``; none gives a CPU ``LocalCluster``. Local
clusters bind to loopback only: GPU hosts are a favourite target for crypto-miners.

Their worker processes are forked from a server process that has already imported
Prefect, Dask and this package (``forkserver``). ``start`` and ``join_host_cluster`` set
what prefect-dask's ``client`` then connects to. Where the runner leaves the choice of
cluster open and the user runs a host cluster (``prefect-gpu-dask cluster start``,
``host_cluster``), it joins that.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import dask
import distributed
from distributed.comm import CommClosedError
from prefect.context import FlowRunContext

from prefect_gpu_dask import forkserver, jobqueue, nvml
from prefect_gpu_dask.flow.resource_wait import WRAPPERS, worker_start_error
from prefect_gpu_dask.host_cluster import FLOW_RUN_CLIENT, HostCluster, find_host_cluster
from prefect_gpu_dask.jobqueue import import_later as import_later  # the runner's
from prefect_gpu_dask.resources import GPU_RESOURCE

if TYPE_CHECKING:
    from prefect_gpu_dask.flow.runner import GPUDaskTaskRunner


LOOPBACK = "127.0.0.1"
# A scheduler the runner starts fails a task that no worker can run this long after
# gpu_wait_s, Dask's own backstop to the flow's wait (``flow.resource_wait``).
NO_WORKERS_KEY = "distributed.scheduler.no-workers-timeout"
NO_WORKERS_GRACE_S = 10.0
# More than one thread per GPU worker overlaps Python overhead with GPU work and lets
# a gpu task's own Dask graph run beside it (docs/performance.md). gpu-tagged tasks
# still take the GPU one at a time.
GPU_WORKER_THREADS = 8
PROFILE_INTERVAL = "distributed.worker.profile.interval"
DASK_PROFILE_INTERVAL = "10ms"
WORKER_PROFILE_INTERVAL = "100ms"
# A host cluster that does not answer this fast is not used: the flow run starts its own.
HOST_CLUSTER_CONNECT_S = 5


def has_dask_cuda() -> bool:
    # find_spec, not import: importing dask_cuda needs the CUDA runtime bindings.
    return importlib.util.find_spec("dask_cuda") is not None


def cluster_class_name(cluster_class: str | Callable[..., Any]) -> str:
    if isinstance(cluster_class, str):
        return cluster_class
    return f"{cluster_class.__module__}.{getattr(cluster_class, '__qualname__', cluster_class)}"


def is_local_cuda_cluster(cluster_class: str | Callable[..., Any]) -> bool:
    return cluster_class_name(cluster_class).rsplit(".", 1)[-1] == "LocalCUDACluster"


def is_local_cpu_cluster(cluster_class: str | Callable[..., Any]) -> bool:
    """``LocalCluster`` or a subclass of it (those bind where it binds)."""
    if isinstance(cluster_class, type) and issubclass(cluster_class, distributed.LocalCluster):
        return True
    return cluster_class_name(cluster_class).rsplit(".", 1)[-1] == "LocalCluster"


def default_is_cuda() -> bool:
    """Whether the default cluster here is a ``LocalCUDACluster``; dask-cuda not imported."""
    return bool(nvml.visible_gpu_count()) and has_dask_cuda()


def default_cluster_class(logger: logging.Logger) -> type:
    gpus = nvml.visible_gpu_count()
    if gpus and has_dask_cuda():
        from dask_cuda import LocalCUDACluster

        logger.info("Found %d GPU(s): starting a LocalCUDACluster, one worker per GPU", gpus)
        return LocalCUDACluster
    if gpus:
        logger.warning(
            "Found %d GPU(s) but dask-cuda is not installed (pip install "
            "'prefect-gpu-dask[cuda12]' or '[cuda13]'): starting a CPU LocalCluster",
            gpus,
        )
    else:
        logger.info("No GPU found: starting a CPU LocalCluster; gpu-tagged tasks run on CPU")
    return distributed.LocalCluster


def local_cluster_kwargs(
    cluster_class: str | Callable[..., Any], cluster_kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The user's kwargs plus our defaults: GPU labels and loopback-only sockets."""
    kwargs = dict(cluster_kwargs)
    if is_local_cuda_cluster(cluster_class):
        # LocalCUDACluster labels no resources by default, so gpu tasks would hang.
        kwargs.setdefault("resources", {GPU_RESOURCE: 1})
        kwargs.setdefault("threads_per_worker", GPU_WORKER_THREADS)
    if is_local_cuda_cluster(cluster_class) or is_local_cpu_cluster(cluster_class):
        # In-process clusters talk over inproc://, which takes no host.
        if "interface" not in kwargs and kwargs.get("processes", True):
            kwargs.setdefault("host", LOOPBACK)
        kwargs.setdefault("dashboard_address", f"{LOOPBACK}:0")
    # Defaults only where the class takes them: a subclass may narrow __init__.
    return {k: v for k, v in kwargs.items() if k in cluster_kwargs or _accepts(cluster_class, k)}


def _accepts(cluster_class: str | Callable[..., Any], name: str) -> bool:
    if isinstance(cluster_class, str):
        return True
    try:
        parameters = inspect.signature(cluster_class).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def adapt(cluster: Any, adapt_kwargs: dict[str, Any]) -> None:
    """``cluster.adapt(**adapt_kwargs)``, awaited where it is a coroutine or returns an
    awaitable (a cluster class built on an async API), in the cluster's own event loop."""
    if inspect.iscoroutinefunction(cluster.adapt):
        cluster.sync(cluster.adapt, **adapt_kwargs)
        return
    result = cluster.adapt(**adapt_kwargs)
    if inspect.isawaitable(result):
        cluster.sync(lambda: result)


def resolve_cluster_class(cluster_class: str | Callable[..., Any]) -> Callable[..., Any]:
    if callable(cluster_class):
        return cluster_class
    return jobqueue.import_cluster_class(cluster_class)  # dask-jobqueue's import wants the main thread


def local_cluster_config(gpu_wait_s: float | None) -> dict[str, Any]:
    """Dask settings for a cluster the runner starts, where the user kept Dask's default:
    with ``gpu_wait_s``, its scheduler fails a task no worker can run
    ``NO_WORKERS_GRACE_S`` after the flow's own wait would have."""
    config: dict[str, Any] = {}
    if gpu_wait_s is not None and dask.config.get(NO_WORKERS_KEY, None) is None:
        config[NO_WORKERS_KEY] = f"{gpu_wait_s + NO_WORKERS_GRACE_S:g}s"
    # Dask's statistical profiler walks every worker thread's stack each interval while
    # holding the worker's GIL, which each task run's Prefect engine needs too; a coarser
    # interval keeps the dashboard's profile.
    if dask.config.get(PROFILE_INTERVAL) == DASK_PROFILE_INTERVAL:
        config[PROFILE_INTERVAL] = WORKER_PROFILE_INTERVAL
    return config


def forks_workers(cluster_class: str | Callable[..., Any], kwargs: dict[str, Any]) -> bool:
    """Whether ``cluster_class(**kwargs)`` is a local cluster of worker processes, which
    fork from the server (``forkserver``)."""
    local = is_local_cuda_cluster(cluster_class) or is_local_cpu_cluster(cluster_class)
    return local and bool(kwargs.get("processes", True))


class ClosedCommTraceback(logging.Filter):
    """Keeps distributed's "Batched Comm Closed" line, and the error's own words, but
    drops its traceback.

    A local cluster's scheduler runs in this process; as the cluster closes, its stream
    to a worker that closed first ends in ``CommClosedError``, which distributed logs at
    INFO with the same few frames every time. In a flow's console that reads as a
    failure of a run that succeeded. Any other exception keeps its traceback.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(error := record.exc_info[1], CommClosedError):
            record.msg, record.args = f"{record.getMessage()}: {error!r}", ()
            record.exc_info = None
            record.exc_text = None
        return True


_CLOSED_COMM_FILTER = ClosedCommTraceback()


def start_local_cluster(
    cluster_class: Callable[..., Any], kwargs: dict[str, Any], stack: ExitStack, config: dict[str, Any]
) -> Any:
    """``cluster_class(**kwargs)`` under ``config``, closed with ``stack``; a local
    cluster's worker processes fork from the server (``forkserver``)."""
    logging.getLogger("distributed.batched").addFilter(_CLOSED_COMM_FILTER)  # once: it skips one it has
    if forks_workers(cluster_class, kwargs):
        stack.enter_context(forkserver.worker_processes(is_local_cuda_cluster(cluster_class)))
    with dask.config.set(config):
        return stack.enter_context(cluster_class(**kwargs))


def start_worker_processes_soon(runner: GPUDaskTaskRunner) -> None:
    """Where ``runner``'s first task will start a local cluster, start the fork server its
    workers fork from now, as a flow run enters the runner: the server's imports then run
    while the flow run begins, not after."""
    if runner._cluster is not None or runner.address or _has_default_client():
        return
    if _host_cluster(runner) is not None:
        return
    if runner.cluster_class:
        if forks_workers(runner.cluster_class, runner.cluster_kwargs):
            cuda = is_local_cuda_cluster(runner.cluster_class)
            forkserver.start_fork_server(cuda)
    elif runner.cluster_kwargs.get("processes", True):
        forkserver.start_fork_server(default_is_cuda())


def _has_default_client() -> bool:
    """A default client (the user's, or inside a Dask worker the parent's): prefect-dask
    uses it instead of starting a cluster."""
    try:
        distributed.get_client()
    except ValueError:
        return False
    return True


def join_host_cluster(runner: GPUDaskTaskRunner) -> HostCluster | None:
    """Where the runner leaves the choice of cluster to us and this user's host cluster
    runs: set the runner's ``address`` and ``client_kwargs`` for prefect-dask's ``client``
    to connect to it (as that property sets them itself), and return it."""
    if (host := _host_cluster(runner)) is None:
        return None
    runner.logger.info(
        "Joining this user's host cluster at %s (pid %d, %d worker(s), %d GPU(s))",
        host.address,
        host.pid,
        host.workers,
        host.gpus,
    )
    kwargs = {**runner.client_kwargs, "security": host.security}
    kwargs.setdefault("timeout", HOST_CLUSTER_CONNECT_S)
    runner.address, runner.client_kwargs = host.address, _named(kwargs)
    return host


def start(runner: GPUDaskTaskRunner) -> bool:
    """Start the cluster ``runner`` names (or make the user's cluster adaptive), for
    prefect-dask's ``client`` to connect to.

    Returns whether workers may still join (an ``address``, a ``cluster``, a non-local
    ``cluster_class`` or ``adapt_kwargs``): where they may, a task waits ``gpu_wait_s``
    for a worker offering its resources.
    """
    adapt_kwargs = runner.adapt_kwargs
    _start_cluster(runner)
    # Made adaptive just above: prefect-dask's client would call adapt() again, unawaited.
    runner.adapt_kwargs = {}
    runner.client_kwargs = _named(runner.client_kwargs)
    return not (
        runner._made_cluster and isinstance(runner._cluster, distributed.LocalCluster) and not adapt_kwargs
    )


def _named(client_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``client_kwargs`` with the client named after the flow run, so the scheduler and
    ``cluster status`` tell flow runs apart."""
    kwargs = dict(client_kwargs)
    if (context := FlowRunContext.get()) is not None and context.flow_run is not None:
        kwargs.setdefault("name", f"{FLOW_RUN_CLIENT}{context.flow_run.id}")
    return kwargs


def _host_cluster(runner: GPUDaskTaskRunner) -> HostCluster | None:
    """The user's host cluster, where this runner leaves the choice of cluster to us."""
    if not runner.settings.host_cluster or runner._cluster is not None or runner.address:
        return None
    if runner.cluster_class or runner.cluster_kwargs or runner.adapt_kwargs or _has_default_client():
        return None
    try:
        return find_host_cluster()
    except PermissionError as exc:  # a file or directory someone else could have written
        runner.logger.warning("Not joining a host cluster: %s", exc)
        return None


def _start_cluster(runner: GPUDaskTaskRunner) -> None:
    if runner._cluster is not None and runner.adapt_kwargs:
        adapt(runner._cluster, runner.adapt_kwargs)  # the user's cluster, made adaptive
    if runner._cluster is not None or runner.address or _has_default_client():
        return
    if runner.cluster_class:
        cluster_class = resolve_cluster_class(runner.cluster_class)
    else:
        cluster_class = default_cluster_class(runner.logger)
    kwargs = local_cluster_kwargs(cluster_class, runner.cluster_kwargs)
    kwargs = jobqueue.slurm_cluster_kwargs(cluster_class, kwargs, runner.logger)
    if runner.security is not None:
        kwargs.setdefault("security", runner.security)
    runner.logger.info("Creating a new Dask cluster with `%s`", cluster_class_name(cluster_class))
    config = local_cluster_config(runner.settings.gpu_wait_s)
    try:
        runner._cluster = start_local_cluster(cluster_class, kwargs, runner._exit_stack, config)
    except RuntimeError as exc:  # distributed's "Nanny failed to start": say the worker's own error
        why = worker_start_error(exc)
        if why is None and not any(words in str(exc) for words in WRAPPERS):
            raise
        # Older distributed (2026.7) raises without it: the worker's process logged it.
        why = why or f"{exc} (the worker's own error is in its log above)"
        name = cluster_class_name(cluster_class).rsplit(".", 1)[-1]
        raise RuntimeError(f"The {name} this flow run started could not start its workers: {why}") from exc
    runner._made_cluster = True
    if runner.adapt_kwargs:
        adapt(runner._cluster, runner.adapt_kwargs)
