"""Which part of a Dask worker process makes the speed-cube slower there than in a plain
process: the same call (Dask's threads scheduler on its default pool, the mean read
back) timed in

- a plain spawned process;
- a plain spawned process that has imported distributed, Prefect and the package;
- a plain spawned process whose CUDA context Numba made (as dask-cuda makes it);
- a plain ``LocalCluster`` worker (a Nanny's process, no plugins): in a task's thread,
  on a thread the task starts, and on its event loop's thread (``client.run``: the loop
  blocked meanwhile);
- a quiet ``LocalCluster`` worker: its event loop's periodic work off (the tick, the
  system and memory monitors, the profiler), in a task's thread;
- a ``LocalCUDACluster`` worker (dask-cuda, no plugins of this package), where a GPU is;
- the default runner's GPU worker, in a plain Dask task and in a ``gpu`` task run;

alternating over ``--rounds`` rounds of ``--runs`` runs each, every process kept between
rounds (one warm-up run each time).

    python benchmarks/probes/worker_bisect.py --rounds 4 --runs 5
"""

import argparse
import concurrent.futures
import multiprocessing
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import device_cube_runs, use_readme_default  # noqa: E402

use_readme_default("worker-bisect")


# ``runs`` timed speed-cubes on Dask's threads scheduler, after one warm-up.
cube_times = device_cube_runs


# A worker's periodic work on its event loop's thread, off (or as rare as it gets).
QUIET = {
    "distributed.admin.tick.interval": "1h",
    "distributed.admin.tick.limit": "2h",
    "distributed.admin.system-monitor.interval": "1h",
    "distributed.worker.profile.enabled": False,
    "distributed.worker.profile.interval": "1h",
    "distributed.worker.profile.cycle": "2h",
    "distributed.worker.memory.monitor-interval": "1h",
}


def on_new_thread(runs: int) -> list[float]:
    """``cube_times`` on a plain thread of this process, not the calling one."""
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(cube_times, runs).result()


def import_stack() -> None:
    import distributed  # noqa: F401
    import prefect  # noqa: F401

    import prefect_gpu_dask.worker.guard  # noqa: F401


def numba_context() -> None:
    from prefect_gpu_dask import gpu_available

    if gpu_available():
        from numba import cuda

        cuda.current_context()


def child(initializer=None) -> concurrent.futures.ProcessPoolExecutor:
    spawn = multiprocessing.get_context("spawn")
    return concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn, initializer=initializer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    import dask
    from distributed import Client, LocalCluster
    from prefect import flow, task

    from prefect_gpu_dask import GPUDaskTaskRunner, gpu_available

    @flow(task_runner=GPUDaskTaskRunner())
    def bisect() -> dict[str, list[float]]:
        from prefect.context import FlowRunContext

        runner_client = FlowRunContext.get().task_runner.client
        runner_worker = sorted(runner_client.scheduler_info(n_workers=-1)["workers"])[0]
        processes = {
            "plain process": child(),
            "plain process, distributed + Prefect + package imported": child(import_stack),
            "plain process, context made by Numba": child(numba_context),
        }
        clusters = {"plain LocalCluster worker": LocalCluster(n_workers=1, threads_per_worker=1)}
        with dask.config.set(QUIET):
            clusters["quiet LocalCluster worker"] = LocalCluster(n_workers=1, threads_per_worker=1)
        if gpu_available():
            from dask_cuda import LocalCUDACluster

            clusters["LocalCUDACluster worker"] = LocalCUDACluster(threads_per_worker=1)
        clients = {name: Client(cluster) for name, cluster in clusters.items()}
        runs = args.runs
        calls = {name: (lambda p=p: p.submit(cube_times, runs).result()) for name, p in processes.items()}
        for name, client in clients.items():
            calls[f"{name}, task thread"] = lambda c=client: c.submit(cube_times, runs, pure=False).result()
        calls["plain LocalCluster worker, a thread the task starts"] = lambda: (
            clients["plain LocalCluster worker"].submit(on_new_thread, runs, pure=False).result()
        )
        calls["plain LocalCluster worker, event loop thread"] = lambda: next(
            iter(clients["plain LocalCluster worker"].run(cube_times, args.runs).values())
        )
        calls["default runner's GPU worker, plain Dask task"] = lambda: runner_client.submit(
            cube_times, args.runs, workers=[runner_worker], pure=False
        ).result()
        calls["default runner's GPU worker, gpu task run"] = lambda: (
            task(tags=["gpu"])(cube_times).submit(runs).result()
        )
        times: dict[str, list[float]] = {name: [] for name in calls}
        try:
            for _ in range(args.rounds):
                for name, call in calls.items():
                    times[name].extend(call())
        finally:
            for client in clients.values():
                client.close()
            for cluster in clusters.values():
                cluster.close()
            for pool in processes.values():
                pool.shutdown()
        return times

    times = bisect()
    plain = statistics.median(times["plain process"])
    print(f"# {args.rounds} rounds x {args.runs} runs, alternating; ms; {os.cpu_count()} cores")
    print(f"{'':58s} {'median':>8s} {'p95':>8s} {'/ plain':>8s}")
    for name, values in times.items():
        values = sorted(values)
        p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
        median = statistics.median(values)
        print(f"{name:58s} {1000 * median:8.1f} {1000 * p95:8.1f} {median / plain:8.3f}")


if __name__ == "__main__":
    main()
