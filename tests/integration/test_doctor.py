"""``prefect-gpu-dask doctor`` as an operator runs it: on this GPU-less host, against a
real cluster by address, and (marked gpu) on a GPU host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert api["status"] == INFO and "SQLite" in api["detail"] and "one writer at a time" in api["detail"]
    assert api["hint"] and "PostgreSQL" in api["hint"]


def prefect_api_finding(**env: str) -> dict:
    report = json.loads(doctor("--json", extra_env=env).stdout)
    return next(f for f in report["findings"] if f["area"] == "Prefect API")


def test_the_embedded_server_is_named_sqlite_with_its_postgres_hint():
    api = prefect_api_finding()  # no PREFECT_API_URL: the flow run's own server
    assert api["status"] == INFO and "temporary server" in api["detail"] and "SQLite" in api["detail"], api
    assert "PostgreSQL" in api["hint"]


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


def test_prefects_twenty_seconds_for_a_temporary_server_are_flagged_as_too_short_for_a_night(tmp_path):
    short = findings_in(tmp_path, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="20")["temporary server"]
    assert short["status"] == WARN and "20 s" in short["detail"], short
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120" in short["hint"]
    enough = findings_in(tmp_path, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120")["temporary server"]
    assert enough["status"] == OK, enough
