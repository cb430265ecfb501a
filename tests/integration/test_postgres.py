"""The runner against a Prefect server backed by a real PostgreSQL (Prefect's production
setup): Debian's ``postgresql`` started on 127.0.0.1, ``prefect server start`` on it."""

from __future__ import annotations

import time

import pytest
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings

from prefect_gpu_dask import GPUDaskTaskRunner
from tests.servers import postgres_missing, postgres_server, prefect_server

missing = postgres_missing()
pytestmark = pytest.mark.skipif(missing is not None, reason=f"no PostgreSQL here: {missing}")


@task(tags=["gpu"])
def on_gpu(i: int) -> int:
    return i * i


@task
def on_cpu(i: int) -> int:
    return -i


def test_gpu_flow_on_a_postgresql_backed_server():
    runner = GPUDaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={"n_workers": 1, "threads_per_worker": 4, "resources": {"GPU": 1}},
    )

    @flow(task_runner=runner)
    def nightly() -> tuple[list[int], str]:
        from prefect.context import get_run_context

        futures = [on_gpu.submit(i) for i in range(40)] + [on_cpu.submit(i) for i in range(40)]
        return [f.result() for f in futures], str(get_run_context().flow_run.id)

    with postgres_server() as database, prefect_server(database) as api:
        with temporary_settings({PREFECT_API_URL: api}):
            out, flow_run_id = nightly()
            only_this = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            deadline = time.monotonic() + 60
            with get_client(sync_client=True) as client:
                # Task runs reach the server as events, recorded after the flow returns.
                while True:
                    task_runs = client.read_task_runs(flow_run_filter=only_this)
                    done = [run for run in task_runs if run.state and run.state.is_completed()]
                    if len(done) == 80 or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                flow_run = client.read_flow_run(flow_run_id)
            # This process's event and log senders point at this server: empty them while
            # it still answers, not at the session's end against a stopped one.
            EventsWorker.drain_all(timeout=30)
            APILogWorker.drain_all(timeout=30)
    assert out == [i * i for i in range(40)] + [-i for i in range(40)]
    assert flow_run.state.is_completed()
    assert len(task_runs) == 80 and all(run.state.is_completed() for run in task_runs)
    assert sum("gpu" in run.tags for run in task_runs) == 40
