"""compute_on_gpus from inside a task on a real two-worker cluster, and the graph split behind it."""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections import Counter
from typing import Any

import dask
import dask.array as da
import distributed
import numpy as np
import pytest
from dask._expr import FinalizeCompute
from dask.base import collections_to_expr
from dask.core import flatten
from distributed import Client, Event, LocalCluster, get_task_stream

from prefect_gpu_dask import compute_on_gpus
from prefect_gpu_dask.resources import scheduler_identity
from prefect_gpu_dask.worker.compute import SHARE_OP, SHARE_TOPIC, ShareServer, serving_shares, split_graph
from prefect_gpu_dask.worker.recycling import drain, resume


def speed_cube(seed: int, n: int = 2000, chunk: int = 250):
    x = da.random.RandomState(seed).normal(10, 1, size=(n, n), chunks=(chunk, chunk))
    return (x[::2, ::2] + 1).mean()


def graph_of(*collections):
    expr = FinalizeCompute(collections_to_expr(collections, True)).optimize()
    return dict(expr.__dask_graph__()), list(flatten(expr.__dask_keys__()))


def test_a_tree_reduction_splits_into_independent_halves():
    graph, keys = graph_of(speed_cube(0))
    parts, join = split_graph(graph, keys, 2)
    assert len(parts) == 2
    (left, left_out), (right, right_out) = parts
    assert not left.keys() & right.keys()
    assert left.keys() | right.keys() | join.keys() == graph.keys()
    assert len(join) <= 2  # only the last aggregation joins the halves
    for part, _ in parts:  # each half is self-contained
        assert all(dep in part for node in part.values() for dep in node.dependencies)
    needed = {dep for node in join.values() for dep in node.dependencies} | set(keys)
    assert needed <= set(left_out) | set(right_out) | join.keys()


def test_shares_are_whole_subtrees_of_the_reduction():
    # 20x20 chunks over 8 workers: cutting in key order splits almost every 4x4 combine
    # (78 joining tasks, 220 partials shipped back); whole subtrees leave 22 and 56.
    graph, keys = graph_of(speed_cube(0, chunk=100))
    parts, join = split_graph(graph, keys, 8)
    assert len(join) <= 24
    assert sum(len(outputs) for _, outputs in parts) <= 64
    sizes = [len(part) for part, _ in parts]
    assert max(sizes) <= 1.05 * min(sizes)  # and the shares stay even


def test_graphs_that_do_not_split_are_left_to_dask():
    x = da.random.RandomState(1).random((400, 400), chunks=(400, 10))
    with dask.config.set({"array.rechunk.method": "tasks"}):
        assert split_graph(*graph_of(x.rechunk((10, 400)).sum()), 2) is None  # all-to-all
    assert split_graph(*graph_of(speed_cube(0, n=500, chunk=500)), 2) is None  # one root, two parts
    graph, keys = graph_of(speed_cube(0))
    one_root = next(k for k, node in graph.items() if not node.dependencies)
    del graph[one_root]  # now a task reads a key from outside the graph
    assert split_graph(graph, keys, 2) is None


def shares_ran_on(client: Client, stream: Any, since: float) -> Counter:
    """Which workers ran shares: as tasks placed by the scheduler, or sent straight to them."""
    ran = stream.data if stream else []
    tasks = Counter(t["worker"] for t in ran if str(t["key"]).startswith("_run_part"))
    deadline = time.monotonic() + 5  # a served share's event comes on the worker's stream
    while True:
        straight = Counter(msg["worker"] for at, msg in client.get_events(SHARE_TOPIC) if at >= since)
        if tasks or straight or time.monotonic() > deadline:
            return tasks + straight
        time.sleep(0.05)


@pytest.fixture(scope="module")
def two_workers():
    with LocalCluster(n_workers=2, threads_per_worker=2, dashboard_address="127.0.0.1:0") as cluster:
        with Client(cluster) as client:
            yield client


def spread_cube(seed: int):
    return compute_on_gpus(speed_cube(seed))


def array_and_sum(seed: int):
    x = da.random.RandomState(seed).random((400, 400), chunks=100)
    return compute_on_gpus(x + 1, x.sum(axis=0))


