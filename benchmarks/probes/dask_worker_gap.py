"""Dask only, for an upstream report: the same threads-scheduler compute (the seed's
speed-cube, CuPy-backed where CuPy is installed, NumPy otherwise) timed in a plain
spawned process and inside a task on a ``LocalCluster`` worker, in turn, four times.

    python benchmarks/probes/dask_worker_gap.py
"""

import concurrent.futures
import multiprocessing
import statistics
import time

import dask
import dask.array as da
from distributed import Client, LocalCluster


def cube_seconds(runs: int = 5) -> float:
    """Median seconds of ``runs`` speed-cubes on the threads scheduler, after a warm-up."""
    try:
        import cupy

        rs, n, chunk = da.random.RandomState(RandomState=cupy.random.RandomState), 100_000, 10_000
    except ImportError:
        rs, n, chunk = da.random.RandomState(), 4_000, 1_000
    times = []
    for _ in range(runs + 1):
        start = time.perf_counter()
        x = rs.normal(10, 1, size=(n, n), chunks=(chunk, chunk))
        dask.compute((x[::2, ::2] + 1).mean(), scheduler="threads")
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


if __name__ == "__main__":
    spawn = multiprocessing.get_context("spawn")
    with (
        concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as plain,
        LocalCluster(n_workers=1, threads_per_worker=1) as cluster,
        Client(cluster) as client,
    ):
        for _ in range(4):
            in_plain = plain.submit(cube_seconds).result()
            in_worker = client.submit(cube_seconds, pure=False).result()
            print(f"plain process {in_plain:.3f} s, worker {in_worker:.3f} s: {in_worker / in_plain:.3f}")
