"""The speed-cube benchmark as a nightly flow: ``(x[::2, ::2] + 1).mean()`` of an N(10, 1) Dask array.

On a GPU worker the array is CuPy-backed, 100000 x 100000 float64 (80 GB) in
10000 x 10000 chunks; on CPU it is 4000 x 4000 in 1000 x 1000 chunks (a few seconds
on two cores). Either way the mean must come out at 11 (to 0.01).

One ``gpu`` task builds the array and computes it with ``compute_on_gpus``, which
spreads the chunks over every worker of the cluster without deadlocking the task
that waits for them.

    python flows/speed_cube.py                 # sizes chosen by the device
    python flows/speed_cube.py 2000 500        # n, chunk
"""

from __future__ import annotations

import os

# Before Prefect is imported: the embedded API server may need more than Prefect's
# default 20 s to start on a small, busy machine, and an offline host cannot send
# the server's telemetry (each failed attempt logs an error).
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import math
import sys
import time
from typing import Any

import dask.array as da
from prefect import flow, get_run_logger, task

from prefect_gpu_dask import GPUDaskTaskRunner, compute_on_gpus, gpu_available

EXPECTED_MEAN = 11.0
TOLERANCE = 0.01
GPU_SIZE = (100_000, 10_000)  # n, chunk: the benchmark's cube
CPU_SIZE = (4_000, 1_000)


def default_size(gpu: bool) -> tuple[int, int]:
    """``(n, chunk)``: the full benchmark size on a GPU, a few seconds' worth on CPU."""
    return GPU_SIZE if gpu else CPU_SIZE


def speed_cube_expr(n: int, chunk: int, xp_random_state: Any = None, seed: int | None = None) -> da.Array:
    """The benchmark's lazy expression: ``(x[::2, ::2] + 1).mean()`` with ``x ~ N(10, 1)``, n x n.

    ``xp_random_state`` is the per-chunk generator class: ``cupy.random.RandomState``
    for CuPy chunks, ``None`` for NumPy's (the dask default).
    """
    rs = da.random.RandomState(seed, RandomState=xp_random_state)
    x = rs.normal(10, 1, size=(n, n), chunks=(chunk, chunk))
    return (x[::2, ::2] + 1).mean()


def _random_state_class(gpu: bool) -> Any:
    if not gpu:
        return None
    import cupy

    return cupy.random.RandomState


@task(tags=["gpu"])
def cube_mean(n: int | None = None, chunk: int | None = None, seed: int | None = 0) -> dict[str, Any]:
    """Build the cube where this task runs (CuPy on a GPU worker) and time its mean."""
    gpu = gpu_available()
    default_n, default_chunk = default_size(gpu)
    n = n or default_n
    chunk = chunk or min(default_chunk, n)
    expr = speed_cube_expr(n, chunk, _random_state_class(gpu), seed)
    start = time.perf_counter()
    (mean,) = compute_on_gpus(expr)
    seconds = time.perf_counter() - start
    return {
        "mean": float(mean),
        "shape": [n, n],
        "chunks": [chunk, chunk],
        "n_chunks": math.ceil(n / chunk) ** 2,
        "seconds": seconds,
        "device": "GPU" if gpu else "CPU",
    }


@flow(name="speed-cube", task_runner=GPUDaskTaskRunner())
def speed_cube(n: int | None = None, chunk: int | None = None, seed: int | None = 0) -> dict[str, Any]:
    """Mean of ``x[::2, ::2] + 1`` for an n x n N(10, 1) array; asserts it is 11 +- 0.01.

    ``n``/``chunk`` left empty pick the device's size: 100000/10000 on a GPU,
    4000/1000 on CPU.
    """
    result = cube_mean.submit(n, chunk, seed).result()
    assert abs(result["mean"] - EXPECTED_MEAN) < TOLERANCE, (
        f"speed cube mean {result['mean']!r} is not {EXPECTED_MEAN} +- {TOLERANCE}"
    )
    get_run_logger().info(
        "speed cube %s in %s chunks on %s: mean %.6f in %.2f s",
        "x".join(map(str, result["shape"])),
        "x".join(map(str, result["chunks"])),
        result["device"],
        result["mean"],
        result["seconds"],
    )
    return result


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    print(speed_cube(*args))
