"""Task runs' states reaching the flow (``flow.results``): a fetch reads ahead, on a
real Prefect API and real Dask processes on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import time

import distributed
import pytest
from prefect import flow, task

from prefect_gpu_dask import GPUDaskTaskRunner
from prefect_gpu_dask._compat import future_final_state
from prefect_gpu_dask.flow.results import READ_AHEAD_MAX_BYTES, ReadAhead


@task
def value(i: int) -> int:
    return i


@task
def large(size: int) -> bytes:
    return b"x" * size


@task
def plus_one(i: int) -> int:
    return i + 1


@dataclasses.dataclass
class Opaque:
    """A value Dask's sizeof sizes as its shell: never read ahead, however small."""

    payload: bytes


@task
def opaque(i: int) -> Opaque:
    return Opaque(bytes(i))


@task
def fails(i: int) -> int:
    raise ValueError(f"task {i} failed")


@task
def slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _on_one_worker(*tasks):
    """The tasks routed to the cluster's one ``gpu`` worker: results read ahead are
    those held beside the one asked for."""
    return [t.with_options(tags=["gpu"]) for t in tasks]


def _finished(futures: list) -> None:
    """Wait until Dask has every future's result, without fetching any."""
    wrapped = [f.wrapped_future for f in futures]
    with wrapped[0].client.as_current():
        distributed.wait(wrapped)


def test_a_result_brings_the_small_finished_states_submitted_after_it(remote_cluster):
    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def read_in_order():
        value_, large_, opaque_ = _on_one_worker(value, large, opaque)
        futures = [
            *value_.map(range(8)),
            large_.submit(2 * READ_AHEAD_MAX_BYTES),
            opaque_.submit(3),
            value_.submit(99),
        ]
        _finished(futures)
        first = futures[0].result()
        fetched = [future_final_state(f) is not None for f in futures]
        # A small state read into the flow keeps its Dask future: a task given it gets the value.
        released = [f.wrapped_future.status for f in futures[:8]]
        downstream = plus_one.submit(futures[3]).result()
        results = [f.result() for f in futures]
        # A large one keeps its Dask future: a task given it gets the value from the worker.
        kept = futures[8].wrapped_future.status
        return first, fetched, released, kept, results, downstream

    first, fetched, released, kept, results, downstream = read_in_order()
    assert first == 0
    # The large and the opaque states stay on their worker until asked for; the one after came along.
    assert fetched == [True] * 8 + [False, False, True]
    assert released == ["finished"] * 8 and kept == "finished"
    assert results == [*range(8), b"x" * (2 * READ_AHEAD_MAX_BYTES), Opaque(bytes(3)), 99]
    assert downstream == 4


def test_failed_and_unfinished_task_runs_read_ahead_keep_their_meaning(remote_cluster):
    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def mixed():
        value_, fails_ = _on_one_worker(value, fails)
        done, failed, running = value_.submit(1), fails_.submit(2), slow.submit(8.0)
        _finished([done, failed])
        assert done.result() == 1
        failed_was_fetched = future_final_state(failed) is not None
        with pytest.raises(ValueError, match="task 2 failed"):
            failed.result()
        started = time.perf_counter()
        with pytest.raises(TimeoutError):
            running.result(timeout=1.0)
        timed_out_after = time.perf_counter() - started
        running.wait(0.1)
        still_running = future_final_state(running) is None
        return failed_was_fetched, failed.state.is_failed(), timed_out_after, still_running, running.result()

    failed_was_fetched, failed_is_failed, timed_out_after, still_running, slow_result = mixed()
    assert failed_was_fetched and failed_is_failed
    assert timed_out_after < 1.8  # the timeout is waited once, not twice
    assert still_running
    assert slow_result == 8.0


class _FailingReadAhead(ReadAhead):
    """Reading ahead that fails for its own reasons (a dropped connection, say)."""

    def fetch(self, future, timeout=None):
        raise RuntimeError("fetching failed")


def test_a_fetch_that_fails_leaves_wait_and_result_to_prefect_dasks_own_path(remote_cluster):
    """``wait()`` still waits for the run to end, and its state is the run's own, not
    whatever the API has recorded so far; ``result()`` still gives the value."""

    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def waits():
        waited, asked = slow.submit(1.5), slow.submit(1.0)
        for future in (waited, asked):
            future.read_ahead = _FailingReadAhead(future.wrapped_future.client)
        start = time.monotonic()
        waited.wait()
        waited_s = time.monotonic() - start
        return waited_s, waited.state, asked.result()

    waited_s, state, result = waits()
    assert waited_s >= 1.0, f"wait() returned after {waited_s:.2f} s, before the run ended"
    assert state.is_completed(), state
    assert result == 1.0


def test_a_negative_read_ahead_window_is_refused():
    with pytest.raises(ValueError, match="-1"):
        ReadAhead(client=None, window=-1)


def _no_sizes(keys: list[str], dask_scheduler=None) -> dict[str, int]:
    raise ModuleNotFoundError("No module named 'prefect_gpu_dask'")


def test_a_scheduler_that_cannot_size_results_costs_only_the_read_ahead(remote_cluster, monkeypatch, caplog):
    from prefect_gpu_dask.flow import results

    # As on a scheduler without this package: the function cannot run there.
    monkeypatch.setattr(results, "result_sizes", lambda keys, beside, dask_scheduler=None: _no_sizes(keys))

    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def read_in_order():
        futures = _on_one_worker(value)[0].map(range(6))
        _finished(futures)
        values = [f.result() for f in futures]
        return values, futures[0].read_ahead.window

    values, window = read_in_order()
    assert values == list(range(6))
    assert window == 0
    assert "fetched one by one" in caplog.text


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
