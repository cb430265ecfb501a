"""WorkerHeap on real worker processes: an idle worker freezes its heap out of full
collections once it has new modules, never while a task runs; the runner installs it."""

from __future__ import annotations

import gc
import time

from distributed import Client, Event, LocalCluster
from prefect import flow, task
from prefect.context import FlowRunContext

from prefect_gpu_dask import GPUDaskTaskRunner, forkserver
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


def test_a_worker_forked_from_the_server_starts_with_the_servers_heap_frozen(monkeypatch):
    forkserver.worker_start_method()  # the server runs; earlier tests may have changed the environment
    monkeypatch.setattr(forkserver, "_fork_server_surroundings", forkserver._surroundings())
    with forkserver.worker_processes() as method:
        assert method == "forkserver"
        with LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0") as cluster:
            with Client(cluster) as client:
                # No WorkerHeap here: what is frozen came frozen from the server.
                assert list(client.run(freeze_count).values())[0] > 1000


def test_a_worker_freezes_at_setup_and_when_its_last_task_ends_never_during_one():
    frozen_here = gc.get_freeze_count()
    with LocalCluster(n_workers=1, threads_per_worker=2, dashboard_address=":0", processes=True) as cluster:
        with Client(cluster) as client:
            assert list(client.run(freeze_count).values()) == [0]
            client.register_plugin(WorkerHeap(), name=WorkerHeap.name)
            assert list(client.run(freezes).values()) == [1]  # at setup: its imports frozen
            assert list(client.run(freeze_count).values())[0] > 1000

            started, go_on = Event("started"), Event("go-on")
            running = client.submit(import_new_module_and_wait, "started", "go-on", pure=False)
            assert started.wait(30)
            slow = client.submit(time.sleep, 0.5, pure=False)  # ends while the first still runs
            slow.result(30)
            time.sleep(0.5)
            assert list(client.run(freezes).values()) == [1]  # a task ended, another runs: not now
            go_on.set()
            running.result(30)
            wait_for(lambda: list(client.run(freezes).values())[0] >= 2)  # the last one ended: new module
            done = list(client.run(freezes).values())
            client.submit(time.sleep, 0.1, pure=False).result(30)
            time.sleep(0.5)
            assert list(client.run(freezes).values()) == done  # nothing new: nothing done
            assert gc.get_freeze_count() == frozen_here  # the client's own process is not touched


def test_a_worker_in_the_clients_process_is_left_alone():
    frozen_here = gc.get_freeze_count()
    with LocalCluster(n_workers=1, threads_per_worker=2, dashboard_address=":0", processes=False) as cluster:
        with Client(cluster) as client:
            client.register_plugin(WorkerHeap(), name=WorkerHeap.name)
            assert client.submit(len, "abc").result(30) == 3
            time.sleep(0.5)
            assert list(client.run(freezes).values()) == [0]
    assert gc.get_freeze_count() == frozen_here


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
