"""tagged: trivial ``gpu``-tagged task runs against untagged ones through the runner, on a
``prefect server start`` backed by SQLite and one backed by PostgreSQL (skipped, saying
why, where PostgreSQL cannot run). Also ``benchmarks/per_task_gpu.py`` on its own.

The Dask cluster is the runner's: one worker per GPU where there are GPUs, else one CPU
worker labelled ``GPU=1``. Each round times submit to last result, alternating tagged and
untagged, after a warm-up; between rounds the server is let catch up on the previous
round's events (timed as ``catch_up_s``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.common import WARM_TASKS, Options, p95
from benchmarks.servers import on_postgres, using_prefect_server


def run(options: Options) -> Iterator[tuple[str, Any]]:
    yield "per_task_gpu", compare(options.tagged_tasks, options.tagged_rounds)


def caught_up(flow_run_id: str, task_runs: int, timeout: float = 300) -> float:
    """Seconds until the API has recorded ``task_runs`` final task runs of the flow run."""
    from prefect.client.orchestration import get_client

    start = time.monotonic()
    only_this = {
        "flow_runs": {"id": {"any_": [flow_run_id]}},
        "task_runs": {"state": {"type": {"any_": ["COMPLETED"]}}},
    }
    with get_client(sync_client=True) as client:
        while time.monotonic() - start < timeout:
            if client.request("POST", "/task_runs/count", json=only_this).json() >= task_runs:
                break
            time.sleep(0.5)
    return time.monotonic() - start


def measure(n: int, rounds: int, runner_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Rounds of ``n`` tagged and ``n`` untagged task runs, reported to the current API."""
    from prefect import flow, task
    from prefect.context import FlowRunContext
    from prefect.settings import PREFECT_LOGGING_TO_API_ENABLED, temporary_settings

    from prefect_gpu_dask import GPUDaskTaskRunner

    @task
    def noop(i: int) -> int:
        return i

    kinds = {"untagged": noop, "tagged": noop.with_options(tags=["gpu"])}

    @flow(task_runner=GPUDaskTaskRunner(guard="off", **runner_kwargs))
    def batch(kind: str) -> tuple[float, str]:
        job = kinds[kind]
        assert all(f.result() < 0 for f in job.map(range(-WARM_TASKS, 0)))  # every worker thread warm
        start = time.perf_counter()
        assert [f.result() for f in job.map(range(n))] == list(range(n))
        return time.perf_counter() - start, str(FlowRunContext.get().flow_run.id)

    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    catch_up: list[float] = []
    with temporary_settings({PREFECT_LOGGING_TO_API_ENABLED: False}):
        for _ in range(rounds):
            for kind in kinds:
                elapsed, flow_run_id = batch(kind)
                times[kind].append(elapsed)
                catch_up.append(caught_up(flow_run_id, n + WARM_TASKS))
                late = catch_up[-1]
                print(f"  {kind:9s} {elapsed:7.2f} s (server caught up {late:.1f} s later)", flush=True)
    out: dict[str, Any] = {}
    for kind, values in times.items():
        out[f"{kind}_median_s"] = statistics.median(values)
        out[f"{kind}_p95_s"] = p95(values)
        out[f"{kind}_runs_s"] = values
    out["tagged_over_untagged"] = out["tagged_median_s"] / out["untagged_median_s"]
    out["catch_up_median_s"] = statistics.median(catch_up)
    return out


def runner_kwargs() -> dict[str, Any]:
    """The runner's own cluster where there are GPUs, else one CPU worker labelled ``GPU=1``."""
    from prefect_gpu_dask.nvml import visible_gpu_count

    if visible_gpu_count():
        return {}
    return {
        "cluster_class": "distributed.LocalCluster",
        "cluster_kwargs": {"n_workers": 1, "threads_per_worker": 8, "resources": {"GPU": 1}},
    }


def compare(tasks: int, rounds: int) -> dict[str, Any]:
    """Tagged against untagged on SQLite and on PostgreSQL (skipped, saying why, without it)."""
    kwargs = runner_kwargs()
    result: dict[str, Any] = {
        "tasks": tasks,
        "rounds": rounds,
        "cluster": "one CPU worker labelled GPU=1, 8 threads" if kwargs else "LocalCUDACluster",
    }
    print(f"sqlite ({tasks} tasks x {rounds} rounds)", flush=True)
    with using_prefect_server():
        result["sqlite"] = measure(tasks, rounds, kwargs)
    print("postgres", flush=True)
    result["postgres"] = on_postgres(lambda: measure(tasks, rounds, kwargs))
    result["summary"] = {
        "tasks": tasks,
        "rounds": rounds,
        "sqlite_s": result["sqlite"]["tagged_median_s"],
        "postgres_s": result["postgres"].get("tagged_median_s"),
        "tagged_over_untagged_sqlite": result["sqlite"]["tagged_over_untagged"],
        "tagged_over_untagged_postgres": result["postgres"].get("tagged_over_untagged"),
    }
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{'database':10s} {'untagged':>16s} {'tagged':>16s} {'ratio':>6s} {'catch-up':>9s}")
    for name in ("sqlite", "postgres"):
        r = result[name]
        if "skipped" in r:
            print(f"{name:10s} skipped: {r['skipped']}")
            continue
        print(
            f"{name:10s} {r['untagged_median_s']:7.2f} (p95 {r['untagged_p95_s']:5.2f})"
            f" {r['tagged_median_s']:7.2f} (p95 {r['tagged_p95_s']:5.2f})"
            f" {r['tagged_over_untagged']:6.2f} {r['catch_up_median_s']:8.1f}s"
        )
