"""RAPIDS on a GPU: leaks inside RMM pools, cuDF results, the cuDF ETL flow.

Skipped without a GPU (``gpu`` marker), and where RMM or cuDF cannot be imported (not
installed, or numpy 2.5 beside numba-cuda: ``prefect-gpu-dask doctor`` says which).
"""

from __future__ import annotations

import os
import time

import pytest
from prefect import flow, task
from prefect.context import FlowRunContext

from prefect_gpu_dask import GPUDaskTaskRunner

pytestmark = pytest.mark.gpu
MiB = 2**20
GiB = 2**30
_KEPT: list = []  # lives in the worker process: what a leaking task holds on to


def importable(name: str) -> None:
    """Skip unless ``name`` imports here (a failed cuDF import is no ImportError)."""
    import importlib

    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - numba-cuda beside numpy 2.5 raises AttributeError
        pytest.skip(f"{name} does not import here: {type(exc).__name__}: {exc}")


@task(tags=["gpu"])
def keep_rmm(nbytes: int) -> int:
    import rmm

    _KEPT.append(rmm.DeviceBuffer(size=nbytes))
    return os.getpid()


@task(tags=["gpu"])
def churn_rmm(nbytes: int) -> int:
    import rmm

    buffer = rmm.DeviceBuffer(size=nbytes)
    size = buffer.size
    del buffer
    return size


@task(tags=["gpu"])
def keep_cupy_through_rmm(nbytes: int) -> int:
    import cupy
    from rmm.allocators.cupy import rmm_cupy_allocator

    cupy.cuda.set_allocator(rmm_cupy_allocator)
    _KEPT.append(cupy.ones(nbytes // 8, dtype=cupy.float64))
    return os.getpid()


@task(tags=["gpu"])
def churn_cupy_through_rmm(nbytes: int) -> float:
    import cupy
    from rmm.allocators.cupy import rmm_cupy_allocator

    cupy.cuda.set_allocator(rmm_cupy_allocator)
    x = cupy.ones(nbytes // 8, dtype=cupy.float64)
    total = float(x.sum())
    del x
    return total


@task(tags=["gpu"])
def guard_cost_us(rounds: int = 500) -> float:
    """What one begin/end pair of this worker's guard costs, RMM's readings included
    (a task that moved nothing: the hot path)."""
    from prefect_gpu_dask.worker.guard import current_guard

    guard = current_guard()
    started = time.perf_counter()
    for _ in range(rounds):
        guard.end(*guard.begin(), task="guard-cost")
    return (time.perf_counter() - started) / rounds * 1e6


def _wait_for_restart(runner, count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while len(runner.restarts) < count and time.monotonic() < deadline:
        time.sleep(0.1)


POOLS = {
    "pool": {"rmm_pool_size": "8GiB"},
    "async": {"rmm_async": True},
}


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_a_leak_inside_an_rmm_pool_is_seen_and_recycled_and_churn_is_clean(pool):
    importable("rmm")

    @flow(
        task_runner=GPUDaskTaskRunner(
            cluster_class="dask_cuda.LocalCUDACluster", cluster_kwargs=POOLS[pool], leak_threshold="256MiB"
        )
    )
    def rmm_night():
        runner = FlowRunContext.get().task_runner
        churned = [churn_rmm.submit(2 * GiB).result() for _ in range(2)]
        cost = guard_cost_us.submit().result()
        first = keep_rmm.submit(1 * GiB).result()
        _wait_for_restart(runner, 1)
        second = keep_rmm.submit(1 * GiB).result()
        _wait_for_restart(runner, 2)
        return churned, cost, first, second, list(runner.restarts), list(runner.records)

    churned, cost, first, second, restarts, records = rmm_night()
    for record in records:
        print(
            pool, record.task_name, record.verdict, record.allocator, record.before, record.delta, record.pid
        )
    print(f"{pool}: guard cost {cost:.1f} us per task; restarts {[r.reason for r in restarts]}")
    assert churned == [2 * GiB] * 2
    by_task = {}
    for record in records:
        by_task.setdefault(record.task_name, []).append(record)
    assert [r.verdict for r in by_task["churn_rmm"]] == ["clean", "clean"]
    assert all(r.allocator == "rmm" for r in by_task["churn_rmm"])
    keeps = by_task["keep_rmm"]
    assert [r.verdict for r in keeps] == ["leak", "leak"]
    assert all(r.delta >= 1 * GiB and r.allocator_delta >= 1 * GiB for r in keeps)
    assert len(restarts) == 2 and all(r.reason.startswith("leak") for r in restarts)
    assert restarts[0].old_pid == first and restarts[1].old_pid == second != first
    if pool == "pool":  # the driver sees the 8 GiB pool before every task: never the task's
        assert all(r.before >= 8 * GiB for r in records)
    assert cost <= 100


def test_cupy_routed_through_rmm_is_judged_the_same():
    importable("rmm")

    @flow(
        task_runner=GPUDaskTaskRunner(
            cluster_class="dask_cuda.LocalCUDACluster",
            cluster_kwargs={"rmm_pool_size": "8GiB"},
            leak_threshold="256MiB",
        )
    )
    def cupy_night():
        runner = FlowRunContext.get().task_runner
        churned = churn_cupy_through_rmm.submit(2 * GiB).result()
        kept = keep_cupy_through_rmm.submit(1 * GiB).result()
        _wait_for_restart(runner, 1)
        return churned, kept, list(runner.restarts), list(runner.records)

    churned, kept, restarts, records = cupy_night()
    for record in records:
        print(record.task_name, record.verdict, record.allocator, record.before, record.delta)
    assert churned == float(2 * GiB // 8)
    verdicts = {r.task_name: (r.verdict, r.allocator) for r in records}
    assert verdicts["churn_cupy_through_rmm"] == ("clean", "rmm")
    assert verdicts["keep_cupy_through_rmm"] == ("leak", "rmm")
    assert [r.old_pid for r in restarts] == [kept]


@task(tags=["gpu"], persist_result=True)
def cudf_frame(rows: int):
    import cudf

    return cudf.DataFrame({"key": [i % 7 for i in range(rows)], "value": range(rows)})


def test_a_cudf_dataframe_reaches_the_flow():
    importable("cudf")

    @flow(task_runner=GPUDaskTaskRunner())
    def cudf_result():
        frame = cudf_frame.submit(1_000_000).result()
        return (
            type(frame).__module__,
            len(frame),
            int(frame["value"].sum()),
            frame.groupby("key").size().max(),
        )

    module, rows, total, largest = cudf_result()
    assert module.startswith("cudf") and rows == 1_000_000
    assert total == 1_000_000 * 999_999 // 2 and largest == 142_858


def test_the_etl_flow_runs_on_cudf(tmp_path):
    importable("cudf")
    importable("dask_cudf")
    from flows.cudf_etl import cudf_etl

    report = cudf_etl(out_dir=str(tmp_path), backend="cudf", partitions=4, rows_per_partition=200_000)
    assert report["backend"] == "cudf" and report["device"] == "GPU"
    assert report["groups"] == 35
