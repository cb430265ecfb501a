"""Sick GPUs on real ``dask scheduler``/``dask worker`` processes and a real Prefect API.

The workers' guards read scripted health (``tests.scripted_probe.ScriptedHealth``): a test
writes a worker's readings to a file, and its next check (before a ``gpu`` task, or on
its timer) sees them, just as NVML's would be seen on a GPU machine.
"""

from __future__ import annotations

import time

import distributed
import pytest
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId
from prefect.context import FlowRunContext

from prefect_gpu_dask import GPUDaskTaskRunner
from prefect_gpu_dask.flow.reporting import SUMMARY_KEY, UNHEALTHY_EVENT
from tests.scripted_probe import FAKE_PROBE, HEALTH_DIR_ENV, make_sick
from tests.ui_helpers import read_events


@task(tags=["gpu"])
def where(seconds: float) -> str:
    time.sleep(seconds)
    return str(distributed.get_worker().name)


@task
def on_cpu() -> str:
    return "cpu"


@pytest.fixture
def health_dir(tmp_path, monkeypatch):
    directory = tmp_path / "health"
    directory.mkdir()
    monkeypatch.setenv(HEALTH_DIR_ENV, str(directory))  # the worker processes inherit it
    return directory


def start_two_gpu_workers(procs) -> str:
    procs.start_scheduler()
    for name in ("gpu-a", "gpu-b"):
        procs.start_worker(name, "--nthreads", "2", "--resources", "GPU=1")
    procs.wait_for_workers(2)
    return procs.address


def summary_of(flow_run_id: str) -> str:
    with get_client(sync_client=True) as client:
        [artifact] = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[SUMMARY_KEY])),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
        )
    return artifact.data


def test_a_gpu_found_sick_before_a_task_is_quarantined_and_its_queued_work_moves(dask_processes, health_dir):
    """Healthy at the start; then one GPU reports an uncorrectable ECC error. The timer is
    an hour, so only the check before each gpu task can see it: the tasks queued on the
    sick worker go back to the scheduler unstarted and all run on the healthy GPU."""
    address = start_two_gpu_workers(dask_processes)
    runner = GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE, health_check_s=3600)

    @flow(task_runner=runner)
    def nightly() -> tuple[list[str], list[str], list, str]:
        before = [f.result() for f in [where.submit(0.2) for _ in range(4)]]
        make_sick(health_dir, "gpu-a", ecc_volatile_uncorrectable=1)
        futures = [where.submit(0.1) for _ in range(12)]
        after = [f.result() for f in futures]
        runner = FlowRunContext.get().task_runner
        return before, after, list(runner.quarantines), str(FlowRunContext.get().flow_run.id)

    before, after, quarantines, flow_run_id = nightly()
    assert set(before) == {"gpu-a", "gpu-b"}  # both GPUs served while healthy
    assert after == ["gpu-b"] * 12
    [sick] = quarantines
    assert (sick.worker_name, sick.withdrawn, sick.healthy_gpu_workers) == ("gpu-a", True, 1)
    assert sick.reasons == ("1 volatile uncorrectable ECC error",)

    # Only this flow run's: other tests in this session also quarantine their "gpu-a".
    events = read_events(
        [UNHEALTHY_EVENT], related=f"prefect.flow-run.{flow_run_id}", until=lambda evs: len(evs) >= 1
    )
    assert [e.payload["worker_name"] for e in events] == ["gpu-a"]
    assert events[0].payload["reasons"] == ["1 volatile uncorrectable ECC error"]
    assert events[0].resource.id == f"prefect-gpu-dask.gpu.{sick.gpu_uuid}"
    assert f"prefect.flow-run.{flow_run_id}" in {r.id for r in events[0].related}
    sent_back = (dask_processes.tmp / "worker-gpu-a.log").read_text().count("goes back to the scheduler")
    assert sent_back >= 1  # work queued on the sick GPU moved, unstarted
    summary = summary_of(flow_run_id)
    assert "## Quarantined GPUs" in summary
    assert "on worker gpu-a: 1 volatile uncorrectable ECC error" in summary


def test_with_no_healthy_gpu_left_gpu_tasks_fail_fast_and_cpu_work_goes_on(dask_processes, health_dir):
    """Both GPUs sick from the start (one lost, one with a critical Xid), seen by the
    timer's first check: the first gives its GPU up, the last keeps it so gpu tasks
    reach it and fail at once, naming the GPU, instead of waiting for one forever."""
    make_sick(health_dir, "gpu-a", lost=True)
    make_sick(health_dir, "gpu-b", xid_events=[79])
    address = start_two_gpu_workers(dask_processes)

    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE, health_check_s=0.5))
    def nightly():
        started = time.monotonic()
        states = [f.wait() or f.state for f in [where.submit(0) for _ in range(6)]]
        cpu = on_cpu.submit().result()
        deadline = time.monotonic() + 20
        runner = FlowRunContext.get().task_runner
        while len(runner.quarantines) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        return states, time.monotonic() - started, cpu, list(runner.quarantines)

    states, seconds, cpu, quarantines = nightly()
    assert cpu == "cpu"
    assert all(s.is_failed() for s in states), [s.name for s in states]
    for state in states:
        assert "UnhealthyGPUError" in state.message and "No healthy GPU is left" in state.message
    assert seconds < 30
    by_name = {q.worker_name: q for q in quarantines}
    assert set(by_name) == {"gpu-a", "gpu-b"}
    assert sorted(q.withdrawn for q in quarantines) == [False, True]
    assert "GPU is lost (fell off the bus)" in by_name["gpu-a"].reasons
    assert any("Xid 79" in reason for reason in by_name["gpu-b"].reasons)


def test_flow_runs_sharing_a_gpu_get_the_strictest_health_check_interval(dask_processes, health_dir):
    """The first flow run registers the guard with hourly checks; a second on the same
    cluster asks for checks every 0.5 s. The worker then checks every 0.5 s, so a GPU
    that falls sick while no task runs is quarantined by the timer alone."""
    address = start_two_gpu_workers(dask_processes)

    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE, health_check_s=3600))
    def hourly() -> list[str]:
        return [f.result() for f in [where.submit(0.2) for _ in range(4)]]

    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE, health_check_s=0.5))
    def often() -> list:
        [f.result() for f in [where.submit(0.2) for _ in range(4)]]
        make_sick(health_dir, "gpu-a", ecc_volatile_uncorrectable=1)
        runner = FlowRunContext.get().task_runner
        deadline = time.monotonic() + 20
        while not runner.quarantines and time.monotonic() < deadline:
            time.sleep(0.1)
        return list(runner.quarantines)

    assert set(hourly()) == {"gpu-a", "gpu-b"}
    [sick] = often()
    assert sick.worker_name == "gpu-a" and sick.reasons == ("1 volatile uncorrectable ECC error",)
    log = (dask_processes.tmp / "worker-gpu-a.log").read_text()
    assert log.count("every 0.5 s, the shortest interval a flow run using it asked for (was 3600 s)") == 1