def test_compute_on_gpus_runs_one_piece_per_worker(two_workers):
    with get_task_stream(two_workers) as stream:
        (mean,) = two_workers.submit(spread_cube, 7, pure=False).result()
    assert mean == dask.compute(speed_cube(7), scheduler="sync")[0]
    [caller] = {t["worker"] for t in stream.data if str(t["key"]).startswith("spread_cube")}
    pieces = Counter(t["worker"] for t in stream.data if str(t["key"]).startswith("_run_part"))
    # One piece went to the other worker; the caller's own share ran in the calling thread.
    assert len(pieces) == 1 and caller not in pieces and set(pieces.values()) == {1}, pieces

    plus, sums = two_workers.submit(array_and_sum, 3, pure=False).result()
    x = da.random.RandomState(3).random((400, 400), chunks=100)
    expected_plus, expected_sums = dask.compute(x + 1, x.sum(axis=0), scheduler="sync")
    assert np.array_equal(plus, expected_plus) and np.allclose(sums, expected_sums)


def threads_running_shares() -> set[str]:
    import threading

    x = da.ones((400, 400), chunks=100)
    named = x.map_blocks(
        lambda block: np.array([[threading.current_thread().name]], dtype=object), chunks=(1, 1), dtype=object
    )
    (names,) = compute_on_gpus(named)
    return set(names.ravel())


def test_each_share_runs_on_its_workers_one_pool_of_the_cores(two_workers):
    # The caller's share and the other worker's, on each worker's in-place pool (not a
    # pool of Dask's own per calling thread).
    names = two_workers.submit(threads_running_shares, pure=False).result(timeout=60)
    assert names and all(name.startswith("gpu-graph") for name in names), names


def test_the_graph_pool_notes_each_chunks_thread_for_the_task_recording_it():
    from prefect_gpu_dask.worker import task_threads
    from prefect_gpu_dask.worker.compute import _GraphPool

    pool = _GraphPool(1, thread_name_prefix="gpu-graph-test")
    try:
        with task_threads.recording() as used:
            pool.submit(int).result()
        assert {t.name.split("_")[0] for t in used} == {"MainThread", "gpu-graph-test"}
        assert pool.submit(int, "7").result() == 7  # outside a recording: run as given
    finally:
        pool.shutdown()


def nested_cubes() -> float:
    def block_plus_a_cube(block):
        (inner,) = compute_on_gpus(da.ones((40, 40), chunks=10).sum())
        return block + inner

    (blocks,) = compute_on_gpus(da.zeros((4, 4), chunks=1).map_blocks(block_plus_a_cube, dtype=float))
    return float(blocks.sum())


def test_a_chunk_computing_a_graph_of_its_own_does_not_wait_behind_itself():
    # Every thread of the in-place pool runs a chunk that computes its own graph: those
    # graphs must not queue on the pool their callers fill.
    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address="127.0.0.1:0") as cluster:
        with Client(cluster) as client:
            assert client.submit(nested_cubes, pure=False).result(timeout=60) == 16 * 1600


def sum_with_a_lambda(seed: int):
    offset = 2.5  # a closure: only cloudpickle can ship this graph's shares
    x = da.random.RandomState(seed).random((400, 400), chunks=100)
    return compute_on_gpus(x.map_blocks(lambda block: block + offset).sum())


def test_shares_holding_functions_pickle_cannot_name_still_run(two_workers):
    with get_task_stream(two_workers) as stream:
        (total,) = two_workers.submit(sum_with_a_lambda, 4, pure=False).result()
    x = da.random.RandomState(4).random((400, 400), chunks=100)
    assert np.isclose(total, (x + 2.5).sum().compute(scheduler="sync"))
    assert any(str(t["key"]).startswith("_run_part") for t in stream.data)


def rechunked_sum(seed: int):
    x = da.random.RandomState(seed).random((400, 400), chunks=(400, 10))
    return compute_on_gpus(x.rechunk((10, 400)).sum())


def test_a_graph_that_does_not_split_still_spreads_over_both_workers(two_workers):
    with get_task_stream(two_workers) as stream:
        (total,) = two_workers.submit(rechunked_sum, 5, pure=False).result()
    x = da.random.RandomState(5).random((400, 400), chunks=(400, 10))
    assert np.isclose(total, x.sum().compute(scheduler="sync"))
    assert len({t["worker"] for t in stream.data}) == 2


