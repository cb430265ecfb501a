"""The runner's client and every worker of its cluster send to the scheduler promptly:
Dask's batched streams hold a message at most ``PROMPT_S`` behind their last write."""

from __future__ import annotations

from types import SimpleNamespace

from prefect import flow, task
from prefect.context import FlowRunContext

from prefect_gpu_dask import GPUDaskTaskRunner, _compat
from prefect_gpu_dask._compat import PROMPT_S
from prefect_gpu_dask.worker.stream import PromptStream


def test_a_stream_holds_messages_back_no_longer_than_asked():
    client_stream = SimpleNamespace(interval=0.01)  # a BatchedSend's only setting touched
    assert _compat.send_promptly(client_stream)
    assert client_stream.interval == PROMPT_S
    assert not _compat.send_promptly(None)  # a client not connected yet


@task
def noop(i: int) -> int:
    return i


def test_the_runner_sends_promptly_and_so_do_its_workers():
    runner = GPUDaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={"n_workers": 2, "threads_per_worker": 1},
        guard="off",
    )

    @flow(task_runner=runner)
    def streams() -> tuple[float, list[float], list[bool]]:
        assert noop.submit(1).result() == 1
        client = FlowRunContext.get().task_runner.client
        workers = client.run(lambda dask_worker: dask_worker.batched_stream.interval)
        plugins = client.run(lambda dask_worker: PromptStream.name in dask_worker.plugins)
        return client.scheduler_comm.interval, list(workers.values()), list(plugins.values())

    client_interval, worker_intervals, plugins = streams()
    assert client_interval == PROMPT_S
    assert worker_intervals == [PROMPT_S, PROMPT_S]
    assert plugins == [True, True]
