"""Single-task latency through the runner on one GPU: trivial, gpu-tagged, and the
speed-cube (total vs in-task time), so the 1-GPU cube gap splits into Prefect+Dask
overhead and compute."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from prefect import flow, task

from prefect_gpu_dask import GPUDaskTaskRunner, compute_on_gpus


@task
def noop():
    return 1


@task(tags=["gpu"])
def gnoop():
    return 1


@task(tags=["gpu"])
def cube():
    from common import check_cube, speed_cube_expr

    s = time.perf_counter()
    check_cube(compute_on_gpus(speed_cube_expr(100_000, 10_000, True))[0])
    return time.perf_counter() - s


def lat(t, reps=15):
    ts = []
    for _ in range(reps):
        s = time.perf_counter()
        t.submit().result()
        ts.append(time.perf_counter() - s)
    ts = sorted(ts[3:])
    return f"best {ts[0] * 1e3:.1f} ms median {ts[len(ts) // 2] * 1e3:.1f} ms"


@flow(task_runner=GPUDaskTaskRunner(cluster_kwargs={"CUDA_VISIBLE_DEVICES": os.environ.get("DEVS", "0")}))
def main():
    print("noop", lat(noop), flush=True)
    print("gpu-tagged noop", lat(gnoop), flush=True)
    rows = []
    for _ in range(6):
        s = time.perf_counter()
        inside = cube.submit().result()
        rows.append((time.perf_counter() - s, inside))
    rows = rows[1:]
    best = min(rows)
    print(
        f"cube total {best[0]:.3f} in-task {best[1]:.3f} overhead {(best[0] - best[1]) * 1e3:.1f} ms",
        f"(median overhead {sorted(t - i for t, i in rows)[len(rows) // 2] * 1e3:.1f} ms)",
        flush=True,
    )
    from common import check_cube, speed_cube_expr

    ts = []
    for _ in range(4):
        s = time.perf_counter()
        check_cube(speed_cube_expr(100_000, 10_000, True).compute(scheduler="threads"))
        ts.append(time.perf_counter() - s)
    print(f"raw threads in flow process best {min(ts[1:]):.3f}", flush=True)


if __name__ == "__main__":
    main()
