"""guard: the guard's ``begin()`` + ``end()`` around an empty task with the real NVML probe,
each of its readings on its own, and the health check (before each ``gpu`` task, and the
full one of the timer): in a task's thread on a GPU worker that has just run the
speed-cube, where the guard runs, and in a plain process.

The worker runs on the last GPU, alone there as each of the default runner's workers is
on its own GPU (the benchmark's own process holds no CUDA context: its GPU work runs in
child processes); then again on GPU 0 beside another process holding a CUDA context
there, as two clusters on one GPU share it: there the guard reads the process list with
every reading."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.common import Options, another_process_on_gpu, in_child_process, runs_of

SAMPLES = 2000


def run(options: Options) -> Iterator[tuple[str, Any]]:
    if not options.gpu:  # no GPU (a no-op guard), or --quick: a process of its own all the same
        yield "guard", in_child_process(bench_guard, SAMPLES)
        return
    import os

    from prefect_gpu_dask.nvml import visible_gpu_count

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = (
        [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(visible_gpu_count())]
    )
    in_worker = on_gpu_worker(SAMPLES, options.n, options.chunk, devices[-1])
    try:
        with another_process_on_gpu(devices[0]):
            shared = on_gpu_worker(SAMPLES, options.n, options.chunk, devices[0])
    except RuntimeError as exc:  # e.g. a GPU in exclusive-process mode
        shared = {"error": str(exc)}
    plain = in_child_process(bench_guard, SAMPLES) | {"where": "a process of its own, alone on its GPU"}
    yield "guard", in_worker | {"sharing_its_gpu": shared, "in_plain_process": plain}


def on_gpu_worker(samples: int, n: int, chunk: int, device: str) -> dict[str, Any]:
    """``bench_guard`` in a task on a one-GPU ``LocalCUDACluster`` worker on GPU
    ``device``, after that worker computed the speed-cube: the process, its CUDA context
    and CuPy's pool as a guarded task's thread finds them."""
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    from benchmarks.common import threads_cube_runs

    with LocalCUDACluster(CUDA_VISIBLE_DEVICES=device) as cluster, Client(cluster) as client:
        client.submit(threads_cube_runs, n, chunk, 1, pure=False).result()  # its values stay there
        measured = client.submit(bench_guard, samples, pure=False).result()
        return measured | {"where": f"gpu worker task, GPU {device}"}


def bench_guard(samples: int) -> dict[str, Any]:
    """begin()+end() of the guard around an empty task, with the real NVML probe."""
    import asyncio

    from prefect_gpu_dask.health import HealthMonitor
    from prefect_gpu_dask.settings import RunnerSettings
    from prefect_gpu_dask.worker.guard import GPUMemoryGuard

    class FakeWorker:
        address, name = "bench", "bench"

        def log_event(self, topic, msg):
            pass

    try:  # a GPU task's worker has CuPy loaded: the guard then reads its pool too
        import cupy

        cupy.zeros(1)
    except ImportError:
        pass
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    # Timed in a quiet process: the sections before leave events and logs still being sent.
    EventsWorker.drain_all()
    APILogWorker.drain_all()
    guard = GPUMemoryGuard(RunnerSettings(health_check_s=None))  # health: timed on its own below
    asyncio.run(guard.setup(FakeWorker()))
    if not guard.active:
        return {"guard_us": None, "note": "no GPU: the guard is a no-op"}
    health = HealthMonitor(guard.probe.health_reader())
    checks, screens = [], []
    for _ in range(samples):
        start = time.perf_counter()
        health.check()
        checks.append(time.perf_counter() - start)
    for _ in range(samples):
        start = time.perf_counter()
        health.screen()
        screens.append(time.perf_counter() - start)
    costs = []
    for _ in range(samples):
        start = time.perf_counter()
        ticket, before, started = guard.begin()
        guard.end(ticket, before, started)
        costs.append(time.perf_counter() - start)
    activity = []  # of the guard's cost: the task thread's utilisation/energy/temperature part
    watch = guard._activity
    for ticket in range(samples if watch is not None else 0):
        start = time.perf_counter()
        watch.start(-1 - ticket)
        watch.stop(-1 - ticket)
        activity.append(time.perf_counter() - start)
    sampler = guard._sampler

    def peak_sampler_start_stop() -> None:
        sampler.start(-1, 0)
        sampler.stop(-1, 0)

    parts = {  # each reading and step of begin()+end() on its own
        "process_read": guard._read_process,  # the device's figure first, the list if it moved
        "process_list_read": guard.probe.sample_process,  # the driver's process list alone
        "device_read": getattr(guard.probe, "sample_device", None),  # where the package has it
        "allocators_read": guard._read_allocators,
        "device_and_process_read": guard.probe.sample,
        "after_read": guard._read_after,
        "peak_sampler_start_stop": peak_sampler_start_stop,
    }
    parts = {name: step for name, step in parts.items() if step is not None}
    parts_us = {name: statistics.median(runs_of(step, samples)) * 1e6 for name, step in parts.items()}
    pool = _cupy_pool()
    return {
        "where": "this process",
        "gpu_processes": len(guard.probe.process_pids()),  # each is an entry of the process read
        "process_threads": threading.active_count(),
        "cupy_pool_bytes": pool.total_bytes() if pool else None,
        "guard_us": statistics.median(costs) * 1e6,
        "nvml_sample_us": parts_us["device_and_process_read"],  # one full probe read
        "guard_p95_us": sorted(costs)[int(0.95 * len(costs))] * 1e6,
        "health_screen_us": statistics.median(screens) * 1e6,  # before each gpu task
        "health_check_us": statistics.median(checks) * 1e6,  # the timer's, and where the screen reads all
        "guard_with_screen_us": (statistics.median(costs) + statistics.median(screens)) * 1e6,
        "activity_us": statistics.median(activity) * 1e6 if activity else None,
        "parts_us": parts_us,
        "health_limits": list(health.limits),
        "samples": samples,
    }


def _cupy_pool() -> Any:
    try:
        import cupy
    except ImportError:
        return None
    return cupy.get_default_memory_pool()
