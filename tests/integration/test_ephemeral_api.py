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

from benchmarks.probes import night_start
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


NIGHTLY_SCRIPTS = 3
NIGHTLY_TASKS = 100


def test_scripts_started_together_on_a_new_embedded_database_migrate_it_once_and_run_without_503s(tmp_path):
    """A night's scripts on the README default, the first night: each starts a temporary
    server of its own on one SQLite database that does not exist yet. One script's server
    migrates it while the others wait to start theirs: no server meets another's migration."""
    script = tmp_path / "nightly.py"
    script.write_text(night_start.SCRIPT)
    home = tmp_path / "home"
    env = night_start.script_env(home, startup_s=120)
    logs = [tmp_path / f"nightly-{i}.log" for i in range(NIGHTLY_SCRIPTS)]
    runs = []
    try:
        for log in logs:
            with log.open("w") as out:  # a file, not a pipe: a chatty script never waits on its reader
                command = [sys.executable, str(script), str(NIGHTLY_TASKS)]
                runs.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=out))
        deadline = time.monotonic() + 200  # within the test's own timeout
        for run in runs:
            run.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for run in runs:  # none left behind with its server and cluster, whatever happened
            if run.poll() is None:
                run.kill()
                run.wait()
    texts = [log.read_text() for log in logs]
    assert [run.returncode for run in runs] == [0] * NIGHTLY_SCRIPTS, "\n".join(t[-3000:] for t in texts)
    troubles = ("Encountered retryable exception in request", "database is locked")
    troubles += night_start.MIGRATION_CLASH
    for text in texts:
        for trouble in troubles:
            assert trouble not in text, text[-3000:]
    assert sum(night_start.MIGRATED in text for text in texts) == 1, [t[-3000:] for t in texts]
    with sqlite3.connect(home / "prefect.db") as db:
        states = dict(db.execute("SELECT state_type, count(*) FROM task_run GROUP BY state_type").fetchall())
        flow_runs = db.execute("SELECT state_type FROM flow_run").fetchall()
    assert flow_runs == [("COMPLETED",)] * NIGHTLY_SCRIPTS
    assert states == {"COMPLETED": NIGHTLY_SCRIPTS * NIGHTLY_TASKS}


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
