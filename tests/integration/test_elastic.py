"""Clusters that grow: GPU workers that join after the flow started, adaptive clusters
from zero, and a wait for a GPU that runs out. Real ``dask scheduler``/``dask worker``
processes (and a real adaptive ``LocalCluster``) and a real Prefect API."""

from __future__ import annotations

import time
from collections.abc import Callable

import distributed
import pytest
from prefect import flow, task
from prefect.context import FlowRunContext

from prefect_gpu_dask import GPUDaskTaskRunner, MissingResourceError
from tests.conftest import DaskProcesses, task_run_logs
from tests.integration.test_reliability import max_concurrency
from tests.scripted_probe import FAKE_PROBE


@task(tags=["gpu:0.25"])
def quarter_gpu(seconds: float) -> tuple[float, float, str]:
    start = time.time()
    time.sleep(seconds)
    return start, time.time(), str(distributed.get_worker().name)


@task(tags=["gpu:0.5"])
def half_gpu(seconds: float) -> tuple[float, float, str]:
    start = time.time()
    time.sleep(seconds)
    return start, time.time(), str(distributed.get_worker().name)


@task(tags=["gpu"])
def whole_gpu() -> str:
    return str(distributed.get_worker().name)


# What the flow does mid-run, set by the test: a flow defined in a test is pickled by
# value, and a ``DaskProcesses`` (with its processes) cannot be.
MID_FLOW: dict[str, Callable[[], None]] = {}


def mid_flow() -> None:
    MID_FLOW.pop("action")()


@pytest.mark.parametrize("others", [(), ("cpu-worker",)], ids=["no-workers", "cpu-worker-up"])
def test_gpu_tasks_wait_for_a_gpu_worker_that_joins_late(dask_processes: DaskProcesses, others):
    """With no GPU worker yet (none at all, or only a CPU one) ``gpu:0.25`` tasks keep
    their annotation and wait: they all run on the GPU worker when it joins, at most
    four at once, and the guard measures them there."""
    dask_processes.start_scheduler()
    for name in others:
        dask_processes.start_worker(name, "--nthreads", "4")
    if others:
        dask_processes.wait_for_workers(len(others))
    n = 24
    MID_FLOW["action"] = lambda: dask_processes.start_worker(
        "gpu-late", "--nthreads", "8", "--resources", "GPU=1"
    )

    @flow(
        task_runner=GPUDaskTaskRunner(
            address=dask_processes.address, on_missing_gpu="error", memory_probe=FAKE_PROBE
        )
    )
    def late():
        futures = [quarter_gpu.submit(0.1) for _ in range(n)]
        time.sleep(2)  # submitted well before any GPU worker exists
        mid_flow()
        out = [f.result(timeout=120) for f in futures]
        runner = FlowRunContext.get().task_runner
        return out, runner.records

    out, records = late()
    assert {w for *_, w in out} == {"gpu-late"}
    peak = max_concurrency([(s, e) for s, e, _ in out])
    assert 2 <= peak <= 4, f"{peak} gpu:0.25 tasks at once on one GPU"
    assert len(records) == n and {r.worker_name for r in records} == {"gpu-late"}


@pytest.fixture(scope="module")
def cpu_only(tmp_path_factory):
    procs = DaskProcesses(tmp_path_factory.mktemp("cpu-only"))
    procs.start_scheduler()
    procs.start_worker("cpu-worker", "--nthreads", "2")
    procs.wait_for_workers(1)
    yield procs.address
    procs.close()


def test_a_wait_that_runs_out_falls_back_to_cpu_with_a_warning(cpu_only):
    @flow(task_runner=GPUDaskTaskRunner(address=cpu_only, gpu_wait_s=2))
    def waits():
        started = time.monotonic()
        future = whole_gpu.submit()
        return future.result(timeout=60), time.monotonic() - started, future.task_run_id

    worker, waited, task_run_id = waits()
    assert worker == "cpu-worker"
    assert 2 <= waited < 30
    lines = task_run_logs(task_run_id, "running on CPU instead")
    assert any("no worker offering them joined within 2 s: running on CPU" in line for line in lines)


def test_a_wait_that_runs_out_fails_in_error_mode(cpu_only):
    @flow(task_runner=GPUDaskTaskRunner(address=cpu_only, gpu_wait_s=2, on_missing_gpu="error"))
    def strict_state():
        return whole_gpu.submit()

    started = time.monotonic()
    state = strict_state(return_state=True)
    assert state.is_failed()
    with pytest.raises(MissingResourceError, match=r"no worker offering them joined within 2 s"):
        state.result()
    assert 2 <= time.monotonic() - started < 60


def test_an_adaptive_cluster_from_zero_scales_up_for_gpu_tasks_and_keeps_their_share():
    runner = GPUDaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={"n_workers": 0, "threads_per_worker": 4, "resources": {"GPU": 1}},
        adapt_kwargs={"minimum": 0, "maximum": 1},
        memory_probe=FAKE_PROBE,
    )

    @flow(task_runner=runner)
    def from_zero():
        out = [f.result(timeout=120) for f in [half_gpu.submit(0.3) for _ in range(8)]]
        return out, FlowRunContext.get().task_runner.records

    out, records = from_zero()
    assert max_concurrency([(s, e) for s, e, _ in out]) <= 2
    assert len(records) == 8  # the guard reached the worker that joined
