"""A flow run's GPU records and restarts, read back from a real Prefect API after its
flow process was killed: what was published as tasks finished is all there is."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from uuid import UUID

from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterTaskRunId
from prefect.context import FlowRunContext

from prefect_gpu_dask import GPUDaskTaskRunner, read_flow_run_gpu_report
from prefect_gpu_dask.flow import reporting
from prefect_gpu_dask.flow.reporting import SUMMARY_KEY, TABLE_KEY
from tests.scripted_probe import FAKE_PROBE
from tests.ui_helpers import LEAK_BYTES, clean, leaky, start_guarded_cluster

ROOT = Path(__file__).resolve().parents[2]
HOLDING_FLOW = """
import sys
from tests.ui_helpers import run_leaking_flow
run_leaking_flow(sys.argv[1], clean_first=2, hold_s=600)
"""


def wait_for_holding(proc: subprocess.Popen, timeout: float = 180) -> str:
    """The flow run id the child prints once it holds; its output is drained meanwhile
    (and afterwards, so a chatty flow never blocks on a full pipe)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline, seen = time.monotonic() + timeout, []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=min(left, 1.0))
        except queue.Empty:
            if proc.poll() is not None and lines.empty():
                break
            continue
        seen.append(line)
        if line.startswith("HOLDING "):
            return line.split()[1]
    raise AssertionError("the flow never reached its hold:\n" + "".join(seen[-60:]))


def test_records_and_restarts_read_back_after_the_flow_process_is_killed(dask_processes, prefect_api):
    address = start_guarded_cluster(dask_processes)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDING_FLOW, address],
        cwd=ROOT,
        env={**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        flow_run_id = wait_for_holding(proc)
        # -- while the flow still runs: every finished task's record, and the restart ---
        deadline = time.monotonic() + 60
        while True:
            live = read_flow_run_gpu_report(flow_run_id)
            names = {r.task_run_name for r in live.records}
            if {"clean-0", "clean-1", f"leaky-{LEAK_BYTES}", "clean-2"} <= names and live.restarts:
                break
            assert time.monotonic() < deadline, (names, live.restarts)
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    # -- the flow process is gone: nothing was published at its end ----------------------
    after = read_flow_run_gpu_report(flow_run_id)
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run_id).state.is_running()  # killed, not ended
        keys = {
            a.key
            for a in client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
            )
        }
    assert not {TABLE_KEY, SUMMARY_KEY} & keys
    assert set(live.records) <= set(after.records) and after.restarts == live.restarts

    # -- and what is there is typed and whole -------------------------------------------
    [leak] = after.leaks
    assert leak.delta == LEAK_BYTES and leak.task_name == "leaky" and leak.tags == ("gpu",)
    assert after.for_task_run(leak.task_run_id) == (leak,)
    assert all(r.flow_run_id == flow_run_id and r.verdict in ("clean", "leak") for r in after.records)
    assert len({r.task_run_id for r in after.records}) == len(after.records)
    assert [r.time for r in after.records] == sorted(r.time for r in after.records)
    [restart] = after.restarts
    assert restart.worker == leak.worker and restart.task_run_id == leak.task_run_id
    assert restart.old_pid == leak.pid and restart.new_pid not in (None, leak.pid)
    assert restart.serving_s > 0 and restart.reason.startswith("leak")

    # -- the same, in an operator's terminal ---------------------------------------------
    def report(*args: str) -> subprocess.CompletedProcess:
        env = {
            **os.environ,
            "PREFECT_API_URL": prefect_api,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        command = [sys.executable, "-m", "prefect_gpu_dask", "report", *args]
        return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)

    shown = report(flow_run_id)
    assert shown.returncode == 0, shown.stderr
    assert f"Task runs measured: {len(after.records)} (1 leak(s))" in shown.stdout
    [leak_line] = [line for line in shown.stdout.splitlines() if f"leaky-{LEAK_BYTES}" in line]
    assert " leak " in leak_line and restart.worker_name in shown.stdout and "replaced" in shown.stdout
    data = json.loads(report(flow_run_id, "--json").stdout)
    assert [r["task_run_id"] for r in data["records"]] == [r.task_run_id for r in after.records]
    assert [(r["worker"], r["outcome"]) for r in data["restarts"]] == [(restart.worker, "replaced")]
    assert data["quarantines"] == []
    assert report("not-a-uuid").returncode == 2


def test_an_async_flow_publishes_each_record_on_its_task_run(dask_processes):
    """The publisher's thread runs in the flow's context: for an async flow, Prefect's
    sync-or-async dispatch must still create the artifact, not hand back a coroutine."""
    address = start_guarded_cluster(dask_processes)

    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE))
    async def async_night() -> str:
        future = clean.submit(7)
        future.wait()
        return str(future.task_run_id)

    task_run_id = asyncio.run(async_night())
    deadline = time.monotonic() + 30
    with get_client(sync_client=True) as client:
        while not (
            found := client.read_artifacts(
                artifact_filter=ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(any_=[task_run_id]))
            )
        ):
            assert time.monotonic() < deadline, "no artifact on the async flow's task run"
            time.sleep(0.25)
    [artifact] = found
    assert artifact.type == "table" and artifact.description.startswith("GPU memory of this task run")


def test_records_that_arrive_together_are_published_together_and_whole(dask_processes, monkeypatch):
    """A backlog of records (here: the publisher held on its first table until all the
    others wait) goes out as one table on the flow run, while a leak keeps its own on its
    task run; the live tables hold every record once, so a flow that dies later still
    shows them."""
    address = start_guarded_cluster(dask_processes)
    flood = 3 * reporting.ONE_BY_ONE_UP_TO
    publish = reporting.LivePublisher._table
    held: list[object] = []
    problems: list[str] = []  # raised in the publisher's thread, reported here

    def once_all_wait(self, *args, **kwargs):
        deadline = time.monotonic() + 25  # within the 30 s the flow's end waits for it
        while not held and self._records.qsize() < flood + 1:  # the leak and the flood
            if time.monotonic() > deadline:
                problems.append(f"only {self._records.qsize()} records came to wait")
                break
            time.sleep(0.05)
        held.append(args[0])
        publish(self, *args, **kwargs)

    monkeypatch.setattr(reporting.LivePublisher, "_table", once_all_wait)
    monkeypatch.setattr(reporting, "GATHER_S", 0.0)  # the first record is taken alone

    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE))
    def night() -> tuple[str, str]:
        first = clean.submit(-1)
        first.wait()
        leaked = leaky.submit(LEAK_BYTES)
        assert [f.result() for f in clean.map(range(flood))] == list(range(flood))
        leaked.wait()
        return str(FlowRunContext.get().flow_run.id), str(leaked.task_run_id)

    flow_run_id, leak_task_run_id = night()
    assert problems == []

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run_id)]))
        )
    live = [a for a in artifacts if a.key is None]
    on_task_runs = sorted(str(a.task_run_id) for a in live if a.task_run_id is not None)
    [batch] = [a for a in live if a.description.startswith(reporting.BATCH_TABLE_DESCRIPTION)]
    rows = json.loads(batch.data) if isinstance(batch.data, str) else batch.data

    assert batch.task_run_id is None and len(live) == 3, [a.description for a in live]
    assert sorted(row["task_run_name"] for row in rows) == sorted(f"clean-{i}" for i in range(flood))
    assert leak_task_run_id in on_task_runs and len(on_task_runs) == 2  # the leak, and clean--1
    report = read_flow_run_gpu_report(flow_run_id)
    assert len(report.records) == flood + 2 and len(report.leaks) == 1
