"""compute_on_gpus from inside a task on real Dask clusters."""

from __future__ import annotations

import functools
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
from distributed import Client, Event, LocalCluster, get_task_stream

from prefect_gpu_dask import compute_on_gpus
from prefect_gpu_dask.worker.recycling import drain, resume


def speed_cube(seed: int, n: int = 2000, chunk: int = 250):
    x = da.random.RandomState(seed).normal(10, 1, size=(n, n), chunks=(chunk, chunk))
    return (x[::2, ::2] + 1).mean()


def chunks_ran_on(stream: Any, caller: str) -> Counter:
    """Workers that ran the chunks of a ``compute_on_gpus`` call made by task ``caller``."""
    return Counter(t["worker"] for t in stream.data if not str(t["key"]).startswith(caller))


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


def test_compute_on_gpus_spreads_the_chunks_over_both_workers(two_workers):
    with get_task_stream(two_workers) as stream:
        (mean,) = two_workers.submit(spread_cube, 7, pure=False).result()
    assert mean == dask.compute(speed_cube(7), scheduler="sync")[0]
    assert len(chunks_ran_on(stream, "spread_cube")) == 2

    plus, sums = two_workers.submit(array_and_sum, 3, pure=False).result()
    x = da.random.RandomState(3).random((400, 400), chunks=100)
    expected_plus, expected_sums = dask.compute(x + 1, x.sum(axis=0), scheduler="sync")
    assert np.array_equal(plus, expected_plus) and np.allclose(sums, expected_sums)


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
    offset = 2.5  # a closure: only cloudpickle can ship this graph's chunks
    x = da.random.RandomState(seed).random((400, 400), chunks=100)
    return compute_on_gpus(x.map_blocks(lambda block: block + offset).sum())


def test_chunks_holding_functions_pickle_cannot_name_still_run(two_workers):
    (total,) = two_workers.submit(sum_with_a_lambda, 4, pure=False).result()
    x = da.random.RandomState(4).random((400, 400), chunks=100)
    assert np.isclose(total, (x + 2.5).sum().compute(scheduler="sync"))


def rechunked_sum(seed: int):
    x = da.random.RandomState(seed).random((400, 400), chunks=(400, 10))
    return compute_on_gpus(x.rechunk((10, 400)).sum())


def test_an_all_to_all_graph_spreads_over_both_workers(two_workers):
    with get_task_stream(two_workers) as stream:
        (total,) = two_workers.submit(rechunked_sum, 5, pure=False).result()
    x = da.random.RandomState(5).random((400, 400), chunks=(400, 10))
    assert np.isclose(total, x.sum().compute(scheduler="sync"))
    assert len({t["worker"] for t in stream.data}) == 2


def threads_running_blocks(**compute_kwargs) -> set[int]:

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
        with get_task_stream(client) as stream:
            future = client.submit(spread_cube, 11, workers=[by_name["cpu-worker"]], pure=False)
            (mean,) = future.result(timeout=60)
        pieces = set(chunks_ran_on(stream, "spread_cube"))
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
        with get_task_stream(client) as stream:
            future = client.submit(sum_with_a_script_function, workers=[by_name["cpu-worker"]], pure=False)
            assert future.result(timeout=60) == 400 * 400 * 1.5
        pieces = set(chunks_ran_on(stream, "sum_with_a_script_function"))
    assert pieces == {by_name["gpu-worker"]}, pieces


def one_chunk_sum() -> float:
    return float(compute_on_gpus(da.ones((100, 100), chunks=100).sum())[0])


def test_a_one_chunk_graph_goes_to_the_gpu_worker_too(remote_cluster):
    with Client(remote_cluster.address) as client:
        by_name = {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}
        with get_task_stream(client) as stream:
            future = client.submit(one_chunk_sum, workers=[by_name["cpu-worker"]], pure=False)
            total = future.result(timeout=60)
        pieces = set(chunks_ran_on(stream, "one_chunk_sum"))
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


def failing_chunk(block: np.ndarray, block_info: Any = None) -> np.ndarray:
    if block_info[None]["chunk-location"] == (1, 2):
        raise ValueError("no GPU memory left for chunk (1, 2)")
    return block


def sum_with_a_failing_chunk() -> Any:
    return compute_on_gpus(
        da.ones((400, 400), chunks=100).map_blocks(failing_chunk, meta=np.empty((0, 0))).sum()
    )


def test_an_error_in_a_chunk_reaches_the_caller(two_workers):
    with pytest.raises(ValueError, match=r"no GPU memory left for chunk \(1, 2\)"):
        two_workers.submit(sum_with_a_failing_chunk, pure=False).result(timeout=60)


def flaky_chunk(attempts: str, block: np.ndarray) -> np.ndarray:
    with open(attempts, "a") as marks:  # one line per attempt, whichever worker runs it
        marks.write("x\n")
    with open(attempts) as marks:
        if len(marks.readlines()) == 1:
            raise OSError("a flaky first attempt")
    return block


def sum_retried(attempts: str) -> float:
    x = da.ones((40, 40), chunks=40)
    y = x.map_blocks(functools.partial(flaky_chunk, attempts), meta=np.empty((0, 0)))
    return float(compute_on_gpus(y.sum(), retries=2)[0])


def test_keyword_arguments_reach_the_distributed_scheduler(two_workers, tmp_path):
    attempts = tmp_path / "attempts"
    assert two_workers.submit(sum_retried, str(attempts), pure=False).result(timeout=60) == 1600
    assert len(attempts.read_text().splitlines()) == 2


def sum_with_the_threads_schedulers_keywords() -> float:
    x = da.ones((400, 400), chunks=100)
    return float(compute_on_gpus(x.sum(), num_workers=2, scheduler="threads")[0])


def test_the_threads_schedulers_keywords_are_dropped_on_the_distributed_path(two_workers):
    """``num_workers=`` (documented for the in-place path) must not break a call that
    goes to the distributed scheduler: ``client.compute`` takes no such keyword."""
    assert (
        two_workers.submit(sum_with_the_threads_schedulers_keywords, pure=False).result(timeout=60) == 160_000
    )
