"""Tag concurrency limits through the runner, on a real Prefect API and real Dask
processes: a limit holds across workers, and tags stay on the task run."""

from __future__ import annotations

import time
import uuid

import pytest
from prefect import flow, task
from prefect.client.orchestration import get_client

from prefect_gpu_dask import GPUDaskTaskRunner
from tests.integration.test_reliability import max_concurrency


@task
def nap(seconds: float) -> tuple[float, float]:
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


@pytest.fixture
def tag_limit():
    """A tag concurrency limit, made with Prefect's own API, removed afterwards."""
    made: list[str] = []

    def make(limit: int) -> str:
        tag = f"limited-{uuid.uuid4().hex[:8]}"
        with get_client(sync_client=True) as api:
            api.create_concurrency_limit(tag=tag, concurrency_limit=limit)
        made.append(tag)
        return tag

    yield make
    with get_client(sync_client=True) as api:
        for tag in made:
            api.delete_concurrency_limit_by_tag(tag)


def test_tag_limits_hold_and_unlimited_tags_stay_on_the_run(remote_cluster, tag_limit):
    one_at_a_time = tag_limit(1)
    free = f"free-{uuid.uuid4().hex[:8]}"

    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def tagged():
        limited = [nap.with_options(tags=[one_at_a_time]).submit(0.4) for _ in range(4)]
        unlimited = [nap.with_options(tags=[free]).submit(0.4) for _ in range(4)]
        return [f.result() for f in limited], [f.result() for f in unlimited], unlimited[0].task_run_id

    limited, unlimited, task_run_id = tagged()
    assert max_concurrency(limited) == 1, limited
    assert max_concurrency(unlimited) >= 2, unlimited
    with get_client(sync_client=True) as api:
        assert free in api.read_task_run(task_run_id).tags
