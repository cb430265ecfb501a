"""Which Dask cluster to start, and where it may listen.

With no ``address`` and no ``cluster_class`` the runner asks NVML how many GPUs this
host has: one or more (and dask-cuda installed) gives a ``LocalCUDACluster`` with one
worker per GPU, each labelled ``GPU=1``; none gives a CPU ``LocalCluster``. Local
clusters bind to loopback only: GPU hosts are a favourite target for crypto-miners.

Their worker processes are forked from a server process that has already imported
Prefect, Dask and this package, rather than spawned to import them again: each worker
start, and each restart of a leaking worker, skips seconds of imports. The server never
touches CUDA or NVML, so every worker still makes its own CUDA context.
"""

from __future__ import annotations

import importlib.util
import inspect
import ipaddress
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import dask
import distributed
from distributed.proctitle import enable_proctitle_on_children

from prefect_gpu_dask import nvml
from prefect_gpu_dask.routing import GPU_RESOURCE

logger = logging.getLogger("prefect_gpu_dask.cluster")

LOOPBACK = "127.0.0.1"
# Schemes distributed can speak; anything else is a typo we refuse up front.
KNOWN_SCHEMES = {"tcp", "tls", "ucx", "ucxx", "inproc", "ws", "wss"}
PLAINTEXT_SCHEMES = {"tcp", "ws", "ucx", "ucxx"}
# More than one thread per GPU worker overlaps Python overhead with GPU work and lets
# a gpu task's own Dask graph run beside it (docs/performance.md). gpu-tagged tasks
# still take the GPU one at a time.
GPU_WORKER_THREADS = 8
START_METHOD_KEY = "distributed.worker.multiprocessing-method"
# What a worker process needs before its first task; imported once, in the fork server.
WORKER_PRELOAD = (
    "distributed",
    "dask",
    "numpy",
    "pandas",
    "prefect",
    "prefect.flows",
    "prefect.task_engine",
    "prefect_dask",
    "prefect_gpu_dask.submission",
    "prefect_gpu_dask.guard",
)


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


_fork_server_lock = threading.Lock()
_fork_server_surroundings: tuple[dict[str, str], str] | None = None
_forking_clusters = 0  # local clusters alive whose workers fork from the server
_users_start_method = "spawn"  # the setting before the first of them


def worker_start_method(cuda: bool = False, preload: Sequence[str] | None = None) -> str:
    """How a local cluster started now should start its worker processes.

    ``forkserver`` when the user left Dask's default (``spawn``) and the server this
    package started would give workers what ``spawn`` gives them: a forked worker
    inherits the server's environment, and its imports read settings files in the
    server's working directory, so a variable or directory changed since the server
    started means ``spawn`` for this cluster.
    ``cuda``: the cluster is a ``LocalCUDACluster``, which sets a variable of its own.
    ``preload``: what the server imports; by default those of ``WORKER_PRELOAD`` that
    this process has imported cleanly.
    """
    global _fork_server_surroundings
    with _fork_server_lock:
        configured = _users_start_method if _forking_clusters else dask.config.get(START_METHOD_KEY)
        if configured != "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
            return configured
        if cuda:
            os.environ["RAPIDS_NO_INITIALIZE"] = "True"  # as LocalCUDACluster's __init__ does
        if _fork_server_surroundings is None:
            # What a Nanny puts into this process's environment before each spawn goes
            # in first, as the Nanny would: its pre-spawn variables and hash seed.
            configured_env = dask.config.get("distributed.nanny.pre-spawn-environ") or {}
            pre_spawn = {k: os.environ.get(k, str(v)) for k, v in configured_env.items() if v is not None}
            if pre_spawn.get("PYTHONHASHSEED") in (None, "0"):
                pre_spawn["PYTHONHASHSEED"] = "6640"
            os.environ.update(pre_spawn)
            enable_proctitle_on_children()  # the Nanny sets this one before its first spawn too
            if preload is None:
                # Only what imported cleanly here: one module failing in the server, with
                # anything but ImportError, would fail every worker start.
                preload = [name for name in WORKER_PRELOAD if name in sys.modules]
            try:
                multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
                multiprocessing.forkserver.ensure_running()
            except Exception as exc:
                logger.warning("Could not start a fork server (%r): spawning workers", exc)
                return configured
            _fork_server_surroundings = _surroundings()
        return "forkserver" if _surroundings() == _fork_server_surroundings else "spawn"


@contextmanager
def worker_processes(cuda: bool = False) -> Iterator[str]:
    """For the life of one local cluster, restarts included: its worker start method.

    Dask reads the method from one process-wide setting, so it is counted: set by the
    first forking cluster, restored to the user's when the last one closes. While one
    is alive, a cluster that should spawn (a changed environment) cannot: its workers
    fork too.
    """
    global _forking_clusters, _users_start_method
    method = worker_start_method(cuda)
    if method != "forkserver":
        yield method
        return
    with _fork_server_lock:
        if _forking_clusters == 0:
            _users_start_method = dask.config.get(START_METHOD_KEY)
            dask.config.set({START_METHOD_KEY: "forkserver"})
        _forking_clusters += 1
    try:
        yield method
    finally:
        with _fork_server_lock:
            _forking_clusters -= 1
            if _forking_clusters == 0:
                dask.config.set({START_METHOD_KEY: _users_start_method})


def _surroundings() -> tuple[dict[str, str], str]:
    """What the server's imports saw, and a spawned worker would see: the environment
    (pytest rewrites one variable for every test; nothing a worker does reads it) and
    the working directory (Prefect reads its settings files there)."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}, os.getcwd()


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
    from prefect.utilities.importtools import from_qualified_name

    return from_qualified_name(cluster_class)


def check_address(address: str, *, secure: bool, allow_insecure: bool) -> None:
    """Refuse unknown schemes, and plaintext to a non-loopback host unless opted in."""
    scheme, _, rest = address.rpartition("://")
    scheme = scheme or "tcp"
    if scheme not in KNOWN_SCHEMES:
        raise ValueError(
            f"address {address!r}: unknown scheme {scheme!r} "
            f"(expected one of {', '.join(sorted(KNOWN_SCHEMES))})"
        )
    host = urlsplit(f"//{rest}").hostname or ""
    if scheme in PLAINTEXT_SCHEMES and not secure and not allow_insecure and not is_loopback(host):
        raise ValueError(
            f"address {address!r}: refusing a plaintext {scheme}:// connection to a "
            "non-loopback host. Use tls:// with security=distributed.Security(...), "
            "or pass allow_insecure=True if the network is private and firewalled."
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
