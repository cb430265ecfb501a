"""WorkerHeap on real worker processes: an idle worker freezes its heap out of full
collections once it has new modules, never while a task runs; the runner installs it."""

from __future__ import annotations

import gc
import time

import pytest
from distributed import Client, Event, LocalCluster
from prefect import flow, task
from prefect.context import FlowRunContext

from prefect_gpu_dask import GPUDaskTaskRunner
from prefect_gpu_dask.worker.heap import WorkerHeap, freeze_due


def freeze_count(dask_worker=None) -> int:
    return gc.get_freeze_count()


def freezes(dask_worker) -> int:
    return dask_worker.plugins[WorkerHeap.name].freezes


def import_new_module_and_wait(started: str, go_on: str) -> None:
    import pydoc_data.topics  # noqa: F401  (a module no worker has imported yet)

    Event(started).set()
    assert Event(go_on).wait(30)


def wait_for(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_freeze_is_due_only_with_new_modules_and_no_task():
    assert freeze_due(modules=500, modules_at_last_freeze=0, executing=0)
    assert not freeze_due(modules=500, modules_at_last_freeze=500, executing=0)
    assert not freeze_due(modules=501, modules_at_last_freeze=500, executing=1)


def test_a_bad_interval_is_refused_naming_it():
    with pytest.raises(ValueError, match="-1"):
        WorkerHeap(check_s=-1)


def test_an_idle_worker_freezes_and_a_running_task_is_left_alone():
    with LocalCluster(n_workers=1, threads_per_worker=2, dashboard_address=":0", processes=True) as cluster:
        with Client(cluster) as client:
            assert list(client.run(freeze_count).values()) == [0]
            client.register_plugin(WorkerHeap(check_s=0.2), name=WorkerHeap.name)
            wait_for(lambda: list(client.run(freezes).values()) == [1])  # idle: its imports frozen
            assert list(client.run(freeze_count).values())[0] > 1000

            started, go_on = Event("started"), Event("go-on")
            running = client.submit(import_new_module_and_wait, "started", "go-on", pure=False)
            assert started.wait(30)
            time.sleep(1.0)  # five checks while the task runs, with a module new since
            assert list(client.run(freezes).values()) == [1]
            go_on.set()
            running.result(30)
            wait_for(lambda: list(client.run(freezes).values())[0] >= 2)  # idle again: the new module
            done = list(client.run(freezes).values())
            time.sleep(1.0)
            assert list(client.run(freezes).values()) == done  # nothing new: nothing done
            assert gc.get_freeze_count() == 0  # the client's own process is not touched


@task
def noop(i: int) -> int:
    return i


def test_the_runner_installs_it_on_its_workers():
    runner = GPUDaskTaskRunner(cluster_kwargs={"n_workers": 1, "threads_per_worker": 2}, guard="off")

    @flow(task_runner=runner)
    def installed() -> list[bool]:
        assert noop.submit(1).result() == 1
        client = FlowRunContext.get().task_runner.client
        return list(client.run(lambda dask_worker: WorkerHeap.name in dask_worker.plugins).values())

    assert installed() == [True]
