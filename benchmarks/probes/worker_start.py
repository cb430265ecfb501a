"""Whether how the GPU worker process started changes how fast the speed-cube runs in
it: Dask's threads scheduler on a pool of the host's cores, inside a ``gpu`` task run
on the default runner's worker forked from the package's server, on one spawned as
Dask spawns, and in a plain spawned process; ``--rounds`` rounds of the three in turn,
``--runs`` runs each after one warm-up.

    python benchmarks/probes/worker_start.py --rounds 2 --runs 10
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import in_child_process, use_readme_default  # noqa: E402

use_readme_default("worker-start")


def cubes(runs: int) -> list[float]:
    import concurrent.futures

    from benchmarks.common import device_cube_runs

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return device_cube_runs(runs, pool)


def in_runner(runs: int, spawn: bool) -> list[float]:
    from prefect import flow, task

    from prefect_gpu_dask import GPUDaskTaskRunner, forkserver

    method = forkserver.worker_start_method
    if spawn:
        forkserver.worker_start_method = lambda *args, **kwargs: "spawn"
    try:

        @flow(task_runner=GPUDaskTaskRunner())
        def probe() -> list[float]:
            return task(tags=["gpu"])(cubes).submit(runs).result()

        return probe()
    finally:
        forkserver.worker_start_method = method


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    results: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        results.setdefault("forked worker (the runner's)", []).extend(in_runner(args.runs, False))
        results.setdefault("spawned worker", []).extend(in_runner(args.runs, True))
        results.setdefault("plain process", []).extend(in_child_process(cubes, args.runs))
    print(f"# {args.rounds} rounds x {args.runs} runs, median ms; {os.cpu_count()} cores")
    for where, ts in results.items():
        tail = sorted(ts)[int(0.95 * (len(ts) - 1))]
        print(f"  {where:30s} {1000 * statistics.median(ts):8.1f}  (p95 {1000 * tail:.1f})")


if __name__ == "__main__":
    main()
