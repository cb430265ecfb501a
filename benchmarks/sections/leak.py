"""leak: cluster start and the first task; then a task that leaks 512 MiB, five times, and
the time from its result to the next task running in the replacement worker on that GPU."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.common import Options, cluster_start_and_first_task, spread


def run(options: Options) -> Iterator[tuple[str, Any]]:
    yield "leak", bench_leak_and_start(options.gpu)


def bench_leak_and_start(gpu: bool, cycles: int = 5) -> dict[str, Any]:
    """Cluster start and first task; then ``cycles`` times: a task leaks 512 MiB, and the
    clock runs from its result to the next task that runs in the replacement worker on
    that GPU (``leak_to_serving_s``)."""
    from prefect import flow, task
    from prefect.context import FlowRunContext

    from prefect_gpu_dask import GPUDaskTaskRunner

    @task(tags=["gpu"])
    def leak() -> tuple[int, str]:
        import cupy

        leak.kept = cupy.ones(512 * 2**20 // 8)  # noqa: B010  # held by the task object: a leak
        return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]

    @task(tags=["gpu"])
    def pid() -> tuple[int, str]:
        return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]

    @flow(task_runner=GPUDaskTaskRunner(leak_threshold="256MiB"))
    def leaky() -> dict[str, Any]:
        runner = FlowRunContext.get().task_runner
        # The first task run loads Prefect's engine on its worker.
        started, first_task = cluster_start_and_first_task(runner, pid)
        out: dict[str, Any] = {"cluster_start_s": started, "first_task_s": first_task}
        if not gpu:
            return out
        [pid.submit().result() for _ in range(8)]  # warm
        serving, restarts = [], []
        for cycle in range(cycles):
            old, device = leak.submit().result()
            leaked_at = time.perf_counter()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the next task on that GPU, in a new process
                new, where = pid.submit().result()
                if where == device and new != old:
                    break
            serving.append(time.perf_counter() - leaked_at)
            while len(runner.restarts) <= cycle and time.monotonic() < deadline:
                time.sleep(0.01)
            restarts.append(runner.restarts[cycle])
        free = [r.memory_free_s for r in restarts if r.memory_free_s is not None]
        out.update(
            {
                "leak_to_serving": spread(serving),
                "leak_to_serving_s": statistics.median(serving),
                "memory_free_s": statistics.median(free) if free else None,
                # The recycler's own clock: from the record's arrival in the flow.
                "safe_point_s": statistics.median(r.safe_point_s or 0 for r in restarts),
                "restart_s": statistics.median(r.restart_s for r in restarts),
                "serving_s": statistics.median(r.serving_s for r in restarts),
                "restarts": [r.to_payload() for r in restarts],
            }
        )
        return out

    return leaky()
