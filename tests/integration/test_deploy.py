"""deployments/prefect.yaml registers the four nightly flows on a real Prefect API via the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"
POOL = "gpu-pool"
TIMEZONE = "Europe/Berlin"
EXPECTED = {
    # flow name: (entrypoint, cron, parameters)
    "speed-cube": ("flows/speed_cube.py:speed_cube", "0 2 * * *", {"n": None, "chunk": None, "seed": 0}),
    "svd": (
        "flows/svd.py:svd",
        "30 2 * * *",
        {"rows": None, "cols": None, "row_chunk": None, "seed": 0},
    ),
    "cudf-etl": (
        "flows/cudf_etl.py:cudf_etl",
        "0 3 * * *",
        {"out_dir": None, "backend": None, "partitions": None, "rows_per_partition": None, "seed": 0},
    ),
    "leak-demo": ("flows/leak_demo.py:leak_demo", "30 3 * * *", {"mib": 512, "timeout_s": 60}),
}


def prefect_cli(*args: str, home: Path, api_url: str) -> subprocess.CompletedProcess:
    """``prefect --no-prompt ...`` from the repository root, against the test API."""
    env = {
        **os.environ,
        "PREFECT_API_URL": api_url,
        "PREFECT_HOME": str(home),  # leave the user's profiles alone
        "PREFECT_CLI_COLORS": "false",
        "PREFECT_CLI_WRAP_LINES": "false",
        "COLUMNS": "200",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"prefect {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def deployed(prefect_api: str, tmp_path_factory) -> str:
    """Create the process work pool and run ``prefect deploy --all`` the documented way."""
    home = tmp_path_factory.mktemp("prefect-home")
    prefect_cli(
        "work-pool", "create", POOL, "--type", "process", "--overwrite", home=home, api_url=prefect_api
    )
    proc = prefect_cli(
        "deploy", "--all", "--prefect-file", "deployments/prefect.yaml", home=home, api_url=prefect_api
    )
    return proc.stdout


def read_deployments() -> dict[str, object]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        return {
            f"{flows[d.flow_id]}/{d.name}": d for d in client.read_deployments() if d.work_pool_name == POOL
        }


def test_prefect_yaml_lists_the_four_flows():
    config = yaml.safe_load(PREFECT_FILE.read_text())
    entrypoints = {d["entrypoint"] for d in config["deployments"]}
    assert entrypoints == {entry for entry, _, _ in EXPECTED.values()}
    for entry in entrypoints:
        assert (ROOT / entry.split(":")[0]).is_file(), entry


def test_deploy_all_registers_every_flow(deployed: str):
    deployments = read_deployments()
    assert set(deployments) == {f"{flow}/nightly" for flow in EXPECTED}, deployed
    for flow_name, (entrypoint, cron, parameters) in EXPECTED.items():
        d = deployments[f"{flow_name}/nightly"]
        assert d.entrypoint == entrypoint
        assert d.work_pool_name == POOL
        assert d.work_queue_name == "default"
        assert d.parameters == parameters
        assert d.enforce_parameter_schema
        assert set(d.parameter_openapi_schema["properties"]) == set(parameters)
        [schedule] = d.schedules
        assert schedule.active
        assert schedule.schedule.cron == cron
        assert schedule.schedule.timezone == TIMEZONE
        assert "gpu" in d.tags


def test_deployments_pull_from_the_repository_root(deployed: str):
    for d in read_deployments().values():
        [step] = d.pull_steps
        directory = step["prefect.deployments.steps.set_working_directory"]["directory"]
        assert Path(directory).resolve() == ROOT.resolve()
        assert (Path(directory) / d.entrypoint.split(":")[0]).is_file()


def test_registered_schedule_fires_at_two_in_berlin_across_dst(deployed: str):
    """The server's own cron arithmetic on what was registered: 02:00 Berlin time, winter and summer."""
    import asyncio
    from datetime import datetime
    from zoneinfo import ZoneInfo

    from prefect.server.schemas.schedules import CronSchedule

    registered = read_deployments()["speed-cube/nightly"].schedules[0].schedule
    schedule = CronSchedule(cron=registered.cron, timezone=registered.timezone)
    berlin = ZoneInfo(TIMEZONE)
    for start in (datetime(2031, 1, 10, tzinfo=berlin), datetime(2031, 7, 10, tzinfo=berlin)):
        dates = asyncio.run(schedule.get_dates(n=3, start=start))
        assert len(dates) == 3
        for when in dates:
            local = when.astimezone(berlin)
            assert (local.hour, local.minute) == (2, 0), when


@pytest.mark.skipif(
    not os.environ.get("PREFECT_GPU_DASK_E2E"),
    reason="about 45 s on 2 cores: set PREFECT_GPU_DASK_E2E=1 to run a deployment through a worker",
)
def test_a_process_worker_runs_a_deployment_from_anywhere(deployed: str, prefect_api: str, tmp_path: Path):
    """A worker started outside the repository pulls into it and runs the flow to completion."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    run = run_deployment("speed-cube/nightly", parameters={"n": 800, "chunk": 400}, timeout=0)
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PREFECT_HOME": str(tmp_path)}
    worker = subprocess.run(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--run-once"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run.id).state
    assert state.is_completed(), f"{state}\n{worker.stdout[-3000:]}\n{worker.stderr[-3000:]}"
