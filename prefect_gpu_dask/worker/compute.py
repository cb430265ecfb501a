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
calling thread; the others sent straight to their workers, ``ShareServer``, or as tasks
where a worker does not serve them), and only the few tasks that join the pieces run here
(``docs/performance.md`` has the figures). Graphs that do not split (shuffles, inputs already held by the
cluster) go to the distributed scheduler unchanged. Pieces run on the threads
scheduler, so Dask annotations on the collection (resources, retries) apply only on
that last path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import graphlib
import importlib
import io
import logging
import pickle as stdlib_pickle
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import dask
import dask.threaded
import distributed
from dask.sizeof import sizeof
from dask.system import CPU_COUNT
from distributed.core import Status
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import pickle, to_serialize

from prefect_gpu_dask import _compat

if TYPE_CHECKING:
    from dask.typing import Key
from prefect_gpu_dask.resources import scheduler_identity, uses_gpu
from prefect_gpu_dask.worker import task_threads
from prefect_gpu_dask.worker.share_balance import graph_shape, share_sizes, share_speeds

logger = logging.getLogger(__name__)

# Dask would plan P2P shuffles/rechunks with a distributed client around; the threads
# scheduler cannot run those.
TASKS_BASED = {"dataframe.shuffle.method": "tasks", "array.rechunk.method": "tasks"}
# Split only when the joining tasks are at most this share of the graph.
MAX_JOIN_SHARE = 0.25
PICKLE_RESULTS_UP_TO = 16 * 2**20
# The op a worker serves shares on, sent straight from the calling worker; also the
# custom metric by which the scheduler's identity says a worker serves it.
SHARE_OP = "prefect_gpu_dask_share"
SHARE_TOPIC = "prefect-gpu-dask-share"
SHARE_ERROR = "share-error"
SHARE_THREAD_PREFIX = "gpu-share"
ANSWER_POLL_S = 1.0


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
        identity = scheduler_identity(client)["workers"]
        workers = gpu_workers(identity)
        if workers == [me]:
            in_place = {"scheduler": "threads"}
            if "num_workers" not in compute_kwargs:
                in_place.update(_graph_threads())
            with dask.config.set(TASKS_BASED):
                return dask.compute(*collections, **{**in_place, **compute_kwargs})
        if not compute_kwargs:
            with dask.config.set(TASKS_BASED):
                split = _split_compute(client, me, workers, serving_shares(identity), collections)
            if split is not None:
                return split
        # GPU workers preferred, not required: one restarting must not strand the graph.
        placement = {"workers": workers, "allow_other_workers": True}
        futures = client.compute(list(collections), **{**placement, **compute_kwargs})
        return tuple(client.gather(futures))


def serving_shares(workers: Mapping[str, Mapping[str, Any]]) -> set[str]:
    """Workers that serve shares sent straight to them (``ShareServer``), from the
    scheduler's ``identity()["workers"]``."""
    return {a for a, w in workers.items() if (w.get("metrics") or {}).get(SHARE_OP)}


