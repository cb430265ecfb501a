"""Whether the guard's background readers slow a GPU computation down.

In one process, on the first GPU, the seed's speed-cube on Dask's threads scheduler,
alternating: alone; with the activity thread ticking (utilisation samples, the energy
counter, power, temperature: what a guarded task's worker reads every 0.25 s); with
the peak sampler reading this process's memory; with both. Prints the median and p95
of each over ``ROUNDS`` runs.
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
N, CHUNK, ROUNDS = 100_000, 10_000, 15


def main() -> None:
    import cupy
    from common import check_cube, p95, speed_cube_expr

    from prefect_gpu_dask.worker.activity import ActivityWatch
    from prefect_gpu_dask.worker.guard import PeakSampler
    from prefect_gpu_dask.worker.probe import open_probe

    cupy.zeros(1)
    probe = open_probe()
    activity = ActivityWatch(probe.activity_reader())
    peaks = PeakSampler(probe)

    def cube() -> None:
        check_cube(speed_cube_expr(N, CHUNK, True).compute(scheduler="threads", num_workers=8))

    def watched(activity_on: bool, peaks_on: bool):
        def run() -> None:
            if activity_on:
                activity.start(1)
            if peaks_on:
                peaks.start(1, 0)
            try:
                cube()
            finally:
                if activity_on:
                    activity.stop(1)
                if peaks_on:
                    peaks.stop(1, 0)

        return run

    variants = {
        "alone": watched(False, False),
        "activity thread": watched(True, False),
        "peak sampler": watched(False, True),
        "both (a guarded task)": watched(True, True),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    cube()
    for _ in range(ROUNDS):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    print(f"{'variant':<24} {'median s':>9} {'p95 s':>7}  ({ROUNDS} runs each, alternating)")
    for name, values in times.items():
        print(f"{name:<24} {statistics.median(values):9.4f} {p95(values):7.4f}")


if __name__ == "__main__":
    main()
