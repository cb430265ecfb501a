"""Prefect's API server on SQLite, started where this package is installed: a flow run
created while another connection writes waits for the write lock instead of failing
with "database is locked" (answered 503); with the plugin turned off, Prefect's own
behaviour comes back."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import urllib.error
import urllib.request
import uuid

import pytest

from prefect_gpu_dask.api_server.sqlite import OPT_OUT
from tests.servers import SQLITE_FILES, prefect_server

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
