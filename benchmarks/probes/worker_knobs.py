"""What the GPU worker's other work costs a speed-cube inside a ``gpu`` task: the cube
through the default runner on the README default, with one of the worker's background
jobs paused at a time (the guard's activity thread, its peak sampler backed off
further; on the worker's event loop: Dask's tick, memory monitor, system monitor and
profiler; all of the loop's, all of them), alternating over
``--rounds`` rounds of ``--runs`` cubes each, one cluster throughout; and raw Dask
threads in a plain process. Medians of the seconds inside the task (``compute_on_gpus``)
and around it (submit to result).

    python benchmarks/probes/worker_knobs.py --rounds 4 --runs 6
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import in_child_process, threads_cube_runs, use_readme_default  # noqa: E402

use_readme_default("worker-knobs")

LOOP_JOBS = {
    "tick": ("tick",),
    "memory": ("memory_monitor",),
    "monitor": ("monitor",),
    "profiler": ("profile", "profile-cycle"),
}


def pause(knob: str, dask_worker=None) -> None:
    """In the worker: pause one background job (``knob``), or resume all ("")."""
    from prefect_gpu_dask.worker.guard import guard_of

    guard = guard_of(dask_worker)
    sampler = getattr(guard, "_sampler", None)  # no GPU: no guard's threads to pause
    saved = getattr(dask_worker, "_knob_saved", None)
    if saved is None and sampler is not None:
        saved = dask_worker._knob_saved = {"activity": guard._activity, "peak": sampler._max_interval}
    if sampler is not None:
        guard._activity = saved["activity"]
        sampler._max_interval = saved["peak"]
    for names in LOOP_JOBS.values():
        for name in names:
            if (
                name in dask_worker.periodic_callbacks
                and not dask_worker.periodic_callbacks[name].is_running()
            ):
                dask_worker.periodic_callbacks[name].start()
    for one in knob.split("+") if knob else ():
        if one == "activity" and sampler is not None:
            guard._activity = None
        elif one == "peak-1s" and sampler is not None:
            sampler._max_interval = 1.0
        elif one in LOOP_JOBS:
            for name in LOOP_JOBS[one]:
                if name in dask_worker.periodic_callbacks:
                    dask_worker.periodic_callbacks[name].stop()


KNOBS = [
    "",
    "activity",
    "peak-1s",
    "tick",
    "memory",
    "monitor",
    "profiler",
    "tick+memory+monitor+profiler",
    "activity+peak-1s+tick+memory+monitor+profiler",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--runs", type=int, default=6)
    args = parser.parse_args()

    from prefect import flow
    from prefect.context import FlowRunContext

    from benchmarks.common import warm_every_worker
    from flows.speed_cube import cube_mean, default_size
    from prefect_gpu_dask import GPUDaskTaskRunner, gpu_available

    @flow(task_runner=GPUDaskTaskRunner())
    def knobs(rounds: int, runs: int) -> dict[str, dict[str, list[float]]]:
        client = FlowRunContext.get().task_runner.client
        warm_every_worker(cube_mean)
        times = {k: {"around": [], "inside": []} for k in KNOBS}
        for round_ in range(rounds):
            for knob in KNOBS if round_ % 2 == 0 else reversed(KNOBS):
                client.run(pause, knob)
                cube_mean.submit().result()  # settles after the switch
                for _ in range(runs):
                    start = time.perf_counter()
                    inside = cube_mean.submit().result()["seconds"]
                    times[knob]["around"].append(time.perf_counter() - start)
                    times[knob]["inside"].append(inside)
        client.run(pause, "")
        return times

    times = knobs(args.rounds, args.runs)
    gpu = gpu_available()
    raw = in_child_process(threads_cube_runs, *default_size(gpu), args.rounds * args.runs) if gpu else None
    print(f"# {args.rounds} rounds x {args.runs} cubes, alternating; medians, ms")
    print(f"{'paused':40s} {'submit→result':>14s} {'inside':>8s} {'around':>8s}")
    for knob, t in times.items():
        total, inside = statistics.median(t["around"]), statistics.median(t["inside"])
        around = statistics.median(a - i for a, i in zip(t["around"], t["inside"], strict=True))
        print(f"{knob or '(nothing)':40s} {1000 * total:14.1f} {1000 * inside:8.1f} {1000 * around:8.1f}")
    if raw:
        print(f"{'raw Dask threads, plain process':40s} {1000 * statistics.median(raw):14.1f}")


if __name__ == "__main__":
    main()
