"""A/B inside one process: does the calling worker's own share start before or after
the remote shares have left it? Alternates the two on the same cluster and prints the
best and median of compute_on_gpus (speed-cube) for each, on every GPU of the host."""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ab(n, chunk, rounds):
    from run import check_cube, speed_cube_expr

    from prefect_gpu_dask import collections

    times = {True: [], False: []}
    for i in range(rounds):
        for flag in (True, False) if i % 2 else (False, True):
            collections._WAIT_FOR_SEND = flag
            start = time.perf_counter()
            check_cube(collections.compute_on_gpus(speed_cube_expr(n, chunk, True))[0])
            times[flag].append(time.perf_counter() - start)
    return {
        ("wait" if flag else "no-wait"): (min(ts[1:]), statistics.median(ts[1:]))
        for flag, ts in times.items()
    }


def main():
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    from prefect_gpu_dask.cluster import GPU_WORKER_THREADS

    with (
        LocalCUDACluster(threads_per_worker=GPU_WORKER_THREADS, resources={"GPU": 1}) as cluster,
        Client(cluster) as client,
    ):
        client.run(lambda: __import__("cupy").ones(1).sum())
        gpus = len(client.scheduler_info()["workers"])
        for n in (100_000, 200_000):
            result = client.submit(ab, n, 10_000, 9, pure=False, resources={"GPU": 1}).result()
            cells = "  ".join(f"{k} best {b:.3f} median {m:.3f} s" for k, (b, m) in result.items())
            print(f"{gpus} GPUs n={n}: {cells}", flush=True)


if __name__ == "__main__":
    main()
