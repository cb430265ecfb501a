"""A cluster with no worker that can run a task: none joined, every one died, or they
failed to start. Each task run ends ``Failed`` within ``gpu_wait_s`` (plus the watch's
tick), naming the cluster and, where known, the workers' own start error; a worker
that joins in time is used. Real ``dask scheduler``/``dask worker`` processes, a real
``LocalCluster`` and a real Prefect API."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

import dask
import distributed
import pytest
from prefect import flow, task
from prefect.client.schemas.objects import StateType

from prefect_gpu_dask import GPUDaskTaskRunner, MissingResourceError
from prefect_gpu_dask.flow.resource_wait import WorkerStartErrors
from tests.conftest import DaskProcesses, recorded_task_run

WAIT_S = 5
# The watch's tick (at most 1 s), the scheduler's answer and a loaded 2-core machine.
MARGIN_S = 15
MISSING = "No module named 'no_such_preload_for_tests'"
# Where a worker's process cannot start, distributed from 2026.11 hands its error up to the
# nanny; older ones (the oldest declared, 2026.7.1) only log it in the worker's process.
ERROR_HANDED_UP = tuple(int(p) for p in distributed.__version__.split(".")[:2]) >= (2026, 11)


@task(tags=["gpu"])
def whole_gpu() -> str:
    return str(distributed.get_worker().name)


@task
def plain() -> str:
    return str(distributed.get_worker().name)


@task
def worker_pid() -> int:
    return os.getpid()


# What the flow does mid-run, set by the test: a flow defined in a test is pickled by
# value, and a ``DaskProcesses`` (with its processes) cannot be.
MID_FLOW: dict[str, Callable[[], None]] = {}


def mid_flow() -> None:
    MID_FLOW.pop("action")()


def submit_both_and_wait() -> tuple[list, float, float]:
    """In a flow: a `gpu` and a plain task run, each waited for; their states and task-run
    ids, and when the wait began and ended."""
    started = time.monotonic()
    futures = [whole_gpu.submit(), plain.submit()]
    for future in futures:
        future.wait(timeout=WAIT_S + 60)
    return [(f.state, f.task_run_id) for f in futures], started, time.monotonic()


def assert_failed_for_no_worker(states: list, address: str, started: float, ended: float) -> None:
    """Each state is ``Failed`` for want of a worker, naming the cluster, within the bound;
    the API records each run ``Failed`` too."""
    assert WAIT_S - 0.5 <= ended - started < WAIT_S + MARGIN_S, ended - started
    for state, run_id in states:
        assert state.type == StateType.FAILED, state
        assert address in state.message and f"none joined within {WAIT_S} s" in state.message, state.message
        with pytest.raises(MissingResourceError, match="No Dask worker is left in the cluster at"):
            state.result()
        assert recorded_task_run(run_id).state.type == StateType.FAILED


def test_tasks_on_a_scheduler_without_workers_fail_within_the_wait(dask_processes: DaskProcesses):
    address = dask_processes.start_scheduler()

    @flow(task_runner=GPUDaskTaskRunner(address=address, gpu_wait_s=WAIT_S))
    def nobody_there():
        return submit_both_and_wait()

    states, started, ended = nobody_there()
    assert_failed_for_no_worker(states, address, started, ended)


def test_a_worker_that_joins_within_the_wait_runs_the_tasks(dask_processes: DaskProcesses):
    address = dask_processes.start_scheduler()
    MID_FLOW["action"] = lambda: dask_processes.start_worker(
        "late", "--nthreads", "2", "--resources", "GPU=1"
    )

    @flow(task_runner=GPUDaskTaskRunner(address=address, gpu_wait_s=60))
    def joins_late():
        futures = [whole_gpu.submit(), plain.submit()]
        time.sleep(1)  # submitted before any worker exists
        mid_flow()
        return [f.result(timeout=120) for f in futures]

    assert joins_late() == ["late", "late"]


def test_a_local_cluster_whose_worker_cannot_start_fails_with_the_workers_error():
    runner = GPUDaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={"n_workers": 1, "threads_per_worker": 1},
        gpu_wait_s=WAIT_S,
    )

    @flow(task_runner=runner)
    def cannot_start():
        return plain.submit().result()

    started = time.monotonic()
    with dask.config.set({"distributed.worker.preload": ["no_such_preload_for_tests"]}):
        state = cannot_start(return_state=True)
    assert state.is_failed()
    assert "LocalCluster this flow run started could not start its workers" in state.message, state.message
    assert (MISSING in state.message) == ERROR_HANDED_UP, state.message
    assert time.monotonic() - started < 120


@pytest.mark.timeout(240)
def test_tasks_after_every_worker_died_fail_within_the_wait(dask_processes: DaskProcesses):
    address = dask_processes.start_scheduler()
    dask_processes.start_worker("only", "--nthreads", "2", "--resources", "GPU=1", "--no-nanny")
    dask_processes.wait_for_workers(1)

    @flow(task_runner=GPUDaskTaskRunner(address=address, gpu_wait_s=WAIT_S))
    def all_died():
        os.kill(worker_pid.submit().result(timeout=60), signal.SIGKILL)
        time.sleep(2)  # the scheduler hears of the death
        return submit_both_and_wait()

    states, started, ended = all_died()
    assert_failed_for_no_worker(states, address, started, ended)

    @flow(task_runner=GPUDaskTaskRunner(address=address, gpu_wait_s=WAIT_S))
    def awaits_a_result():
        return plain.submit().result()

    started = time.monotonic()
    state = awaits_a_result(return_state=True)
    assert state.is_failed() and address in state.message, state.message
    assert time.monotonic() - started < WAIT_S + MARGIN_S + 10  # a flow run's own start too


def test_a_nannys_logged_start_error_is_kept_as_the_workers_own():
    errors = WorkerStartErrors().attach()
    try:
        try:
            try:
                raise ModuleNotFoundError(MISSING)
            except ImportError as exc:
                raise RuntimeError("Nanny failed to start.") from exc
        except RuntimeError:
            logging.getLogger("distributed.nanny").exception("Failed to restart worker")
        logging.getLogger("distributed.nanny").error("Worker failed to connect")  # no error to keep
    finally:
        errors.detach()
    logging.getLogger("distributed.nanny").error("after", exc_info=ValueError("not heard"))
    assert errors.texts() == [f"ModuleNotFoundError: {MISSING}"]


def test_an_adaptive_cluster_whose_workers_cannot_start_fails_tasks_within_the_wait():
    runner = GPUDaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={"n_workers": 0, "threads_per_worker": 1},
        adapt_kwargs={"minimum": 0, "maximum": 1},
        gpu_wait_s=WAIT_S,
    )

    @flow(task_runner=runner)
    def from_zero():
        started = time.monotonic()
        future = plain.submit()
        future.wait(timeout=WAIT_S + 60)
        return future.state, time.monotonic() - started

    with dask.config.set({"distributed.worker.preload": ["no_such_preload_for_tests"]}):
        state, took = from_zero()
    assert state.type == StateType.FAILED, state
    assert "none joined within" in state.message, state.message
    assert (MISSING in state.message) == ERROR_HANDED_UP, state.message
    assert WAIT_S - 0.5 <= took < WAIT_S + MARGIN_S, took