def _split_compute(
    client: Any, me: str, workers: list[str], serving: set[str], collections: tuple[Any, ...]
) -> tuple[Any, ...] | None:
    from dask.base import unpack_collections

    unpacked, repack = unpack_collections(*collections)
    if not unpacked:
        return collections
    finalized = _compat.finalized_graph(unpacked)
    if finalized is None:  # dask's graph internals moved: computed whole, as Dask would
        return None
    graph, keys = finalized
    shape = graph_shape(graph, keys)
    plan = split_graph(graph, keys, len(workers), share_speeds.speeds(shape, workers))
    if plan is None:
        return None
    parts, join = plan
    shares = dict(zip(workers, parts, strict=True))
    own = shares.pop(me, None)
    # Pickled here: Dask would read the task objects inside as dependencies of a task.
    # distributed's pickle: the C pickler first, cloudpickle for lambdas and for functions
    # of the flow script's __main__.
    pickled = {worker: (pickle.dumps(part), outputs) for worker, (part, outputs) in shares.items()}
    asked = {w: _ask(w, *share) for w, share in pickled.items() if w in serving}
    took: dict[str, float] = {}  # each share's seconds, timed where it ran
    sent_before = _compat.bytes_sent(client.scheduler_comm)
    remote = [_submit(client, w, *share) for w, share in pickled.items() if w not in asked]
    held: dict[Hashable, Any] = {}
    try:
        if own is not None:  # this thread has seceded: its GPU's share runs here, no round trip
            _head_start(client, [written for _, written in asked.values()], sent_before if remote else None)
            part, outputs = own
            started = time.perf_counter()
            held.update(zip(outputs, _compute_part(part, outputs), strict=True))
            took[me] = time.perf_counter() - started
        for worker, (answer, _) in asked.items():
            produced = _answered(answer)
            if produced is _NOT_SERVED:  # e.g. the worker went away: the scheduler places it
                remote.append(_submit(client, worker, *pickled[worker]))
            else:
                held.update(_share_values(produced))
                took[worker] = _served_seconds(answer.result())
        if remote:  # an empty gather still waits for a round trip through the event loop
            for produced in client.gather(remote):
                held.update(_share_values(produced))
    except BaseException:
        client.cancel(remote)  # no GPU time for shares nobody will read
        for answer, _ in asked.values():
            answer.cancel()  # the connection closes; a share already running there ends by itself
        raise
    del remote  # the remote copies go now, not when this function returns
    share_speeds.note(
        shape, {w: (_roots_in(part), took[w]) for w, (part, _) in zip(workers, parts) if w in took}
    )
    if join:
        final = {**{k: _compat.data_node(k, v) for k, v in held.items()}, **join}
        values = dask.get(final, keys) if keys else []
    else:
        values = [held[k] for k in keys]
    return repack(values)


def _submit(client: Any, worker: str, part: bytes, outputs: list[Hashable]) -> Any:
    """A share as a task on ``worker``, placed by the scheduler."""
    return client.submit(
        _run_part,
        part,
        outputs,
        workers=[worker],
        allow_other_workers=True,  # a preference: a worker restarting meanwhile must not strand it
        pure=False,
    )


_NOT_SERVED = object()


def _share_values(produced: bytes | dict[Hashable, Any]) -> dict[Hashable, Any]:
    """A remote share's values, as ``_run_part`` returned them."""
    return pickle.loads(produced) if isinstance(produced, bytes) else produced


def _ask(
    worker: str, part: bytes, outputs: list[Hashable]
) -> tuple[concurrent.futures.Future, threading.Event]:
    """Send a share straight to ``worker`` (``ShareServer``): one round trip, where a
    task goes through the scheduler on its way there and on its result's way back.
    Returns the answer's future and an event set once the share has left."""
    me = _compat.current_worker()
    written = threading.Event()
    msg = {"op": SHARE_OP, "part": part, "outputs": pickle.dumps(outputs)}
    answer = asyncio.run_coroutine_threadsafe(
        _compat.ask_worker(me, worker, msg, written), me.loop.asyncio_loop
    )
    return answer, written


def _answered(answer: concurrent.futures.Future) -> Any:
    """A share's values from its worker's answer, its own error raised here, or
    ``_NOT_SERVED`` where no answer came (the connection failed, the worker does not
    serve shares or declined, the answer did not read back)."""
    while not answer.done():  # in slices: Prefect's timeout and cancellation reach this thread between them
        concurrent.futures.wait([answer], timeout=ANSWER_POLL_S)
    try:
        reply = answer.result()
    except Exception as exc:
        logger.debug("A share sent straight to a worker came back without an answer: %r", exc)
        return _NOT_SERVED
    if isinstance(reply, dict) and reply.get("status") == "OK":
        return reply["result"]
    if isinstance(reply, dict) and reply.get("status") == SHARE_ERROR:
        _compat.raise_error_reply(reply)
    return _NOT_SERVED