def threads_running_blocks(**compute_kwargs) -> set[int]:
    import threading

    def block(b):
        time.sleep(0.3)  # long enough that every pool thread takes a block
        return np.array([threading.get_ident()])

    x = da.zeros((8,), chunks=1).map_blocks(block, dtype=int)
    (idents,) = compute_on_gpus(x, **compute_kwargs)
    return set(idents.tolist())


def test_on_the_only_worker_graphs_share_one_pool_of_the_cores_or_num_workers_threads():
    cores = dask.system.CPU_COUNT
    with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address="127.0.0.1:0") as cluster:
        with Client(cluster) as client:
            one = client.submit(threads_running_blocks, pure=False).result(timeout=60)
            at_once = client.gather([client.submit(threads_running_blocks, pure=False) for _ in range(2)])
            chosen = client.submit(threads_running_blocks, num_workers=1, pure=False).result(timeout=60)
    size = max(1, cores)  # the cores, never fewer than the worker's threads
    assert len(one) == min(8, size)
    # Two tasks at once (each caller secedes, so the second takes its slot) share that pool.
    assert len(set().union(one, *at_once)) <= size
    assert len(chosen) == 1


def test_a_caller_without_a_gpu_sends_the_graph_to_the_only_gpu_worker(remote_cluster):
    with Client(remote_cluster.address) as client:
        by_name = {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}
        since = time.time()
        with get_task_stream(client) as stream:
            future = client.submit(spread_cube, 11, workers=[by_name["cpu-worker"]], pure=False)
            (mean,) = future.result(timeout=60)
        pieces = set(shares_ran_on(client, stream, since))
    assert mean == dask.compute(speed_cube(11), scheduler="sync")[0]
    assert pieces == {by_name["gpu-worker"]}, pieces


def sum_with_a_script_function() -> float:
    # As if defined in the flow script: a function of this process's __main__, which a
    # `dask worker` process does not have. Plain pickle would ship it by name.
    script = {"__name__": "__main__"}
    exec("def plus_half_from_script(block):\n    return block + 0.5\n", script)
    plus_half = script["plus_half_from_script"]
    sys.modules["__main__"].plus_half_from_script = plus_half  # where pickle would look for it
    x = da.ones((400, 400), chunks=100)
    return float(compute_on_gpus(x.map_blocks(plus_half).sum())[0])


def test_functions_from_the_flow_script_travel_by_value(remote_cluster):
    with Client(remote_cluster.address) as client:
        by_name = {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}
        since = time.time()
        with get_task_stream(client) as stream:
            future = client.submit(sum_with_a_script_function, workers=[by_name["cpu-worker"]], pure=False)
            assert future.result(timeout=60) == 400 * 400 * 1.5
        pieces = set(shares_ran_on(client, stream, since))
    assert pieces == {by_name["gpu-worker"]}, pieces


def one_chunk_sum() -> float:
    return float(compute_on_gpus(da.ones((100, 100), chunks=100).sum())[0])


def test_a_one_chunk_graph_goes_to_the_gpu_worker_too(remote_cluster):
    with Client(remote_cluster.address) as client:
        by_name = {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}
        since = time.time()
        with get_task_stream(client) as stream:
            future = client.submit(one_chunk_sum, workers=[by_name["cpu-worker"]], pure=False)
            total = future.result(timeout=60)
        pieces = set(shares_ran_on(client, stream, since))
    assert total == 100 * 100
    assert pieces == {by_name["gpu-worker"]}, pieces


def cube_after(event_name: str, seed: int) -> tuple[float, str]:
    Event(event_name).wait(timeout=30)  # the test drains this worker meanwhile
    return compute_on_gpus(speed_cube(seed))[0], distributed.get_worker().address


def test_a_draining_sole_gpu_worker_keeps_its_graph_off_the_cpu_workers(remote_cluster):
    with Client(remote_cluster.address) as client:
        by_name = {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}
        gpu = by_name["gpu-worker"]
        go = Event("drained", client=client)
        with get_task_stream(client) as stream:
            future = client.submit(cube_after, "drained", 13, workers=[gpu], pure=False)
            while not client.processing(workers=[gpu])[gpu]:
                time.sleep(0.05)
            client.run(drain, workers=[gpu])  # as the guard does for a leaking worker
            try:
                go.set()
                mean, ran_on = future.result(timeout=60)
            finally:
                client.run(resume, workers=[gpu])
    assert ran_on == gpu
    assert mean == dask.compute(speed_cube(13), scheduler="sync")[0]
    moved = {t["worker"] for t in stream.data if t["worker"] != gpu}
    assert not moved, f"chunks ran on {moved} while the GPU worker drained"


