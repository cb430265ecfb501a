"""The demo flow: GPU-tagged work routed to GPU workers, CPU work anywhere.

Runs on the embedded default (a local Prefect API on SQLite, a local Dask cluster):
a LocalCUDACluster when this host has GPUs, a CPU LocalCluster otherwise.

    python flows/demo.py
"""

from __future__ import annotations

import os

# Before Prefect is imported: the embedded API server may need more than Prefect's
# default 20 s to start on a small, busy machine, and an offline host cannot send
# the server's telemetry (each failed attempt logs an error).
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from prefect import flow, task

from prefect_gpu_dask import GPUDaskTaskRunner, array_module, gpu_available


@task(tags=["gpu"])
def sum_of_squares(n: int) -> float:
    """Runs where a GPU is; uses CuPy there and NumPy on a CPU fallback."""
    xp = array_module()
    x = xp.arange(n, dtype=xp.float64)
    return float((x * x).sum())


@task
def expected(n: int) -> float:
    return (n - 1) * n * (2 * n - 1) / 6


@task
def where_am_i() -> str:
    return "GPU" if gpu_available() else "CPU"


@flow(name="prefect-gpu-dask-demo", task_runner=GPUDaskTaskRunner())
def demo(sizes: list[int] = [10_000, 100_000, 1_000_000]) -> dict[str, float]:  # noqa: B006
    results = sum_of_squares.map(sizes)
    checks = expected.map(sizes)
    device = where_am_i.submit()
    totals = {str(n): r.result() for n, r in zip(sizes, results)}
    for n, got, want in zip(sizes, totals.values(), (c.result() for c in checks)):
        assert abs(got - want) <= 1e-9 * want, f"sum of squares below {n}: got {got}, want {want}"
    print(f"demo: {len(sizes)} gpu-tagged tasks checked on {device.result()}: {totals}")
    return totals


if __name__ == "__main__":
    demo()
