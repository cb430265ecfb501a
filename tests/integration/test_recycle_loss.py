"""A recycle that cannot bring its worker back: on real nanny-managed Dask processes.

A ``SpecCluster`` (``LocalCluster``, ``LocalCUDACluster``) closes the nanny of a worker
that is absent when the lost-worker timer of an earlier removal of its name fires,
even while that nanny is restarting it. With the timer shortened, every recycle (and
every crash) lands in that window: the worker must come back all the same. Where a worker truly cannot
come back (no nanny), the restart says so and the flow run ends instead of waiting.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid

import dask
import pytest
from distributed import Client, LocalCluster
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.exceptions import ObjectNotFound

from prefect_gpu_dask import GPUDaskTaskRunner, read_flow_run_gpu_report
from prefect_gpu_dask.records import LOST, REPLACED
from prefect_gpu_dask.scheduler.recycling import InterruptedTasks
from tests.scripted_probe import FAKE_PROBE, leak

MiB = 2**20


@task(tags=["gpu"])
def short(i: int) -> int:
    time.sleep(0.05)
    return i


@task(tags=["gpu"])
def keep(nbytes: int) -> int:
    leak(nbytes)
    return nbytes


def leaky_flow(address: str, **runner_kwargs):
    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE, **runner_kwargs))
    def soak() -> list[int]:
        futures = [short.submit(i) for i in range(4)]
        futures.append(keep.submit(512 * MiB))
        return [f.result() for f in futures]

    return soak


def test_recycles_keep_every_worker_when_the_cluster_closes_a_restarting_nanny():
    # Before the fix, the first recycle here lost its worker for good: the cluster
    # closed the nanny mid-restart and the scheduler waited 60 s for it in vain.
    with (
        dask.config.set({"distributed.deploy.lost-worker-timeout": "0.2s"}),
        LocalCluster(n_workers=2, threads_per_worker=2, resources={"GPU": 1}, processes=True) as cluster,
        Client(cluster) as client,
    ):
        for _ in range(2):
            state = leaky_flow(cluster.scheduler_address)(return_state=True)
            assert state.is_completed(), state
            report = read_flow_run_gpu_report(state.state_details.flow_run_id)
            assert [r.outcome for r in report.restarts] == [REPLACED], report.restarts
            restart = report.restarts[0]
            assert restart.new_worker and restart.new_worker != restart.worker
            assert restart.serving_s < 30, restart
            client.wait_for_workers(2, timeout=10)
            names = sorted(str(w["name"]) for w in client.scheduler_info()["workers"].values())
            assert names == ["0", "1"]


def test_a_killed_worker_comes_back_when_the_cluster_closes_its_restarting_nanny():
    """No recycle here: the worker process dies (SIGKILL: a segfault, the OOM killer) and
    its nanny starts another, slower than the shortened lost-worker timer. The cluster
    closes that nanny as it did the recycles'; the runner's scheduler plugin starts the
    worker again."""
    with (
        dask.config.set({"distributed.deploy.lost-worker-timeout": "0.2s"}),
        LocalCluster(n_workers=1, threads_per_worker=1, resources={"GPU": 1}, processes=True) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(InterruptedTasks(), name=InterruptedTasks.name)  # as every runner does
        [(address, victim)] = client.run(os.getpid).items()
        os.kill(victim, signal.SIGKILL)

        def workers() -> dict[str, dict]:
            return client.scheduler_info(n_workers=-1)["workers"]

        # The nanny's own restart may show up first and be closed by the cluster: the
        # worker that stays is the one asked.
        deadline = time.monotonic() + 90
        while True:
            assert time.monotonic() < deadline, f"no worker came back: {workers()}"
            current = workers()
            if list(current) not in ([], [address]):
                [(new_address, worker)] = current.items()
                try:
                    pid = client.run(os.getpid, workers=[new_address])[new_address]
                    break
                except OSError:  # closed while asked
                    pass
            time.sleep(0.2)
        assert worker["name"] == 0 and worker["resources"] == {"GPU": 1}
        assert pid != victim


def runner_on_one_worker_without_nanny(dask_processes, slots: int) -> GPUDaskTaskRunner:
    """A CLI scheduler and one worker with ``slots`` threads and GPU slots, no nanny."""
    dask_processes.start_scheduler()
    dask_processes.start_worker(
        "only-gpu", "--nthreads", str(slots), "--resources", f"GPU={slots}", "--no-nanny"
    )
    dask_processes.wait_for_workers(1)
    return GPUDaskTaskRunner(address=dask_processes.address, memory_probe=FAKE_PROBE, gpu_wait_s=2)


def outcome(future) -> str:
    """The word "ran", or the error the future of a task run raised, with its type."""
    try:
        future.result()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ran"


@pytest.mark.timeout(180)
def test_a_worker_that_cannot_come_back_is_lost_and_the_flow_run_ends(dask_processes):
    # No nanny: the restart shuts the worker down and nothing brings it back.
    runner = runner_on_one_worker_without_nanny(dask_processes, slots=1)

    @flow(task_runner=runner)
    def left_without_workers() -> tuple[int, list[str]]:
        leaked = keep.submit(512 * MiB)
        queued = [short.submit(i) for i in range(3)]
        return leaked.result(), [outcome(future) for future in queued]

    started = time.monotonic()
    state = left_without_workers(return_state=True)
    took = time.monotonic() - started
    leaked, outcomes = state.result()
    assert leaked == 512 * MiB
    # Each queued task either ran before the drain or failed with a clear error.
    assert all(o == "ran" or "No Dask worker is left" in o for o in outcomes), outcomes
    assert any(o != "ran" for o in outcomes), outcomes
    assert took < 90, took
    report = read_flow_run_gpu_report(state.state_details.flow_run_id)
    [restart] = report.restarts
    assert restart.outcome == LOST and restart.new_worker is None
    assert "no nanny" in restart.lost_reason


@task(tags=["gpu"])
def die_once_drained() -> None:
    """Die while the leak's recycle waits for this task to end (its worker is drained),
    once Prefect's API has this run: the worker's events about it would die with it."""
    from distributed import get_worker
    from distributed.core import Status
    from prefect.runtime import task_run

    worker, deadline = get_worker(), time.monotonic() + 120
    with get_client(sync_client=True) as api:
        while time.monotonic() < deadline:
            with contextlib.suppress(ObjectNotFound):  # the API may have the run before a state
                state = api.read_task_run(uuid.UUID(task_run.id)).state
                if state is not None and state.is_running():
                    break
            time.sleep(0.1)
    while worker.status != Status.closing_gracefully and time.monotonic() < deadline:
        time.sleep(0.05)
    # The leaking run, whose judgement drained the worker, has ended and said so: its
    # result is the worker's alone (a death before that would crash it instead).
    while len(worker.state.executing) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(180)
def test_a_worker_that_dies_before_its_recycle_and_never_comes_back_ends_the_flow_run(
    dask_processes, monkeypatch
):
    # No nanny: the worker's death is its end. The recycle finds it gone, waits for a
    # worker of its name, records it lost; what waited for it fails after gpu_wait_s.
    from prefect_gpu_dask.flow import recycling

    monkeypatch.setattr(recycling, "REPLACEMENT_WAIT_S", 2.0)
    runner = runner_on_one_worker_without_nanny(dask_processes, slots=2)

    @flow(task_runner=runner)
    def left_by_a_dead_worker() -> tuple[str, list[str]]:
        futures = [die_once_drained.submit(), keep.submit(512 * MiB), *(short.submit(i) for i in range(3))]
        return str(futures[0].task_run_id), [outcome(future) for future in futures]

    started = time.monotonic()
    state = left_by_a_dead_worker(return_state=True)
    took = time.monotonic() - started
    dying_run, [died, kept, *queued] = state.result()
    crashed, missing = "CrashedRun: Dask worker", "MissingResourceError: No Dask worker is left"
    # The run the worker died in is Crashed, in the flow and in the API; never run twice.
    assert died.startswith(crashed) and "was not run a second time" in died, died
    with get_client(sync_client=True) as api:
        assert api.read_task_run(uuid.UUID(dying_run)).state.type == StateType.CRASHED
    # The leaked result was only on the worker; a queued run either never started or,
    # where it started before the drain, died with the worker.
    assert kept.startswith(missing), kept
    assert all(o.startswith((missing, crashed)) for o in queued), queued
    assert took < 90, took
    report = read_flow_run_gpu_report(state.state_details.flow_run_id)
    [restart] = report.restarts
    assert restart.outcome == LOST and restart.new_worker is None
    assert "left the cluster before it could be recycled" in restart.lost_reason
