"""cube: the speed-cube on one GPU task through the runner (its spread over at least 20
warm runs, on SQLite and on PostgreSQL) against raw Dask on the same GPUs and the host's
CPU cores."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.common import (
    Options,
    check_cube,
    in_child_process,
    median_of,
    runs_of,
    speed_cube_expr,
    spread,
    threads_cube_runs,
    warm_every_worker,
)
from benchmarks.servers import on_postgres
from prefect_gpu_dask.flow.cluster import GPU_WORKER_THREADS


def run(options: Options) -> Iterator[tuple[str, Any]]:
    cpu_n = options.n if not options.gpu else 40_000
    yield "speed_cube", bench_speed_cube(options.n, options.chunk, options.gpu, options.repeat, cpu_n)


def bench_speed_cube(n: int, chunk: int, gpu: bool, repeat: int, cpu_n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"n": n, "chunk": chunk, "cpu_n": cpu_n}
    # The host's cores, threads scheduler, NumPy.
    cpu_s = median_of(
        lambda: check_cube(speed_cube_expr(cpu_n, chunk, False).compute(scheduler="threads")), 1
    )
    out["cpu_threads_s"] = cpu_s * (n / cpu_n) ** 2  # scaled to the full size if run smaller
    out["cpu_threads_measured_s"] = cpu_s
    if not gpu:
        return out
    # Raw Dask in a process of its own: this one never holds a CUDA context (in_child_process).
    out["raw_threads_s"] = statistics.median(in_child_process(threads_cube_runs, n, chunk, repeat))
    out["raw_local_cuda_cluster_s"] = in_child_process(raw_local_cuda_cluster_s, n, chunk, repeat, None)
    runner = cube_through_runner(n, chunk, max(repeat, 20), spread_of_runs=True)
    out["runner"] = runner
    out["runner_s"] = runner["median_s"]
    out["runner_postgres"] = on_postgres(lambda: cube_through_runner(n, chunk, max(repeat, 20), True))
    return out


def raw_local_cuda_cluster_s(n: int, chunk: int, repeat: int, devices: str | None) -> float:
    """The speed-cube through ``client.compute`` on a ``LocalCUDACluster`` of ``devices``
    (all GPUs: None), median of ``repeat`` warm runs. Run it ``in_child_process``."""
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    with (
        LocalCUDACluster(CUDA_VISIBLE_DEVICES=devices, threads_per_worker=GPU_WORKER_THREADS) as cluster,
        Client(cluster) as client,
    ):
        return median_of(lambda: check_cube(client.compute(speed_cube_expr(n, chunk, True)).result()), repeat)


def cube_through_runner(
    n: int, chunk: int, repeat: int, spread_of_runs: bool = False, **runner_kwargs: Any
) -> Any:
    """The speed-cube as one gpu task that computes its chunks with ``compute_on_gpus``:
    the median of ``repeat`` warm runs (or their spread)."""
    from prefect import flow, task
    from prefect.context import FlowRunContext

    from prefect_gpu_dask import GPUDaskTaskRunner, compute_on_gpus

    @task(tags=["gpu"])
    def cube() -> float:
        return check_cube(compute_on_gpus(speed_cube_expr(n, chunk, True))[0])

    @flow(task_runner=GPUDaskTaskRunner(**runner_kwargs))
    def through_runner() -> tuple[list[float], list[float]]:
        warm_up = warm_every_worker(cube) + 1  # and runs_of's own
        runs = runs_of(lambda: cube.submit().result(), repeat)
        runner = FlowRunContext.get().task_runner
        deadline = time.monotonic() + 10
        while len(runner.records) < repeat + warm_up and time.monotonic() < deadline:
            time.sleep(0.05)
        inside = [r.duration_s for r in sorted(runner.records, key=lambda r: r.time)][warm_up:]
        return runs, inside

    runs, inside = through_runner()
    if not spread_of_runs:
        return statistics.median(runs)
    # Where a slow run's time went: the user's code (the guard's duration) or around it.
    return spread(runs) | {"inside_task": spread(inside) if inside else None}
