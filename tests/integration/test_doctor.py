"""``prefect-gpu-dask doctor`` as an operator runs it: on this GPU-less host, against a
real cluster by address, and (marked gpu) on a GPU host."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_gpu_dask.api_server.sqlite import OPT_OUT
from prefect_gpu_dask.cli.doctor import FAIL, INFO, OK, WARN, Diagnosis, Finding, _built_for
from tests.conftest import has_gpu

ROOT = Path(__file__).resolve().parents[2]


def doctor(
    *args: str, api: str | None = None, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        **(extra_env or {}),
    }
    env.pop("PREFECT_API_URL", None)
    if api:
        env["PREFECT_API_URL"] = api
    command = [sys.executable, "-m", "prefect_gpu_dask", "doctor", *args]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(has_gpu(), reason="checks what a host without a GPU is told")
def test_a_host_without_a_gpu_is_not_ready_and_is_told_why(prefect_api):
    text = doctor(api=prefect_api)
    assert text.returncode == 1, text.stdout + text.stderr
    assert "[FAIL] driver: NVML did not load" in text.stdout
    assert "NOT ready for GPU flows" in text.stdout.splitlines()[-1]
    report = json.loads(doctor("--json", api=prefect_api).stdout)
    assert report["ready"] is False and report["seconds"] < 5
    api = next(f for f in report["findings"] if f["area"] == "Prefect API")
    # A running server's environment is not visible from here.
    assert api["status"] == WARN and "SQLite" in api["detail"] and "cannot see" in api["detail"]
    assert api["hint"] and "PostgreSQL" in api["hint"]


def prefect_api_finding(**env: str) -> dict:
    report = json.loads(doctor("--json", extra_env=env).stdout)
    return next(f for f in report["findings"] if f["area"] == "Prefect API")


def test_the_embedded_server_is_ok_while_the_server_plugin_is_on():
    api = prefect_api_finding()  # no PREFECT_API_URL: the flow run's own server, from here
    assert api["status"] == OK and "server plugin" in api["detail"], api
    api = prefect_api_finding(**{OPT_OUT: "false"})
    assert api["status"] == WARN and OPT_OUT in api["detail"] and "503" in api["detail"], api


def test_a_cluster_with_a_gpu_worker_is_ready_one_without_is_not(dask_processes, prefect_api):
    dask_processes.start_scheduler()
    dask_processes.start_worker("gpu-worker", "--nthreads", "1", "--resources", "GPU=1")
    dask_processes.start_worker("cpu-worker", "--nthreads", "1")
    dask_processes.wait_for_workers(2)
    ready = doctor("--address", dask_processes.address, "--json", api=prefect_api)
    assert ready.returncode == 0, ready.stdout + ready.stderr
    findings = {f["area"]: f for f in json.loads(ready.stdout)["findings"]}
    assert findings["worker gpu-worker"]["status"] == OK and findings["worker gpu-worker"]["gpu_ready"]
    assert "no GPU slot" in findings["worker cpu-worker"]["detail"]
    assert "no TLS" in findings["cluster"]["detail"]

    dead = doctor("--address", "tcp://127.0.0.1:1", api=prefect_api)
    assert dead.returncode == 1 and "[FAIL] cluster: tcp://127.0.0.1:1 does not answer" in dead.stdout


def test_an_unreachable_api_fails():
    text = doctor("--address", "tcp://127.0.0.1:1", api="http://127.0.0.1:1/api")
    assert text.returncode == 1
    assert "[FAIL] Prefect API: http://127.0.0.1:1/api does not answer" in text.stdout


def test_the_verdict_needs_a_ready_gpu_and_no_failure():
    gpu = Finding("GPU 0", OK, "H100", gpu_ready=True)
    assert Diagnosis((gpu, Finding("Prefect API", WARN, "SQLite")), 0.1).ready
    assert not Diagnosis((gpu, Finding("cupy", FAIL, "cuda13 build, driver 12")), 0.1).ready
    assert not Diagnosis((Finding("driver", OK, "580"),), 0.1).ready
    assert [_built_for(d) for d in ("cupy-cuda12x", "cupy-cuda13x", "cudf-cu12", "dask-cuda")] == [
        12,
        13,
        12,
        None,
    ]


@pytest.mark.gpu
def test_on_a_gpu_host_it_is_ready_within_five_seconds(prefect_api):
    text = doctor(api=prefect_api)
    print(text.stdout)
    report = json.loads(doctor("--json", api=prefect_api).stdout)
    assert text.returncode == 0, text.stdout
    gpus = [f for f in report["findings"] if f["area"].startswith("GPU ")]
    assert gpus and all(f["gpu_ready"] for f in gpus)
    assert {f["area"] for f in report["findings"] if f["status"] == OK} >= {"driver", "cupy", "dask-cuda"}
    assert report["seconds"] < 5


def findings_in(home: Path, **env: str) -> dict[str, dict]:
    report = json.loads(doctor("--json", extra_env={"PREFECT_HOME": str(home), **env}).stdout)
    return {f["area"]: f for f in report["findings"]}


def prefect_cli(home: Path, *args: str) -> None:
    env = {**os.environ, "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    command = [sys.executable, "-m", "prefect", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_database_behind_prefects_migrations_is_told_to_upgrade_before_flows_start_together(tmp_path):
    home = tmp_path / "prefect-home"
    found = findings_in(home)
    database = found["Prefect database"]
    # The package's runners start their servers on it one at a time; other flows would not.
    assert database["status"] == INFO and "does not exist yet" in database["detail"], database
    assert "one at a time" in database["detail"]
    without_the_lock = findings_in(home, PREFECT_GPU_DASK_MIGRATION_LOCK="false")["Prefect database"]
    assert without_the_lock["status"] == WARN and "is off" in without_the_lock["detail"], without_the_lock
    assert "prefect server database upgrade -y" in database["hint"]
    assert not (home / "prefect.db").exists()  # read-only: the doctor creates nothing

    prefect_cli(home, "server", "database", "upgrade", "-y")
    before = sorted(p.name for p in home.iterdir())
    database = findings_in(home)["Prefect database"]
    assert database["status"] == OK and "latest migration" in database["detail"], database
    assert sorted(p.name for p in home.iterdir()) == before  # no -shm or -wal file left beside it

    # As a database last migrated by an older Prefect reads, with the change still in the
    # write-ahead log (a connection holds it open, as a running server would) and after.
    with contextlib.closing(sqlite3.connect(home / "prefect.db")) as db:
        with db:
            db.execute("UPDATE alembic_version SET version_num = 'older'")
        database = findings_in(home)["Prefect database"]
        assert database["status"] == INFO and "is at migration older" in database["detail"], database
    database = findings_in(home)["Prefect database"]
    assert database["status"] == INFO and "is at migration older" in database["detail"], database


def test_prefects_twenty_seconds_for_a_temporary_server_are_flagged_as_too_short_for_a_night(tmp_path):
    short = findings_in(tmp_path, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="20")["temporary server"]
    assert short["status"] == WARN and "20 s" in short["detail"], short
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120" in short["hint"]
    enough = findings_in(tmp_path, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120")["temporary server"]
    assert enough["status"] == OK, enough
