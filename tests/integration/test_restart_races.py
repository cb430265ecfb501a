"""The recycler against the races a real cluster produces.

Each test drives ``flow.recycling.Recycler`` on a real ``LocalCluster`` (worker
processes under nannies) the way the runner does after a guard verdict: the worker
drains (``worker.recycling.drain``), the recycler is asked to restart it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from pathlib import Path

import dask
import dask.array as da
import pytest
from distributed import CancelledError, Client, LocalCluster
from prefect_dask.task_runners import PrefectDaskFuture

from prefect_gpu_dask import RestartRecord, compute_on_gpus
from prefect_gpu_dask._compat import future_final_state
from prefect_gpu_dask.flow import recycling
from prefect_gpu_dask.flow.recycling import RecyclableFuture, Recycler, move_into_flow
from prefect_gpu_dask.worker.recycling import drain


def recycler(client: Client) -> Recycler:
    return Recycler(client, "worker", logger=logging.getLogger("test-restarts"))


def recycle(rc: Recycler, worker: str, timeout: float = 30) -> RestartRecord:
    rc.request(worker, "leak: test")
    deadline = time.monotonic() + timeout
    while not rc.restarts and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rc.restarts, f"{worker} was not recycled within {timeout} s"
    return rc.restarts[0]


def cluster(**kwargs) -> LocalCluster:
    return LocalCluster(processes=True, dashboard_address="127.0.0.1:0", host="127.0.0.1", **kwargs)


def run_once(ledger: str) -> int:
    with open(ledger, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    time.sleep(0.5)
    return os.getpid()


def slow_reports(dask_worker) -> None:
    dask_worker.batched_stream.interval = 3  # a busy event loop or a slow link


def test_a_task_finished_but_not_yet_reported_is_not_run_again(tmp_path):
    ledger = str(tmp_path / "ledger")
    with cluster(n_workers=2, threads_per_worker=1) as lc, Client(lc) as client:
        w1, _ = sorted(client.scheduler_info()["workers"])
        client.run(slow_reports, workers=[w1])
        future = client.submit(run_once, ledger, workers=[w1], allow_other_workers=True, pure=False)
        time.sleep(0.2)
        client.run(drain, workers=[w1])
        rc = recycler(client)
        prefect_future = PrefectDaskFuture(wrapped_future=future, task_run_id=uuid.uuid4())
        rc.track(future.key, prefect_future)
        restart = recycle(rc, w1)
        rc.close(wait=True)
    assert len(Path(ledger).read_text().splitlines()) == 1, "the task ran twice"
    assert restart.worker == w1
    assert future_final_state(prefect_future) == int(Path(ledger).read_text())


def slow(seconds: float) -> str:
    time.sleep(seconds)
    return "slow"


def inc(x: int) -> int:
    return x + 1


def add(a: int, b: int) -> int:
    return a + b


def test_a_task_needing_a_queued_task_and_a_held_result_does_not_stall_the_restart():
    """C needs A (held by the drained worker) and B (queued there, never started)."""
    with cluster(n_workers=1, threads_per_worker=1) as lc, Client(lc) as client:
        [w] = client.scheduler_info()["workers"]
        a = client.submit(inc, 1, key="A")
        a.result()
        s = client.submit(slow, 1.0, key="S")
        time.sleep(0.3)
        b = client.submit(inc, 10, key="B")
        c = client.submit(add, a, b, key="C")
        time.sleep(0.3)
        client.run(drain, workers=[w])
        rc = recycler(client)
        started = time.monotonic()
        recycle(rc, w, timeout=20)
        assert time.monotonic() - started < 15
        assert c.result(timeout=30) == 13 and s.result(timeout=30) == "slow"
        rc.close(wait=False)


def gpu_work() -> str:
    return "ran"


def test_a_gpu_task_waits_out_a_long_drain_in_error_mode():
    """on_missing_gpu="error" clusters fail tasks nobody can run after a timeout; a task
    waiting for the only GPU worker to come back from a restart is not one of them."""
    with dask.config.set({"distributed.scheduler.no-workers-timeout": "2s"}):
        lc = cluster(n_workers=1, threads_per_worker=2, resources={"GPU": 1})
    with lc, Client(lc) as client:
        [w] = client.scheduler_info()["workers"]
        busy = client.submit(slow, 5.0, pure=False)  # the drain lasts until this ends
        time.sleep(0.5)
        client.run(drain, workers=[w])
        rc = recycler(client)
        rc.request(w, "leak: test")
        time.sleep(0.5)
        gpu = client.submit(gpu_work, resources={"GPU": 1}, pure=False)
        assert gpu.result(timeout=60) == "ran"
        assert busy.result(timeout=30) == "slow"
        timeout = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.no_workers_timeout)
        assert timeout == 2, "the no-workers timeout was not restored after the restart"
        rc.close(wait=False)


def sum_of_ones() -> float:
    x = da.ones((400, 400), chunks=(50, 50))
    return float(compute_on_gpus((x + 1).sum())[0])


@pytest.mark.parametrize("restart_during", [True])
def test_compute_on_gpus_survives_a_restart_of_another_worker(restart_during):
    with cluster(n_workers=2, threads_per_worker=2) as lc, Client(lc) as client:
        w1, w2 = sorted(client.scheduler_info()["workers"])
        client.run(drain, workers=[w2])
        rc = recycler(client)
        future = client.submit(sum_of_ones, workers=[w1], pure=False)
        time.sleep(0.5)
        recycle(rc, w2)
        assert future.result(timeout=30) == 2.0 * 400 * 400
        rc.close(wait=False)


HOLD = threading.Event()


def held() -> str:
    HOLD.wait(30)
    return "from dask"


def test_a_result_moved_while_the_flow_waits_on_it_reaches_the_waiter():
    """The flow waits on a task's result just as that task's worker is recycled: the
    result moves into the flow and Dask forgets the key, which cancels the wait. The
    waiter gets the moved result; a wait cancelled for any other reason still fails."""
    from prefect.states import Completed

    HOLD.clear()
    with (
        LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") as lc,
        Client(lc) as client,
    ):
        futures = [
            RecyclableFuture(wrapped_future=client.submit(held, pure=False), task_run_id=uuid.uuid4())
            for _ in range(2)
        ]
        outcomes: dict[int, object] = {}

        def wait_on(i: int) -> None:
            try:
                outcomes[i] = futures[i].result(timeout=30)
            except BaseException as exc:  # noqa: BLE001 - the outcome is what is tested
                outcomes[i] = exc

        waiters = [threading.Thread(target=wait_on, args=(i,)) for i in range(2)]
        for waiter in waiters:
            waiter.start()
        time.sleep(0.5)  # both are waiting on Dask now
        move_into_flow(futures[0], Completed(data="moved"))
        futures[1].wrapped_future.release()  # cancelled, nothing moved
        for waiter in waiters:
            waiter.join(15)
        HOLD.set()
    assert outcomes[0] == "moved"
    assert isinstance(outcomes[1], CancelledError), outcomes[1]


def test_a_worker_replaced_before_its_restart_is_recorded_as_replaced():
    """Another flow run's restart (here: ``restart_workers``) replaced the worker between
    this flow's verdict and its restart: the record names the replacement."""
    with cluster(n_workers=1, threads_per_worker=1) as lc, Client(lc) as client:
        [(old, info)] = client.scheduler_info()["workers"].items()
        client.restart_workers([old])
        [new] = client.scheduler_info()["workers"]
        assert new != old
        rc = recycler(client)
        rc.request(old, "leak: test", worker_name=str(info["name"]))
        deadline = time.monotonic() + 20
        while not rc.restarts and time.monotonic() < deadline:
            time.sleep(0.05)
        rc.close(wait=False)
        [record] = rc.restarts
        assert (record.outcome, record.worker, record.new_worker, record.reason) == (
            "replaced",
            old,
            new,
            "leak: test",
        )
        assert record.new_pid == client.run(os.getpid)[new]