def _head_start(client: Any, written: list[threading.Event], sent_before: int | None) -> None:
    """Let the remote shares leave this process before this thread's share takes the GIL
    for its kernel launches (which the worker's event loop, writing them out, would
    wait for); only a head start, never longer than ``SEND_WAIT_S``. ``sent_before``:
    the scheduler comm's byte count before shares were submitted there, if any were."""
    deadline = time.monotonic() + SEND_WAIT_S
    for event in written:
        event.wait(max(0.0, deadline - time.monotonic()))
    if sent_before is not None:
        with contextlib.suppress(Exception):
            client.sync(_sent, client.scheduler_comm, sent_before, max(0.0, deadline - time.monotonic()))


class ShareServer(WorkerPlugin):
    """Serves ``compute_on_gpus`` shares sent straight from the worker whose task calls
    it, says so to the scheduler (the ``SHARE_OP`` metric), and logs each share it starts
    (``SHARE_TOPIC``), as the task stream would show a share run as a task.

    Shares run in threads of their own, at most as many at once as the worker has
    threads, and only while the worker takes work: one that is draining, paused or
    closing declines, and the caller has the scheduler place the share.
    """

    name = "prefect-gpu-dask-shares"
    idempotent = True

    def setup(self, worker: Any) -> None:
        self.worker = worker
        self.in_flight = 0  # a drain waits for these as for running tasks
        self._pool = concurrent.futures.ThreadPoolExecutor(worker.state.nthreads, SHARE_THREAD_PREFIX)
        _compat.add_worker_handler(worker, SHARE_OP, self.serve)
        worker.metrics[SHARE_OP] = _serving

    def teardown(self, worker: Any) -> None:
        _compat.remove_worker_handler(worker, SHARE_OP)
        worker.metrics.pop(SHARE_OP, None)
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def serve(self, part: bytes, outputs: bytes) -> dict[str, Any] | None:
        """One share, in this server's threads: the worker's event loop stays free."""
        if self.worker.status != Status.running:
            return None
        self.worker.log_event(SHARE_TOPIC, {"worker": self.worker.address})
        self.in_flight += 1
        try:
            run = functools.partial(
                _compat.as_on_worker, self.worker, _timed_part, part, pickle.loads(outputs)
            )
            seconds, produced = await asyncio.get_running_loop().run_in_executor(self._pool, run)
        except Exception as exc:
            return _compat.error_reply(exc, SHARE_ERROR)
        finally:
            self.in_flight -= 1
        result = produced if isinstance(produced, bytes) else to_serialize(produced)
        return {"status": "OK", "result": result, "seconds": seconds}


def shares_in_flight(worker: Any) -> int:
    """Shares ``worker`` is running for other workers' tasks (``ShareServer``)."""
    server = worker.plugins.get(ShareServer.name)
    return getattr(server, "in_flight", 0)


def _serving(worker: Any) -> int:
    return 1


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


# dask's own threads-scheduler pool where this dask has it: chunks see the caller's
# contextvars (get_worker() among them); older dask's pools were plain.
if TYPE_CHECKING:
    _ContextPool = concurrent.futures.ThreadPoolExecutor
else:
    _ContextPool = getattr(
        dask.threaded, "ContextAwareThreadPoolExecutor", concurrent.futures.ThreadPoolExecutor
    )
GRAPH_THREAD_PREFIX = "gpu-graph"


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
    return {"pool": _in_place_pool()}


