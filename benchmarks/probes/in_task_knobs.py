"""Why the speed-cube inside a gpu task on one GPU is slower than raw Dask threads in
the flow process. Alternates, on one GPU worker of a LocalCUDACluster with the memory
guard registered as the runner does: compute_on_gpus bare; inside guard.begin()/end()
with peak readings every 5 ms or backing off to 100 ms; the threads scheduler with the
worker's 8 threads (compute_on_gpus's own cost apart), 16, or the host's core count; and, outside the cluster,
raw Dask threads in this process."""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
N, CHUNK, ROUNDS = 100_000, 10_000, 7


def variants_in_worker():
    import dask
    from common import check_cube, speed_cube_expr

    from prefect_gpu_dask import compute_on_gpus
    from prefect_gpu_dask.worker.guard import current_guard

    def bare():
        check_cube(compute_on_gpus(speed_cube_expr(N, CHUNK, True))[0])

    def guarded(max_interval):
        def run():
            guard = current_guard()
            guard._sampler._max_interval = max_interval
            ticket, before, started = guard.begin()
            try:
                bare()
            finally:
                guard.end(ticket, before, started)

        return run

    def threads(n):
        return lambda: check_cube(
            dask.compute(speed_cube_expr(N, CHUNK, True), scheduler="threads", num_workers=n)[0]
        )

    runs = {
        "compute_on_gpus": bare,
        "guarded, peaks every 5 ms": guarded(0.005),
        "guarded, peaks back off": guarded(0.1),
        "threads=8 (the worker's)": threads(8),
        "threads=16": threads(16),
        f"threads={os.cpu_count()} (host cores)": threads(os.cpu_count()),
    }
    times = {name: [] for name in runs}
    for i in range(ROUNDS):
        for name, fn in runs.items() if i % 2 else reversed(runs.items()):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: (min(ts[1:]), statistics.median(ts[1:])) for name, ts in times.items()}


def main():
    from common import check_cube, speed_cube_expr
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    from prefect_gpu_dask.flow.cluster import GPU_WORKER_THREADS
    from prefect_gpu_dask.settings import RunnerSettings
    from prefect_gpu_dask.worker.guard import GPUMemoryGuard

    with (
        LocalCUDACluster(threads_per_worker=GPU_WORKER_THREADS, resources={"GPU": 1}) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(GPUMemoryGuard(RunnerSettings()), name=GPUMemoryGuard.name)
        results = client.submit(variants_in_worker, pure=False, resources={"GPU": 1}).result()
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        check_cube(speed_cube_expr(N, CHUNK, True).compute(scheduler="threads"))
        times.append(time.perf_counter() - start)
    results["raw threads, flow process"] = (min(times[1:]), statistics.median(times[1:]))
    for name, (best, median) in results.items():
        print(f"{name:34s} best {best:.3f} s  median {median:.3f} s", flush=True)


if __name__ == "__main__":
    main()
