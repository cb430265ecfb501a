"""tasks: batches of trivial tasks, warm, through Prefect's thread pool, the runner
(guard off), prefect-dask's ``DaskTaskRunner`` on the same cluster, and ``gpu``-tagged
through the thread pool and the guarded runner."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.common import WARM_TASKS, Options
from prefect_gpu_dask.flow.cluster import GPU_WORKER_THREADS

# Runner / thread pool is judged on the median of at least this many alternating rounds.
MIN_ROUNDS = 5


def run(options: Options) -> Iterator[tuple[str, Any]]:
    rounds = max(options.repeat, MIN_ROUNDS)
    yield "per_task", [bench_per_task(n, options.gpu, rounds) for n in options.tasks]


def bench_per_task(n: int, gpu: bool, repeat: int = 1) -> dict[str, Any]:
    from prefect import flow, task
    from prefect.context import FlowRunContext
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    from prefect_gpu_dask import GPUDaskTaskRunner

    @task
    def noop(i: int) -> int:
        return i

    def timed(runner, job=noop) -> float:
        @flow(task_runner=runner)
        def many() -> tuple[float, str]:
            client = getattr(FlowRunContext.get().task_runner, "client", None)  # start the cluster first
            del client
            # Warm: a task on every thread of every worker, so the timed batch does not
            # include each worker process loading Prefect's engine (~2.5 s, once per
            # process; reported as first_task_s). Arguments < 0 are the warm-up.
            assert all(f.result() < 0 for f in job.map(range(-WARM_TASKS, 0)))
            start = time.perf_counter()
            results = [f.result() for f in job.map(range(n))]
            assert results == list(range(n))
            return time.perf_counter() - start, str(FlowRunContext.get().flow_run.id)

        elapsed, flow_run_id = many()
        api_caught_up(flow_run_id, n + WARM_TASKS)
        return elapsed

    # The runner's own defaults on a GPU host (one worker per GPU, GPU_WORKER_THREADS each);
    # prefect-dask gets the same cluster.
    cluster = {"threads_per_worker": GPU_WORKER_THREADS} if gpu else {"n_workers": 1, "threads_per_worker": 4}
    cuda = "dask_cuda.LocalCUDACluster" if gpu else None
    dask_kwargs = {
        "cluster_class": cuda,
        "cluster_kwargs": {**cluster, **({"resources": {"GPU": 1}} if gpu else {})},
    }
    # The thread pool and the runner: ``repeat`` flow runs each, alternating; each figure
    # their median, every run kept.
    rounds: dict[str, list[float]] = {"threadpool": [], "runner": []}
    for _ in range(repeat):
        rounds["threadpool"].append(timed(ThreadPoolTaskRunner(max_workers=16)))
        rounds["runner"].append(timed(GPUDaskTaskRunner(cluster_kwargs=cluster, guard="off")))
        # Each round as it ends: a run stopped later still shows the rounds it finished.
        pool, runner = rounds["threadpool"][-1], rounds["runner"][-1]
        print(f"  tasks {n}: thread pool {pool:.3f} s, runner {runner:.3f} s", flush=True)
    out: dict[str, Any] = {"n": n}
    for name, values in rounds.items():
        out[f"{name}_s"] = statistics.median(values)
        out[f"{name}_runs_s"] = [round(v, 3) for v in values]
    out["runner_over_threadpool"] = out["runner_s"] / out["threadpool_s"]
    out["runner_over_threadpool_runs"] = [
        round(r / t, 3) for r, t in zip(rounds["runner"], rounds["threadpool"], strict=True)
    ]
    # Tagged tasks cost more anywhere: Prefect's engine asks the API for the tag's
    # concurrency slots before each one. The thread pool pays that too.
    noop_gpu = noop.with_options(tags=["gpu"])
    out["threadpool_gpu_tagged_s"] = timed(ThreadPoolTaskRunner(max_workers=16), noop_gpu)
    guarded = GPUDaskTaskRunner(cluster_kwargs=cluster, guard="gpu")
    out["runner_guarded_gpu_tasks_s"] = timed(guarded, noop_gpu)
    if n <= 200:  # prefect-dask pays ~0.1 s a task: 1,000 would take minutes
        out["prefect_dask_s"] = timed(DaskTaskRunner(**{k: v for k, v in dask_kwargs.items() if v}))
    return out


def timed_trivial_batch(runner: Any, tasks: int) -> float:
    """Seconds for ``tasks`` trivial task runs through ``runner``, in a flow run of their
    own, warm: after its cluster started and ``WARM_TASKS`` ran; the API caught up after."""
    from prefect import flow, task
    from prefect.context import FlowRunContext

    @task
    def noop(i: int) -> int:
        return i

    @flow(task_runner=runner)
    def many() -> tuple[float, str]:
        getattr(FlowRunContext.get().task_runner, "client", None)  # start the cluster first
        assert all(f.result() < 0 for f in noop.map(range(-WARM_TASKS, 0)))
        start = time.perf_counter()
        assert [f.result() for f in noop.map(range(tasks))] == list(range(tasks))
        return time.perf_counter() - start, str(FlowRunContext.get().flow_run.id)

    elapsed, flow_run_id = many()
    api_caught_up(flow_run_id, tasks + WARM_TASKS)
    return elapsed


def api_caught_up(flow_run_id: str, task_runs: int, timeout: float = 60) -> None:
    """Wait until the API server has recorded a flow run's task runs.

    Task runs reach the server as events, ingested after the flow returns; without
    this wait the next measurement shares the server with the previous one's backlog.
    """
    from prefect.client.orchestration import get_client

    only_this = {"flow_runs": {"id": {"any_": [flow_run_id]}}}
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            if client.request("POST", "/task_runs/count", json=only_this).json() >= task_runs:
                return
            time.sleep(1.0)
