"""Where the speed-cube's time goes on the default runner's GPU worker, against raw
Dask threads in a plain process: the same calls (``compute_on_gpus``; Dask's threads
scheduler on its own pool; on ``compute_on_gpus``'s in-place pool), each with the mean
read back, and the in-place pool's call with Python's garbage collector off, and with
the process's threads allowed every core (a ``LocalCUDACluster`` worker is pinned to
its GPU's cores), alternating over ``--rounds`` rounds; with the garbage collector's
time in each call and the cores the process may use:

- inside one ``gpu`` task run (Prefect's engine, the guard);
- in a plain Dask task on the same worker (``client.submit``, neither);
- in a plain spawned process, with and without the environment a Nanny gives its
  worker (``distributed.nanny.pre-spawn-environ``: ``MALLOC_TRIM_THRESHOLD_`` among it).

    python benchmarks/probes/in_runner_knobs.py --rounds 6
"""

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import in_child_process, use_readme_default  # noqa: E402

use_readme_default("in-runner-knobs")


def variants(rounds: int) -> dict[str, list[float]]:
    """The cube's calls, alternating, ``rounds`` timed runs each after one warm-up."""
    import concurrent.futures

    import dask

    from benchmarks.common import check_cube, speed_cube_expr
    from flows.speed_cube import default_size
    from prefect_gpu_dask import compute_on_gpus, gpu_available
    from prefect_gpu_dask.worker import compute

    gpu = gpu_available()
    n, chunk = default_size(gpu)
    plain = concurrent.futures.ThreadPoolExecutor(max(os.cpu_count() or 1, 8))
    calls = {
        "compute_on_gpus": lambda: compute_on_gpus(speed_cube_expr(n, chunk, gpu))[0],
        "threads, Dask's pool": lambda: dask.compute(speed_cube_expr(n, chunk, gpu), scheduler="threads")[0],
        "threads, a plain pool of the cores": lambda: dask.compute(
            speed_cube_expr(n, chunk, gpu), scheduler="threads", pool=plain
        )[0],
    }
    in_place = compute._in_place_pool() if compute._compat.current_worker() is not None else plain
    calls["threads, the in-place pool"] = lambda: dask.compute(
        speed_cube_expr(n, chunk, gpu), scheduler="threads", pool=in_place
    )[0]

    def gc_off():
        gc.disable()
        try:
            return calls["threads, the in-place pool"]()
        finally:
            gc.enable()

    pinned = os.sched_getaffinity(0)
    every_core = set(range(os.cpu_count() or 1))

    def all_cores():
        tids = os.listdir("/proc/self/task")
        for tid in tids:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), every_core)
        try:
            return calls["threads, the in-place pool"]()
        finally:
            for tid in tids:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), pinned)

    calls["in-place pool, gc off"] = gc_off
    calls["in-place pool, every core"] = all_cores
    collecting: list[float] = []
    started: list[float] = []

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            collecting.append(time.perf_counter() - started.pop())

    gc.callbacks.append(timed)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for name in calls:
        times[f"{name}: gc ms"] = []
    for round_ in range(rounds + 1):
        for name, call in calls.items() if round_ % 2 else reversed(calls.items()):
            collecting.clear()
            start = time.perf_counter()
            check_cube(call())
            if round_:
                times[name].append(time.perf_counter() - start)
                times[f"{name}: gc ms"].append(sum(collecting))
    gc.callbacks.remove(timed)
    plain.shutdown()
    times[f"cores {len(pinned)} of {len(every_core)}: {sorted(pinned)}"] = []
    return times


def nanny_environment() -> dict[str, str]:
    """What a Nanny puts into its worker's environment before it starts (glibc reads
    ``MALLOC_*`` as the process starts: a running one cannot take them)."""
    import dask
    import distributed  # noqa: F401  its config

    configured = dask.config.get("distributed.nanny.pre-spawn-environ") or {}
    return {name: str(value) for name, value in configured.items() if value is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    from prefect import flow, task
    from prefect.context import FlowRunContext

    from prefect_gpu_dask import GPUDaskTaskRunner

    gpu_task = task(tags=["gpu"])(variants)

    @flow(task_runner=GPUDaskTaskRunner())
    def probe(rounds: int) -> dict[str, dict[str, list[float]]]:
        client = FlowRunContext.get().task_runner.client
        worker = sorted(client.nthreads())[0]
        return {
            "gpu task run": gpu_task.submit(rounds).result(),
            "plain Dask task": client.submit(variants, rounds, workers=[worker], pure=False).result(),
        }

    results = probe(args.rounds)
    results["plain process"] = in_child_process(variants, args.rounds)
    saved = dict(os.environ)
    os.environ.update(environ := nanny_environment())
    try:
        results[f"plain process, a Nanny's environment {environ}"] = in_child_process(variants, args.rounds)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    print(f"# median of {args.rounds} alternating runs (after one warm-up), ms")
    for where, times in results.items():
        print(f"## {where}")
        for name, ts in times.items():
            if not ts:
                print(f"  {name}")
            elif name.endswith("gc ms"):
                print(f"  {name:44s} {1000 * statistics.mean(ts):8.2f}  mean, max {1000 * max(ts):.1f}")
            else:
                print(f"  {name:44s} {1000 * statistics.median(ts):8.1f}  (best {1000 * min(ts):.1f})")


if __name__ == "__main__":
    main()
