"""How many threads the in-place pool of ``compute_on_gpus`` should have on one GPU:
the speed-cube on Dask's threads scheduler over pools of ``--sizes`` threads (the
in-place pool's kind), alternating over ``--rounds`` rounds, inside a ``gpu`` task run
on the default runner's worker, and over plain pools of the same sizes in a plain
process. A GPU chunk's thread mostly waits for the driver (allocations, the generator's
set-up), with the GIL released; more threads than cores may keep more launches going.

    python benchmarks/probes/pool_sizes.py --rounds 6 --sizes 8,16,32,48
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import in_child_process, use_readme_default  # noqa: E402

use_readme_default("pool-sizes")


def sizes_here(sizes: list[int], rounds: int) -> dict[int, list[float]]:
    import concurrent.futures

    import dask

    from benchmarks.common import check_cube, speed_cube_expr
    from flows.speed_cube import default_size
    from prefect_gpu_dask import gpu_available
    from prefect_gpu_dask.worker import compute

    gpu = gpu_available()
    n, chunk = default_size(gpu)
    on_worker = compute._compat.current_worker() is not None
    pools = {k: compute._pool_of(k) if on_worker else concurrent.futures.ThreadPoolExecutor(k) for k in sizes}
    times: dict[int, list[float]] = {k: [] for k in sizes}
    for round_ in range(rounds + 1):
        for k in sizes if round_ % 2 else reversed(sizes):
            start = time.perf_counter()
            check_cube(dask.compute(speed_cube_expr(n, chunk, gpu), scheduler="threads", pool=pools[k])[0])
            if round_:
                times[k].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--sizes", default="8,16,32,48")
    args = parser.parse_args()
    sizes = [int(k) for k in args.sizes.split(",")]

    from prefect import flow, task

    from prefect_gpu_dask import GPUDaskTaskRunner

    in_task = task(tags=["gpu"])(sizes_here)

    @flow(task_runner=GPUDaskTaskRunner())
    def probe() -> dict[int, list[float]]:
        return in_task.submit(sizes, args.rounds).result()

    results = {"gpu task run, the in-place pool's kind": probe()}
    results["plain process, plain pools"] = in_child_process(sizes_here, sizes, args.rounds)
    print(f"# median of {args.rounds} alternating runs (after one warm-up), ms; {os.cpu_count()} cores")
    for where, times in results.items():
        print(f"## {where}")
        for k, ts in times.items():
            print(f"  {k:3d} threads {1000 * statistics.median(ts):8.1f}  (best {1000 * min(ts):.1f})")


if __name__ == "__main__":
    main()