def _in_place_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that run a graph, or one GPU's share of it, on a GPU worker: as many
    as Dask's threads scheduler would use (the cores), never fewer than the worker has.

    One pool per worker process, not one per calling thread as Dask would make: the
    graph's chunks are the calling task's own (the worker's thread count limits how many
    tasks run at once, not how one task's chunks launch), tasks at once share the cores,
    and the threads live on between tasks with their CUDA libraries' handles.
    """
    return _pool_of(max(_threads(), CPU_COUNT))


@functools.cache
def _pool_of(size: int) -> concurrent.futures.ThreadPoolExecutor:
    return _GraphPool(size, thread_name_prefix=GRAPH_THREAD_PREFIX)


def _threads() -> int:
    """As many threads as this worker has: as much GPU work at once as the user allowed."""
    return _compat.current_worker().state.nthreads


def _compute_part(part: Mapping[Hashable, Any], outputs: list[Hashable]) -> tuple[Any, ...]:
    # The graph was built under TASKS_BASED on the caller: nothing left to configure here.
    # The outputs are the graph's own keys (Hashable here: a key is one).
    return dask.threaded.get(part, cast("list[Key]", outputs), **_graph_threads())


def _run_part(pickled_part: bytes, outputs: list[Hashable]) -> bytes | dict[Hashable, Any]:
    """One remote share. Small results (partial reductions) travel faster as one pickle
    than one by one through Dask's device-aware serialisation; large ones (whole chunks)
    go that way, without the extra host copies a pickle makes."""
    values = dict(zip(outputs, _compute_part(_load_part(pickled_part), outputs), strict=True))
    return pickle.dumps(values) if sizeof(values) <= PICKLE_RESULTS_UP_TO else values


def _timed_part(pickled_part: bytes, outputs: list[Hashable]) -> tuple[float, bytes | dict[Hashable, Any]]:
    """``_run_part``, and the seconds it took here: how fast this worker computes shares
    of this graph, without the way there and back (``share_balance``)."""
    started = time.perf_counter()
    produced = _run_part(pickled_part, outputs)
    return time.perf_counter() - started, produced


def _served_seconds(reply: Mapping[str, Any]) -> float:
    """How long a served share took on its worker, 0 where the reply does not say (a
    worker of an older version of this package)."""
    seconds = reply.get("seconds")
    return float(seconds) if isinstance(seconds, int | float) and seconds > 0 else 0.0


def _load_part(pickled_part: bytes) -> Mapping[Hashable, Any]:
    """A share's graph, unpickled with each module's packages imported first."""
    return _PartUnpickler(io.BytesIO(pickled_part)).load()


class _PartUnpickler(stdlib_pickle.Unpickler):
    """A share can reach a worker while a task starting there imports the package its
    graph names (``dask.array``). Unpickled as usual, the share's thread would import a
    submodule (``dask.array.reductions``) while the task's thread runs the package's
    ``__init__``, which needs that submodule: CPython breaks the two threads' deadlock by
    failing one of them, the task's or the share's. Imported parents first, the share's
    thread waits for the package instead. A thread that starts at a submodule while the
    share imports the package (another graph unpickled beside it) meets the same
    deadlock the other way round: the fork server imports ``dask.array`` before any
    worker starts where the flow uses it (``forkserver.WORKER_PRELOAD``)."""

    def find_class(self, module: str, name: str) -> Any:
        packages = module.split(".")[:-1]
        for depth in range(1, len(packages) + 1):
            importlib.import_module(".".join(packages[:depth]))
        return super().find_class(module, name)


def _roots_in(part: Mapping[Hashable, Any]) -> int:
    return sum(not node.dependencies for node in part.values())


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
    graph: Mapping[Hashable, Any],
    keys: list[Hashable],
    n: int,
    speeds: Sequence[float | None] | None = None,
) -> tuple[list[tuple[dict[Hashable, Any], list[Hashable]]], dict[Hashable, Any]] | None:
    """Split a task graph into ``n`` independent parts plus the tasks that join them.

    Roots are dealt out in contiguous runs of a depth-first order from the outputs (so
    each part holds whole subtrees), evenly or in proportion to each part's ``speeds``
    (``share_balance.share_sizes``); a task belongs to a part when all its inputs do. Returns
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
    if speeds is not None and len(speeds) != n:
        raise ValueError(f"{len(speeds)} speeds for {n} parts")
    sizes = share_sizes(len(roots), speeds or [None] * n)
    part_of_root = [part for part, size in enumerate(sizes) for _ in range(size)]
    group: dict[Hashable, int | None] = dict(zip(roots, part_of_root, strict=True))
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
