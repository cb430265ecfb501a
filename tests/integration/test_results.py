"""Task runs' states reaching the flow through ``result()`` and ``wait()``, on a real
Prefect API and real Dask processes on 127.0.0.1."""

from __future__ import annotations

import time

import distributed
import pytest
from prefect import flow, task

from prefect_gpu_dask import GPUDaskTaskRunner
from prefect_gpu_dask._compat import future_final_state


@task
def value(i: int) -> int:
    return i


@task
def fails(i: int) -> int:
    raise ValueError(f"task {i} failed")


@task
def slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _finished(futures: list) -> None:
    """Wait until Dask has every future's result, without fetching any."""
    wrapped = [f.wrapped_future for f in futures]
    with wrapped[0].client.as_current():
        distributed.wait(wrapped)


def test_failed_and_unfinished_task_runs_keep_their_meaning(remote_cluster):
    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def mixed():
        done, failed, running = value.submit(1), fails.submit(2), slow.submit(8.0)
        _finished([done, failed])
        assert done.result() == 1
        with pytest.raises(ValueError, match="task 2 failed"):
            failed.result()
        started = time.perf_counter()
        with pytest.raises(TimeoutError):
            running.result(timeout=1.0)
        timed_out_after = time.perf_counter() - started
        running.wait(0.1)
        still_running = future_final_state(running) is None
        return failed.state.is_failed(), timed_out_after, still_running, running.result()

    failed_is_failed, timed_out_after, still_running, slow_result = mixed()
    assert failed_is_failed
    assert timed_out_after < 1.8  # the timeout is waited once, not twice
    assert still_running
    assert slow_result == 8.0


def test_wait_waits_for_the_run_to_end_and_gives_its_own_state(remote_cluster):
    """``wait()`` returns once the run ended, with the run's own state, not whatever the
    API has recorded so far; ``result()`` gives the value."""

    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def waits():
        waited, asked = slow.submit(1.5), slow.submit(1.0)
        start = time.monotonic()
        waited.wait()
        waited_s = time.monotonic() - start
        return waited_s, waited.state, asked.result()

    waited_s, state, result = waits()
    assert waited_s >= 1.0, f"wait() returned after {waited_s:.2f} s, before the run ended"
    assert state.is_completed(), state
    assert result == 1.0


@task
def computes_a_collection() -> int:
    import dask.bag as db

    time.sleep(0.5)  # the flow is waiting for this result meanwhile
    return db.from_sequence(range(10), npartitions=2).sum().compute()


def test_a_task_on_an_in_process_worker_computes_dask_collections_while_the_flow_waits():
    # Waiting must not make Dask's distributed scheduler the process's default: an
    # in-process worker's task would then find no client for its own compute().
    runner = GPUDaskTaskRunner(cluster_kwargs={"processes": False, "n_workers": 1, "dashboard_address": None})

    @flow(task_runner=runner)
    def waits():
        return computes_a_collection.submit().result()

    assert waits() == 45
