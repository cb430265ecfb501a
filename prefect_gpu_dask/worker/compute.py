"""Computing a Dask collection from inside a ``gpu`` task.

A task that holds the worker's ``GPU`` slot and then waits for its own chunks would
deadlock if the chunks needed that slot or that thread. Here the chunks carry no
resource annotation, and the waiting thread leaves the worker's pool
(``worker_client`` secedes), so the chunks spread over every GPU worker of the
cluster, this one included.

How they spread: a GPU chunk often holds only milliseconds of kernel time, so the
distributed scheduler's per-task round trip (~1 ms, under the worker's GIL) is what
limits it. When this is the only GPU worker the graph runs in-process on the
threads scheduler. Otherwise, a graph that splits into independent pieces (maps, tree
reductions: each task's inputs come from one group of roots) runs as one
threads-scheduler call per GPU worker (this worker's share, if it is one, in the
calling thread), and only the few tasks that join the pieces run here
(``docs/performance.md`` has the figures). Graphs that do not split (shuffles, inputs already held by the
cluster) go to the distributed scheduler unchanged. Pieces run on the threads
scheduler, so Dask annotations on the collection (resources, retries) apply only on
that last path.
"""

from __future__ import annotations

import asyncio
import contextlib
import graphlib
import time
from collections.abc import Hashable, Mapping
from typing import Any

import dask
import distributed
from dask.sizeof import sizeof
from distributed.protocol import pickle

from prefect_gpu_dask import _compat
from prefect_gpu_dask.resources import scheduler_identity, uses_gpu

# Dask would plan P2P shuffles/rechunks with a distributed client around; the threads
# scheduler cannot run those.
TASKS_BASED = {"dataframe.shuffle.method": "tasks", "array.rechunk.method": "tasks"}
# Split only when the joining tasks are at most this share of the graph.
MAX_JOIN_SHARE = 0.25
PICKLE_RESULTS_UP_TO = 16 * 2**20