def serve_shares(client: Client, workers: int = 2) -> None:
    client.register_plugin(ShareServer(), name=ShareServer.name)
    deadline = time.monotonic() + 30
    while len(serving_shares(scheduler_identity(client)["workers"])) < workers:  # on the next heartbeat
        assert time.monotonic() < deadline, "the workers never said they serve shares"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def serving_workers():
    with LocalCluster(n_workers=2, threads_per_worker=2, dashboard_address="127.0.0.1:0") as cluster:
        with Client(cluster) as client:
            serve_shares(client)
            yield client


def test_shares_go_straight_to_a_worker_that_serves_them(serving_workers):
    client = serving_workers
    since = time.time()
    with get_task_stream(client) as stream:
        (mean,) = client.submit(spread_cube, 17, pure=False).result()
    served = shares_ran_on(client, stream, since)
    assert not any(str(t["key"]).startswith("_run_part") for t in stream.data)  # no task, no scheduler
    [caller] = {t["worker"] for t in stream.data if str(t["key"]).startswith("spread_cube")}
    assert len(served) == 1 and caller not in served and set(served.values()) == {1}, served
    with get_task_stream(client) as stream:
        plus, sums = client.submit(array_and_sum, 5, pure=False).result()
    assert mean == dask.compute(speed_cube(17), scheduler="sync")[0]
    x = da.random.RandomState(5).random((400, 400), chunks=100)
    expected_plus, expected_sums = dask.compute(x + 1, x.sum(axis=0), scheduler="sync")
    assert np.array_equal(plus, expected_plus) and np.allclose(sums, expected_sums)
    assert not any(str(t["key"]).startswith("_run_part") for t in stream.data)


ONE_CHUNK_AT_A_TIME = threading.Lock()  # per worker process: its chunks' time adds up, whatever its cores


def chunk_on(slow_pid: int, seconds: float, block: np.ndarray) -> np.ndarray:
    with ONE_CHUNK_AT_A_TIME:
        time.sleep(seconds * (3 if os.getpid() == slow_pid else 1))
    return np.full(block.shape, os.getpid())


def chunks_by_process(slow_pid: int) -> tuple[Counter, float]:
    x = da.zeros((24, 1), chunks=1, dtype=int)
    started = time.monotonic()
    (pids,) = compute_on_gpus(x.map_blocks(functools.partial(chunk_on, slow_pid, 0.02)))
    return Counter(pids.ravel().tolist()), time.monotonic() - started


def forget_share_speeds() -> None:
    from prefect_gpu_dask.worker import compute, share_balance

    compute.share_speeds = share_balance.ShareSpeeds()


def test_the_next_split_gives_a_slower_worker_fewer_chunks(serving_workers):
    client = serving_workers
    client.run(forget_share_speeds)
    pids = client.run(os.getpid)
    caller, slow = sorted(pids)
    calls = [
        client.submit(chunks_by_process, pids[slow], workers=[caller], pure=False).result(timeout=60)
        for _ in range(4)
    ]
    (first, _), (last, _) = calls[0], calls[-1]
    assert first == {pids[caller]: 12, pids[slow]: 12}  # this graph not seen before: even
    # The call lasts as long as its longer share: each chunk on the slow worker counts thrice.
    longest = [max(counts[pids[caller]], 3 * counts[pids[slow]]) for counts, _ in calls]
    assert longest[-1] <= 0.8 * longest[0], calls
    assert last[pids[slow]] < last[pids[caller]], calls


def large_share_result(seed: int):
    x = da.random.RandomState(seed).random((3000, 3000), chunks=(500, 3000))  # 36 MB a share
    return compute_on_gpus(x + 1)[0]


def test_a_share_too_large_to_pickle_comes_back_whole(serving_workers):
    result = serving_workers.submit(large_share_result, 2, pure=False).result()
    x = da.random.RandomState(2).random((3000, 3000), chunks=(500, 3000))
    assert np.array_equal(result, (x + 1).compute(scheduler="sync"))


