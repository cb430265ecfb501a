"""Tag concurrency limits through the runner, on a real Prefect API and real Dask
processes: a limit holds across workers, one made while a flow runs holds as soon as
Prefect's own client would see it, tags stay on the task run, and task runs whose tags
have no limit never write to the API for their slots."""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid

import pytest
from prefect import flow, task
from prefect.client.orchestration import get_client

from prefect_gpu_dask import GPUDaskTaskRunner
from prefect_gpu_dask._compat import tag_limit_memory_s
from tests.conftest import recorded_task_run
from tests.integration.test_reliability import max_concurrency
from tests.servers import SQLITE_FILES


@task
def nap(seconds: float) -> tuple[float, float]:
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


@task
async def async_nap(seconds: float) -> tuple[float, float]:
    import asyncio

    start = time.time()
    await asyncio.sleep(seconds)
    return start, time.time()


@pytest.fixture
def tag_limit():
    """A tag concurrency limit, made with Prefect's own API, removed afterwards."""
    made: list[str] = []

    def make(limit: int, prefix: str = "limited-") -> str:
        tag = f"{prefix}{uuid.uuid4().hex[:8]}"
        with get_client(sync_client=True) as api:
            api.create_concurrency_limit(tag=tag, concurrency_limit=limit)
        made.append(tag)
        return tag

    yield make
    with get_client(sync_client=True) as api:  # by id: Prefect puts a name in the URL unescaped
        for limit in api.read_global_concurrency_limits(limit=200):
            if limit.name.removeprefix("tag:") in made:
                api.delete_global_concurrency_limit_by_name(str(limit.id))


def test_a_limit_on_a_tag_with_characters_that_mean_something_in_a_url_holds(remote_cluster, tag_limit):
    one_at_a_time = tag_limit(1, prefix="team?ml#")  # Prefect refuses / % & < > in limit names

    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def slashed():
        return [f.result() for f in [nap.with_options(tags=[one_at_a_time]).submit(0.4) for _ in range(3)]]

    spans = slashed()
    assert max_concurrency(spans) == 1, spans


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
    assert free in recorded_task_run(task_run_id, settled=lambda run: True).tags


def test_a_limit_made_while_the_flow_runs_holds_as_soon_as_prefects_client_would_see_it(
    remote_cluster,
):
    tag = f"later-{uuid.uuid4().hex[:8]}"
    memory_s = tag_limit_memory_s()  # Prefect's client remembers "no limit" this long

    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def limited_later():
        spans_before = [f.result() for f in [nap.with_options(tags=[tag]).submit(0.3) for _ in range(4)]]
        with get_client(sync_client=True) as api:
            api.create_concurrency_limit(tag=tag, concurrency_limit=1)
        try:
            time.sleep(memory_s)
            after = [nap.with_options(tags=[tag]).submit(0.3) for _ in range(4)]
            return spans_before, [f.result() for f in after]
        finally:
            with get_client(sync_client=True) as api:
                api.delete_concurrency_limit_by_tag(tag)

    spans_before, spans_after = limited_later()
    assert max_concurrency(spans_before) >= 2, spans_before
    assert max_concurrency(spans_after) == 1, spans_after


@pytest.mark.parametrize("job", [nap, async_nap], ids=["sync", "async"])
def test_tagged_task_runs_without_a_limit_never_wait_on_the_servers_write_lock(
    remote_cluster, prefect_api, job
):
    """Prefect's engine asks the API for a tagged run's slots, a write even where no limit
    exists, again whenever its client's memory of "no limit" runs out; on SQLite that
    write waits for any other writer, or fails and is retried seconds later. Here another
    connection holds the database's write lock for longer than that memory: `gpu` task
    runs, whose tag has no limit, go on running one after another meanwhile."""
    database = SQLITE_FILES.get(prefect_api)
    if database is None:
        pytest.skip("the API server here is not on a SQLite file this process started")
    memory_s = tag_limit_memory_s()

    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def while_locked():
        job.with_options(tags=["gpu"]).submit(0).result()  # the worker's engine and client are warm
        writer = sqlite3.connect(database, timeout=30, isolation_level=None, check_same_thread=False)
        writer.execute("BEGIN IMMEDIATE")
        release = threading.Timer(memory_s + 4, writer.execute, ["ROLLBACK"])
        release.start()
        locked_at, slowest = time.monotonic(), 0.0
        try:
            while time.monotonic() - locked_at < memory_s + 2:
                start = time.monotonic()
                job.with_options(tags=["gpu"]).submit(0.05).result(timeout=60)
                slowest = max(slowest, time.monotonic() - start)
            return slowest
        finally:
            release.join()
            writer.close()

    slowest = while_locked()
    assert slowest < 1.5, (
        f"a tagged task run took {slowest:.2f} s while another connection held the write lock"
    )
