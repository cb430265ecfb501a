"""The README's default, a script on Prefect's ephemeral server: the process ending right
after its flow run keeps the server up until every task run that ran (a subflow's too)
has its final state there, and gives up once the count stops rising."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from collections import OrderedDict
from pathlib import Path

from prefect_gpu_dask.flow import prefect_api as ephemeral

ROOT = Path(__file__).resolve().parents[2]
TASKS = 500
INNER_TASKS = 100

SCRIPT = textwrap.dedent(
    f"""
    from prefect import flow, task

    from prefect_gpu_dask import GPUDaskTaskRunner


    @task
    def noop(i: int) -> int:
        return i


    @flow(task_runner=GPUDaskTaskRunner(
        host_cluster=False, cluster_kwargs={{"n_workers": 1, "threads_per_worker": 2}}
    ))
    def inner() -> int:
        return sum(f.result() for f in noop.map(range({INNER_TASKS})))


    @flow(task_runner=GPUDaskTaskRunner(
        host_cluster=False, cluster_kwargs={{"n_workers": 2, "threads_per_worker": 2}}
    ))
    def many() -> int:
        # The subflow first: the burst of task runs comes last, right before the exit.
        return inner() + sum(f.result() for f in noop.map(range({TASKS})))


    if __name__ == "__main__":
        assert many() == {sum(range(TASKS)) + sum(range(INNER_TASKS))}
    """
)


def test_a_script_ending_right_after_its_flow_run_leaves_every_task_run_recorded(tmp_path):
    script = tmp_path / "many.py"
    script.write_text(SCRIPT)
    home = tmp_path / "home"
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "PREFECT_API_URL",
            "PREFECT_API_DATABASE_CONNECTION_URL",
            "PREFECT_SERVER_DATABASE_CONNECTION_URL",
        )
    }
    env |= {
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with sqlite3.connect(home / "prefect.db") as db:
        states = dict(db.execute("SELECT state_type, count(*) FROM task_run GROUP BY state_type").fetchall())
        flow_runs = db.execute("SELECT state_type FROM flow_run").fetchall()
    assert flow_runs == [("COMPLETED",), ("COMPLETED",)]
    # + 1: the task run Prefect makes in the parent flow run for the subflow run
    assert states == {"COMPLETED": TASKS + INNER_TASKS + 1}, proc.stderr[-4000:]


def test_the_wait_gives_up_once_the_count_stops_rising(prefect_api, monkeypatch):
    """Task runs the server will never hold: the wait ends ``stall_s`` after the last rise
    and says how many are missing."""
    monkeypatch.setattr(ephemeral, "_ran", OrderedDict())
    for _ in range(3):
        ephemeral.ran_on_a_worker(uuid.uuid4())
    started = time.monotonic()
    missing = ephemeral.wait_until_recorded(prefect_api, wait_s=30, stall_s=0.5)
    assert missing == 3
    assert time.monotonic() - started < 10
