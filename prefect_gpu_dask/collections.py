"""Computing a Dask collection from inside a ``gpu`` task.

A task that holds the worker's ``GPU`` slot and then waits for its own chunks would
deadlock if the chunks needed that slot or that thread. Here the chunks carry no
resource annotation, and the waiting thread leaves the worker's pool
(``worker_client`` secedes), so the chunks spread over every worker of the cluster,
this one included. On a one-worker cluster the chunks run in-process on the
threads scheduler instead: the same GPU, without a scheduler round trip per chunk.
"""

from __future__ import annotations

from typing import Any

import dask
import distributed


def compute_on_gpus(*collections: Any, **compute_kwargs: Any) -> tuple[Any, ...]:
    """``dask.compute`` for use inside a Prefect task running on a Dask worker."""
    try:
        distributed.get_worker()
    except ValueError:
        return dask.compute(*collections, **compute_kwargs)
    with distributed.worker_client() as client:
        workers = client.scheduler_info(n_workers=-1)["workers"]
        if len(workers) == 1:
            # With a distributed client around, Dask would plan P2P shuffles/rechunks,
            # which the threads scheduler cannot run: ask for task-based ones.
            tasks_based = {"dataframe.shuffle.method": "tasks", "array.rechunk.method": "tasks"}
            with dask.config.set(tasks_based):
                return dask.compute(*collections, scheduler="threads", **compute_kwargs)
        futures = client.compute(list(collections), **compute_kwargs)
        return tuple(client.gather(futures))