def failing_elsewhere(caller_pid: int):
    def block_or_fail(block):
        if os.getpid() != caller_pid:
            raise ValueError(f"no GPU memory left in {os.getpid()}")
        return block

    x = da.ones((400, 400), chunks=100)
    return compute_on_gpus(x.map_blocks(block_or_fail).sum())


def fails_in_the_other_share() -> Any:
    return failing_elsewhere(os.getpid())


def test_an_error_in_a_share_sent_straight_reaches_the_caller(serving_workers):
    with pytest.raises(ValueError, match="no GPU memory left in"):
        serving_workers.submit(fails_in_the_other_share, pure=False).result()


def forget_shares(dask_worker) -> None:
    del dask_worker.handlers[SHARE_OP]  # a worker that still says it serves them, but does not


def test_a_share_the_worker_does_not_answer_goes_through_the_scheduler(serving_workers):
    client = serving_workers
    client.run(forget_shares)
    try:
        with get_task_stream(client) as stream:
            (mean,) = client.submit(spread_cube, 19, pure=False).result(timeout=60)
        assert mean == dask.compute(speed_cube(19), scheduler="sync")[0]
        assert any(str(t["key"]).startswith("_run_part") for t in stream.data)
    finally:
        client.unregister_worker_plugin(ShareServer.name)
        client.register_plugin(ShareServer(), name=ShareServer.name)


def sum_held_elsewhere(caller_pid: int) -> float:
    def block(block):
        if os.getpid() != caller_pid:  # the other worker's share waits until the test lets it go
            Event("share-may-end").wait(timeout=60)
        return block

    x = da.ones((400, 400), chunks=100)
    return float(compute_on_gpus(x.map_blocks(block).sum())[0])


def held_sum_from_here() -> float:
    return sum_held_elsewhere(os.getpid())


@pytest.fixture
def share_held_on_the_other_worker():
    """A call whose share on the other worker is running and held there."""
    with LocalCluster(n_workers=2, threads_per_worker=2, dashboard_address="127.0.0.1:0") as cluster:
        with Client(cluster) as client:
            serve_shares(client)
            caller, other = sorted(client.scheduler_info()["workers"])
            let_go = Event("share-may-end", client=client)
            let_go.clear()
            since = time.time()
            future = client.submit(held_sum_from_here, workers=[caller], pure=False)
            deadline = time.monotonic() + 30
            while other not in shares_ran_on(client, None, since):
                assert time.monotonic() < deadline, "the share never started on the other worker"
                time.sleep(0.05)
            try:
                yield client, other, future, let_go
            finally:
                let_go.set()
            assert future.result(timeout=60) == 400 * 400


def test_a_share_whose_worker_dies_is_placed_by_the_scheduler(share_held_on_the_other_worker):
    client, other, future, let_go = share_held_on_the_other_worker
    with get_task_stream(client) as stream:
        os.kill(client.run(os.getpid, workers=[other])[other], 9)
        let_go.set()
        assert future.result(timeout=60) == 400 * 400
    assert any(str(t["key"]).startswith("_run_part") for t in stream.data)  # placed by the scheduler


def test_a_drained_worker_waits_for_the_share_it_runs(share_held_on_the_other_worker):
    client, other, future, let_go = share_held_on_the_other_worker
    try:
        before = client.run(drain, workers=[other])[other]
        assert before["running"] == 1  # no task of its own: the share
    finally:
        client.run(resume, workers=[other])


SHARE_MEETS_STARTING_TASK = """
import threading, time
from prefect_gpu_dask.worker.compute import _load_part
errors = []
def starting_task():
    try:
        import dask.array  # a task's first import of the package its graph uses
    except BaseException as exc:
        errors.append(f"task: {exc!r}")
thread = threading.Thread(target=starting_task)
thread.start()
time.sleep(DELAY)
try:
    _load_part(b"cdask.array.reductions\\nmean\\n.")  # a share's pickle naming a submodule
except BaseException as exc:
    errors.append(f"share: {exc!r}")
thread.join()
print(errors)
"""


@pytest.mark.parametrize("delay", [0.0, 0.02])
def test_a_share_arriving_as_a_task_imports_its_package_fails_neither(delay):
    import subprocess

    script = SHARE_MEETS_STARTING_TASK.replace("DELAY", str(delay))
    # A fresh interpreter: dask.array not yet imported, as in a worker before its first task.
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