def test_a_worker_gone_for_good_before_its_restart_is_lost(monkeypatch):
    """What waited for it may have nowhere left to run: the runner strands it on a lost record."""
    monkeypatch.setattr(recycling, "REPLACEMENT_WAIT_S", 1.0)
    with cluster(n_workers=2, threads_per_worker=1) as lc, Client(lc) as client:
        workers = client.scheduler_info()["workers"]
        old = next(iter(workers))
        client.retire_workers([old], close_workers=True)
        lc.scale(1)  # the cluster does not start it again
        heard: list[RestartRecord] = []
        rc = Recycler(client, "worker", logger=logging.getLogger("test-restarts"), on_restart=heard.append)
        name = str(workers[old]["name"])
        rc.request(old, "leak: test", worker_name=name)
        deadline = time.monotonic() + 20
        while not heard and time.monotonic() < deadline:
            time.sleep(0.05)
        rc.close(wait=True)
        [record] = heard
        assert rc.restarts == (record,)
        assert (record.outcome, record.worker, record.new_worker) == ("lost", old, None)
        assert f"no worker named {name!r} joined within 1 s" in record.lost_reason


def test_a_recycler_closing_while_its_worker_is_gone_leaves_no_record():
    with cluster(n_workers=2, threads_per_worker=1) as lc, Client(lc) as client:
        workers = client.scheduler_info()["workers"]
        old = next(iter(workers))
        client.retire_workers([old], close_workers=True)
        lc.scale(1)
        rc = recycler(client)
        rc.request(old, "leak: test", worker_name=str(workers[old]["name"]))
        time.sleep(1.0)  # well within its wait for a replacement
        rc.close(wait=False)
        assert rc.restarts == ()
