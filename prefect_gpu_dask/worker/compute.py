"""Computing a Dask collection from inside a ``gpu`` task.

A task that holds the worker's ``GPU`` slot and then waits for its own chunks would
deadlock if the chunks needed that slot or that thread. Here the chunks carry no
resource annotation, and the waiting thread leaves the worker's pool
(``distributed.worker_client`` secedes, and rejoins after): the distributed scheduler
places the chunks on the GPU workers taking work as the call starts, this one included
(where all of them leave meanwhile, the chunks fail after the scheduler's
``no-workers-timeout``, on clusters the runner starts). Where this is the only GPU
worker, the graph runs in-process on Dask's threads scheduler instead: no round trip
through the scheduler per chunk.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import dask
import dask.threaded
import distributed
from dask.system import CPU_COUNT

from prefect_gpu_dask import _compat
from prefect_gpu_dask.resources import scheduler_identity, uses_gpu
from prefect_gpu_dask.worker import task_threads

# Dask would plan P2P shuffles/rechunks with a distributed client around; the threads
# scheduler cannot run those.
TASKS_BASED = {"dataframe.shuffle.method": "tasks", "array.rechunk.method": "tasks"}
GRAPH_THREAD_PREFIX = "gpu-graph"
# ``dask.compute`` keywords of the threads scheduler alone, dropped on the distributed path.
THREADS_ONLY = frozenset({"scheduler", "num_workers", "pool", "get"})


def gpu_workers(workers: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Addresses of GPU workers (all workers on a cluster without any), those taking
    tasks first, from the scheduler's ``identity()["workers"]``.

    A worker draining for a restart is left out while another can take the chunks; GPU
    work never moves to CPU workers because the GPU ones are draining.
    """
    gpu = {a: w for a, w in workers.items() if uses_gpu(w.get("resources") or {})}
    candidates = gpu or workers
    running = [a for a, w in candidates.items() if w.get("status", "running") == "running"]
    return sorted(running or candidates)


def compute_on_gpus(*collections: Any, **compute_kwargs: Any) -> tuple[Any, ...]:
    """``dask.compute`` for use inside a Prefect task running on a Dask worker."""
    worker = _compat.current_worker()
    if worker is None:
        return dask.compute(*collections, **compute_kwargs)
    with distributed.worker_client() as client:
        workers = gpu_workers(scheduler_identity(client)["workers"])
        if workers == [worker.address]:
            in_place = {"scheduler": "threads"}
            if "num_workers" not in compute_kwargs:
                in_place.update(_graph_threads())
            with dask.config.set(TASKS_BASED):
                return dask.compute(*collections, **{**in_place, **compute_kwargs})
        # The threads scheduler's own keywords mean nothing to the distributed one.
        distributed_kwargs = {k: v for k, v in compute_kwargs.items() if k not in THREADS_ONLY}
        # Only there: a loose restriction would let idle CPU workers steal GPU chunks.
        futures = client.compute(list(collections), **{"workers": workers, **distributed_kwargs})
        try:
            return tuple(client.gather(futures))
        finally:
            # The chunks' results released before the guard reads the worker's memory, also
            # where an error's traceback keeps this frame. (Not cancelled: another task
            # computing the same collection shares its keys.)
            del futures


# dask's own threads-scheduler pool where this dask has it: chunks see the caller's
# contextvars (get_worker() among them); older dask's pools were plain.
if TYPE_CHECKING:
    _ContextPool = concurrent.futures.ThreadPoolExecutor
else:
    _ContextPool = getattr(
        dask.threaded, "ContextAwareThreadPoolExecutor", concurrent.futures.ThreadPoolExecutor
    )


class _GraphPool(_ContextPool):
    """The in-place pool: each chunk notes its thread for the guarded task that
    submitted it (``task_threads``), whose library allowance is per thread."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return super().submit(task_threads.noting(fn), *args, **kwargs)


def _graph_threads() -> dict[str, Any]:
    """How ``dask.threaded.get`` runs a graph here: on the in-place pool, except in one
    of that pool's own threads (a chunk computing a graph of its own), whose chunks
    would queue behind the chunk that waits for them; there Dask's pool for the
    calling thread, of the worker's thread count."""
    if threading.current_thread().name.startswith(GRAPH_THREAD_PREFIX):
        return {"num_workers": _threads()}
    return {"pool": _pool_of(max(_threads(), CPU_COUNT))}


@functools.cache
def _pool_of(size: int) -> concurrent.futures.ThreadPoolExecutor:
    """One pool per worker process, as many threads as Dask's threads scheduler would
    use (never fewer than the worker has): tasks at once share the cores, and the
    threads live on between tasks with their CUDA libraries' handles."""
    return _GraphPool(size, thread_name_prefix=GRAPH_THREAD_PREFIX)


def _threads() -> int:
    """As many threads as this worker has: as much GPU work at once as the user allowed."""
    return _compat.current_worker().state.nthreads
