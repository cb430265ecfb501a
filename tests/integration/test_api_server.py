"""Prefect's API server on SQLite, started where this package is installed: a flow run
created while another connection writes waits for the write lock instead of failing
with "database is locked" (answered 503); its task-run recorder writes events as they
come, in batches under load, and keeps every event; with the plugin turned off,
Prefect's own behaviour comes back."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest

from prefect_gpu_dask import _compat
from prefect_gpu_dask.api_server.sqlite import OPT_OUT, RECORDER_OPT_OUT
from tests.servers import SQLITE_FILES, prefect_server, using_prefect_server

HOLD_S = 2.0


def post(url: str, body: dict) -> tuple[int, dict]:
    """One request, no retries (Prefect's client would retry a 503 and hide it)."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, {}


def create_flow_run_while_another_connection_writes(api: str) -> tuple[int, float]:
    status, made = post(f"{api}/flows/", {"name": f"locked-{uuid.uuid4().hex[:8]}"})
    assert status in (200, 201), status
    writer = sqlite3.connect(SQLITE_FILES[api], timeout=30, isolation_level=None, check_same_thread=False)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("UPDATE flow SET updated = updated WHERE id = ?", (made["id"],))  # a write in flight
    release = threading.Timer(HOLD_S, writer.execute, ["COMMIT"])
    release.start()
    try:
        start = time.monotonic()
        status, _ = post(f"{api}/flow_runs/", {"flow_id": made["id"], "name": "while-locked"})
        return status, time.monotonic() - start
    finally:
        release.join()
        writer.close()


def test_a_flow_run_created_while_another_connection_writes_waits_for_the_lock():
    with prefect_server() as api:
        status, took = create_flow_run_while_another_connection_writes(api)
    assert status == 201, f"the server answered {status} after {took:.2f} s"
    assert took >= HOLD_S * 0.8, f"answered after {took:.2f} s, before the other write ended"


def test_turned_off_prefects_deferred_transaction_fails_against_the_same_write(monkeypatch):
    monkeypatch.setenv(OPT_OUT, "false")
    with prefect_server() as api:
        status, took = create_flow_run_while_another_connection_writes(api)
    if status == 201:
        pytest.fail(f"Prefect's own server waited {took:.2f} s and created the run: nothing to fix here")
    assert status == 503, status


@pytest.mark.parametrize(
    "environment, batches",
    [
        ({}, "writing events as they come, up to 100 a transaction"),
        (
            {"PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "7"},
            "writing events as they come, up to 7 a transaction",
        ),
        ({RECORDER_OPT_OUT: "false"}, "with batch size 1 and flush every 5 seconds"),
    ],
    ids=["default", "user-set", "turned-off"],
)
def test_a_sqlite_servers_task_run_recorder_writes_in_batches_unless_told_otherwise(
    monkeypatch, environment, batches
):
    monkeypatch.setenv("PREFECT_SERVER_LOGGING_LEVEL", "INFO")  # the recorder logs its settings
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    starting = "Creating TaskRunRecorder consumer"
    with prefect_server() as api:
        log = SQLITE_FILES[api].parent / "server.log"
        deadline = time.monotonic() + 60
        while starting not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        created = [line for line in log.read_text().splitlines() if starting in line]
    assert len(created) == 1 and created[0].endswith(batches), created


def test_an_idle_sqlite_server_records_a_task_run_at_once(monkeypatch):
    """A task run's final state is in the database as soon as its events reach the
    server, not at the recorder's next flush (made 60 s here, so a timed batch shows)."""
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.events.worker import EventsWorker

    monkeypatch.setenv("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL", "60")

    @task
    def one() -> int:
        return 1

    @flow
    def a_flow_of_one_task():
        return one.submit().result()

    with using_prefect_server():
        state = a_flow_of_one_task(return_state=True)
        EventsWorker.drain_all()  # the task run's events have reached the server
        reached = time.monotonic()  # a failed write would wait 60 s too: not at once either
        with get_client(sync_client=True) as client:
            runs_filter = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
            while True:
                runs = client.read_task_runs(flow_run_filter=runs_filter)
                if runs and all(run.state is not None and run.state.is_completed() for run in runs):
                    break
                assert time.monotonic() - reached < 30, f"not recorded after 30 s: {runs}"
                time.sleep(0.05)
    assert len(runs) == 1


def test_the_recorders_and_persisters_queues_keep_events_past_the_brokers_limit(monkeypatch):
    """Prefect's in-memory broker drops what a subscription 10,000 behind is sent; the
    task-run recorder's and the event persister's keep it (Prefect's real broker, in
    this process, on a topic of the test's own)."""
    import asyncio

    import prefect.server.events.services.event_persister as persister
    import prefect.server.services.task_run_recorder as recorder
    from prefect.server.utilities.messaging import create_consumer, create_publisher

    for service in (recorder, persister):  # restored after the test
        monkeypatch.setattr(service, "create_consumer", service.create_consumer)
    _compat.keep_every_recorded_event()
    topic = f"events-{uuid.uuid4().hex[:8]}"

    async def queued_after(sent: int) -> list[int]:
        consumers = [
            recorder.create_consumer(topic, group="task-run-recorder", name="recorder"),
            persister.create_consumer(topic, group="event-persister", name="persister"),
            create_consumer(topic, group="another", name="another"),  # Prefect's own limit
        ]
        async with create_publisher(topic) as publisher:
            for i in range(sent):
                await publisher.publish_data(b"{}", {"id": str(i)})
        return [consumer.subscription._queue.qsize() for consumer in consumers]

    assert asyncio.run(queued_after(10_050)) == [10_050, 10_050, 10_000]
