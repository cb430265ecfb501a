"""Worker processes forked from a server that has already imported Prefect, Dask and
this package, instead of spawned to import them again.

Each worker start, and each restart of a leaking worker, skips seconds of imports. The
flow process uses it for the local clusters the runner starts
(``flow.cluster``); a remote worker's nanny uses it through ``worker.nanny``. The
server never touches CUDA or NVML, so every worker still makes its own CUDA context.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import dask
from distributed.proctitle import enable_proctitle_on_children

from prefect_gpu_dask import _compat

logger = logging.getLogger(__name__)

START_METHOD_KEY = "distributed.worker.multiprocessing-method"
# What a worker process needs before its first task; imported once, in the fork server.
WORKER_PRELOAD = (
    "distributed",
    "dask",
    "numpy",
    "pandas",
    # Where the flow uses it: a worker importing it in a task's thread while a task
    # arriving beside it (a ``compute_on_gpus`` chunk) unpickles one of its submodules
    # deadlocks on CPython's import locks, which fails one of the two.
    "dask.array",
    "prefect",
    "prefect.flows",
    "prefect.task_engine",
    "prefect_dask",
    "prefect_gpu_dask.worker.taskrun",
    "prefect_gpu_dask.worker.guard",
)
# What a CUDA worker imports as it starts (dask-cuda, for its preload), before it
# registers: imported once in the server, it leaves each GPU worker's start only CUDA's
# own. The import makes no CUDA call, so workers still fork from a process that never
# initialised CUDA.
CUDA_WORKER_PRELOAD = ("prefect_gpu_dask.worker.fork_server_cuda",)


_fork_server_lock = threading.Lock()
_fork_server_surroundings: tuple[dict[str, str], str] | None = None
_forking_clusters = 0  # local clusters alive whose workers fork from the server
_started_early = False  # by start_fork_server, and no cluster's workers forked from it yet
_fork_server_cuda = False  # the server imported what CUDA workers import
_fork_server_preload: frozenset[str] = frozenset()  # what the server imported
_users_start_method = "spawn"  # the setting before the first of them


def worker_start_method(cuda: bool = False, preload: Sequence[str] | None = None, early: bool = False) -> str:
    """How a local cluster started now should start its worker processes.

    ``forkserver`` when the user left Dask's default (``spawn``) and the server this
    package started would give workers what ``spawn`` gives them: a forked worker
    inherits the server's environment, and its imports read settings files in the
    server's working directory, so a variable or directory changed since the server
    started means ``spawn`` for this cluster, and a warning; unless no worker forked from
    a server started ``early`` (ahead of its cluster) yet: that one is replaced by a
    server in today's environment, as it is by one that imports what this process has
    imported since (``dask.array``). A call that is not ``early`` marks the server used.
    What a Nanny puts into this process's environment before its first worker start goes
    in first, as the Nanny would: its pre-spawn variables and hash seed.
    ``cuda``: the cluster is a ``LocalCUDACluster``, which sets a variable of its own,
    and its workers import dask-cuda (a server without it, that no live cluster forks
    from, is replaced by one with it). ``preload``: what the server imports; by default
    those of ``WORKER_PRELOAD`` that this process has imported cleanly.
    """
    global _fork_server_surroundings, _started_early, _fork_server_cuda, _fork_server_preload
    with _fork_server_lock:
        configured = _users_start_method if _forking_clusters else dask.config.get(START_METHOD_KEY)
        if configured != "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
            return configured
        if preload is None:
            # Only what imported cleanly here (this package's own modules import
            # wherever it does): one module failing in the server, with anything but
            # ImportError, would fail every worker start.
            preload = [name for name in WORKER_PRELOAD if name in sys.modules or _ours(name)]
        os.environ.update(_worker_environ(cuda))
        enable_proctitle_on_children()  # the Nanny sets this one before its first spawn too
        moved = _started_early and _surroundings() != _fork_server_surroundings
        # A flow that imported dask.array after its runner started the server early.
        lacks_modules = _started_early and not set(preload) <= _fork_server_preload
        lacks_cuda = cuda and not _fork_server_cuda and not _forking_clusters
        if _fork_server_surroundings is not None and (moved or lacks_modules or lacks_cuda):
            # No worker forked from it yet, or none of a cluster still alive: a new
            # server in today's environment costs what starting it now would have.
            _stop_server()
        if _fork_server_surroundings is None:
            try:
                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload(server_preload(preload, cuda))
                multiprocessing.forkserver.ensure_running()
            # No forkserver on this platform (ValueError), a fork or its pipe failing.
            except (OSError, ValueError, RuntimeError) as exc:  # said once, by the cluster's start
                logger.log(
                    logging.DEBUG if early else logging.WARNING,
                    "Could not start a fork server (%r): spawning workers",
                    exc,
                )
                return configured
            _fork_server_surroundings = _surroundings()
            _started_early = early
            _fork_server_cuda = cuda
            _fork_server_preload = frozenset(preload)
        if (now := _surroundings()) == _fork_server_surroundings:
            if not early:  # a cluster's workers fork from it now
                _started_early = False
            return "forkserver"
        if not early:
            logger.warning(
                "Spawning this cluster's worker processes, which is slower than forking them: "
                "%s changed since the fork server started",
                _changes(_fork_server_surroundings, now),
            )
        return "spawn"


def server_preload(preload: Sequence[str], cuda: bool) -> list[str]:
    """What the server imports, in order: ``preload``, then dask-cuda for CUDA workers."""
    return [*preload, *(CUDA_WORKER_PRELOAD if cuda else ())]


def start_fork_server(cuda: bool = False) -> None:
    """Start the server now (as a flow run enters its runner), ahead of the local cluster
    whose workers will fork from it, and leave this process's environment as it was: the
    variables a Nanny sets before its first worker start are set when that cluster
    starts, not before."""
    saved = dict(os.environ)
    try:
        worker_start_method(cuda, early=True)
    finally:
        for name in os.environ.keys() - saved.keys():
            del os.environ[name]
        os.environ.update({name: value for name, value in saved.items() if os.environ.get(name) != value})


def _stop_server() -> None:
    """Stop the server; the next start makes a new one. The caller holds the lock."""
    global _fork_server_surroundings, _started_early
    _started_early = False
    try:
        _compat.stop_fork_server()
    except (AttributeError, OSError) as exc:  # a Python without ForkServer._stop, a server gone
        logger.debug("Could not stop the fork server: %r", exc)
        return
    _fork_server_surroundings = None


def _worker_environ(cuda: bool) -> dict[str, str]:
    """What a Nanny (and a ``LocalCUDACluster``) put into this process's environment
    before starting a worker: a variable already set keeps its value."""
    configured = dask.config.get("distributed.nanny.pre-spawn-environ") or {}
    environ = {k: os.environ.get(k, str(v)) for k, v in configured.items() if v is not None}
    if environ.get("PYTHONHASHSEED") in (None, "0"):
        environ["PYTHONHASHSEED"] = "6640"
    if cuda:
        environ["RAPIDS_NO_INITIALIZE"] = "True"  # as LocalCUDACluster's __init__ does
    return environ


@contextmanager
def worker_processes(cuda: bool = False) -> Iterator[str]:
    """For the life of one local cluster, restarts included: its worker start method.

    Dask reads the method from one process-wide setting, so it is counted: set by the
    first forking cluster, restored to the user's when the last one closes. While one
    is alive, a cluster that should spawn (a changed environment) cannot: its workers
    fork too.
    """
    global _forking_clusters, _users_start_method, _started_early
    method = worker_start_method(cuda)
    if method != "forkserver":
        yield method
        return
    with _fork_server_lock:
        _started_early = False
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


def _changes(then: tuple[dict[str, str], str], now: tuple[dict[str, str], str]) -> str:
    """What differs, by name only (values may be secrets)."""
    (env_then, cwd_then), (env_now, cwd_now) = then, now
    names = sorted(k for k in env_then.keys() | env_now.keys() if env_then.get(k) != env_now.get(k))
    changed = [f"${name}" for name in names] + (["the working directory"] if cwd_then != cwd_now else [])
    return ", ".join(changed)


def _ours(module: str) -> bool:
    return module.partition(".")[0] == __name__.partition(".")[0]