def gpu_workers(workers: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Addresses of GPU workers (all workers on a cluster without any), those taking
    tasks first, from the scheduler's ``identity()["workers"]``.

    A worker draining for a restart is left out while another can take its share; GPU
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
    me = worker.address
    with distributed.worker_client() as client:
        workers = gpu_workers(scheduler_identity(client)["workers"])
        if workers == [me]:
            with dask.config.set(TASKS_BASED):
                return dask.compute(
                    *collections, scheduler="threads", num_workers=_threads(), **compute_kwargs
                )
        if not compute_kwargs:
            with dask.config.set(TASKS_BASED):
                split = _split_compute(client, me, workers, collections)
            if split is not None:
                return split
        # GPU workers preferred, not required: one restarting must not strand the graph.
        placement = {"workers": workers, "allow_other_workers": True}
        futures = client.compute(list(collections), **{**placement, **compute_kwargs})
        return tuple(client.gather(futures))


def _split_compute(
    client: Any, me: str, workers: list[str], collections: tuple[Any, ...]
) -> tuple[Any, ...] | None:
    from dask.base import unpack_collections

    unpacked, repack = unpack_collections(*collections)
    if not unpacked:
        return collections
    graph, keys = _compat.finalized_graph(unpacked)
    plan = split_graph(graph, keys, len(workers))
    if plan is None:
        return None
    parts, join = plan
    shares = dict(zip(workers, parts, strict=True))
    own = shares.pop(me, None)
    sent_before = _compat.bytes_sent(client.scheduler_comm)
    remote = [
        # Pickled here: Dask would read the task objects inside as dependencies of this one.
        # distributed's pickle: the C pickler first, cloudpickle for lambdas and for
        # functions of the flow script's __main__.
        client.submit(
            _run_part,
            pickle.dumps(part),
            outputs,
            workers=[worker],
            allow_other_workers=True,  # a preference: a worker restarting meanwhile must not strand it
            pure=False,
        )
        for worker, (part, outputs) in shares.items()
    ]
    held: dict[Hashable, Any] = {}
    try:
        if own is not None:  # this thread has seceded: its GPU's share runs here, no round trip
            if remote and sent_before is not None:
                with contextlib.suppress(Exception):  # only a head start for the others
                    client.sync(_sent, client.scheduler_comm, sent_before, SEND_WAIT_S)
            part, outputs = own
            held.update(zip(outputs, _compute_part(part, outputs), strict=True))
        for produced in client.gather(remote):
            held.update(pickle.loads(produced) if isinstance(produced, bytes) else produced)
    except BaseException:
        client.cancel(remote)  # no GPU time for shares nobody will read
        raise
    del remote  # the remote copies go now, not when this function returns
    if join:
        final = {**{k: _compat.data_node(k, v) for k, v in held.items()}, **join}
        values = dask.get(final, keys) if keys else []
    else:
        values = [held[k] for k in keys]
    return repack(values)


SEND_WAIT_S = 0.05
SEND_POLL_S = 0.0005


async def _sent(comm: Any, bytes_before: int, timeout: float) -> None:
    """Return once the shares have left this process (or after ``timeout``).

    The calling thread's share holds the GIL for most of its kernel launches, so the
    worker's event loop, which writes the remote shares out, would wait for it.
    """
    deadline = time.monotonic() + timeout
    while (_compat.send_pending(comm) or _compat.bytes_sent(comm) == bytes_before) and (
        time.monotonic() < deadline
    ):
        await asyncio.sleep(SEND_POLL_S)


def _threads() -> int:
    """As many threads as this worker has: as much GPU work at once as the user allowed."""
    return _compat.current_worker().state.nthreads


def _compute_part(part: Mapping[Hashable, Any], outputs: list[Hashable]) -> tuple[Any, ...]:
    # The graph was built under TASKS_BASED on the caller: nothing left to configure here.
    return dask.threaded.get(part, outputs, num_workers=_threads())


def _run_part(pickled_part: bytes, outputs: list[Hashable]) -> bytes | dict[Hashable, Any]:
    """One remote share. Small results (partial reductions) travel faster as one pickle
    than one by one through Dask's device-aware serialisation; large ones (whole chunks)
    go that way, without the extra host copies a pickle makes."""
    values = dict(zip(outputs, _compute_part(pickle.loads(pickled_part), outputs), strict=True))
    return pickle.dumps(values) if sizeof(values) <= PICKLE_RESULTS_UP_TO else values


def _chunk_order(key: Hashable) -> tuple[str, tuple[int, ...], str]:
    """("x", 2, 10) before ("x", 10, 2): neighbouring chunks stay together."""
    if isinstance(key, tuple) and key and all(isinstance(i, int) for i in key[1:]):
        return str(key[0]), key[1:], ""
    return str(key), (), str(key)


def _roots_depth_first(
    dependencies: Mapping[Hashable, set[Hashable]], keys: list[Hashable]
) -> list[Hashable]:
    """Roots in the order a depth-first walk from the outputs meets them.

    Runs of this order are whole subtrees of a tree reduction, so cutting it into
    contiguous shares leaves few tasks to join and few partials to ship back.
    """
    order: list[Hashable] = []
    seen: set[Hashable] = set()
    stack = sorted(keys, key=_chunk_order, reverse=True)
    while stack:
        key = stack.pop()
        if key in seen:
            continue
        seen.add(key)
        if dependencies[key]:
            stack.extend(sorted(dependencies[key], key=_chunk_order, reverse=True))
        else:
            order.append(key)
    unreached = (key for key, deps in dependencies.items() if not deps and key not in seen)
    return order + sorted(unreached, key=_chunk_order)


def split_graph(
    graph: Mapping[Hashable, Any], keys: list[Hashable], n: int
) -> tuple[list[tuple[dict[Hashable, Any], list[Hashable]]], dict[Hashable, Any]] | None:
    """Split a task graph into ``n`` independent parts plus the tasks that join them.

    Roots are dealt out in contiguous runs of a depth-first order from the outputs (so
    each part holds whole subtrees); a task belongs to a part when all its inputs do. Returns
    ``([(part_graph, part_outputs), ...], join_graph)``, or None when the graph does
    not split well (too few roots, inputs from outside, a large join).
    """
    dependencies = {key: set(node.dependencies) for key, node in graph.items()}
    if any(dep not in graph for deps in dependencies.values() for dep in deps):
        return None  # reads data the cluster already holds: leave placement to Dask
    if n == 1:
        return [(dict(graph), list(keys))], {}
    roots = _roots_depth_first(dependencies, keys)
    if len(roots) < 2 * n:
        return None
    group: dict[Hashable, int | None] = {root: i * n // len(roots) for i, root in enumerate(roots)}
    for key in graphlib.TopologicalSorter(dependencies).static_order():
        if key not in group:
            owners = {group[dep] for dep in dependencies[key]}
            group[key] = owners.pop() if len(owners) == 1 else None
    join = {key: graph[key] for key, g in group.items() if g is None}
    if len(join) > max(n, MAX_JOIN_SHARE * len(graph)):
        return None
    wanted = set(keys) | {dep for key in join for dep in dependencies[key]}
    parts: list[tuple[dict[Hashable, Any], list[Hashable]]] = [({}, []) for _ in range(n)]
    for key, g in group.items():
        if g is not None:
            parts[g][0][key] = graph[key]
            if key in wanted:
                parts[g][1].append(key)
    return parts, join
