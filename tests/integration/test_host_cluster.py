"""The host cluster, through its command as an operator runs it: started, shown, joined
by the default runner, stopped, killed; only its owner gets in."""

from __future__ import annotations

import contextvars
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from distributed import Client, Security
from prefect import flow, task

from prefect_gpu_dask import GPUDaskTaskRunner
from prefect_gpu_dask.host_cluster import FILE_NAME, HostCluster, find_host_cluster

ROOT = Path(__file__).resolve().parents[2]


def cli(runtime: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PREFECT_GPU_DASK_RUNTIME_DIR": str(runtime),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    return subprocess.run(
        [sys.executable, "-m", "prefect_gpu_dask", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: list[int], timeout: float = 30) -> list[int]:
    until = time.monotonic() + timeout
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < until:
        time.sleep(0.1)
    return left


def worker_pids(runtime: Path, host: HostCluster) -> list[int]:
    with Client(host.address, security=host.security, timeout=10, set_as_default=False) as client:
        return list(client.run(os.getpid).values())


@pytest.fixture(scope="module")
def runtime(tmp_path_factory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("host") / "runtime"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFECT_GPU_DASK_RUNTIME_DIR", str(path))
        yield path


def start_host_cluster(runtime: Path) -> HostCluster:
    started = cli(
        runtime, "cluster", "start", "--workers", "1", "--threads-per-worker", "2",
        "--resources", "GPU=1", "--dashboard-address", "127.0.0.1:0",
    )  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    assert "Host cluster started at tls://127.0.0.1:" in started.stdout
    return find_host_cluster(runtime)


@pytest.fixture(scope="module")
def host_cluster(runtime) -> Iterator[HostCluster]:
    """One for the module; a test that stops or kills it starts the next one."""
    hosts = [find_host_cluster(runtime) or start_host_cluster(runtime)]

    def current() -> HostCluster:
        if (host := find_host_cluster(runtime)) is None:
            hosts.append(host := start_host_cluster(runtime))
        return host

    yield current
    cli(runtime, "cluster", "stop", "--force")
    for host in hosts:
        if alive(host.pid):
            os.killpg(host.pid, signal.SIGKILL)


@task(tags=["gpu"])
def held_until(go: str, started: str) -> int:
    Path(started).write_text(str(os.getpid()))
    until = time.monotonic() + 60
    while not Path(go).exists() and time.monotonic() < until:
        time.sleep(0.05)
    return os.getpid()


@task(tags=["gpu"])
def on_the_gpu() -> tuple[int, str]:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return os.getpid(), props["name"].decode()


@pytest.mark.gpu
def test_on_a_gpu_host_it_is_a_labelled_cuda_cluster_that_flow_runs_join(runtime, host_cluster):
    host = host_cluster()
    status = json.loads(cli(runtime, "cluster", "status", "--json").stdout)
    assert host.gpus >= 1 and len(status["workers"]) == host.gpus
    assert all(w["gpu"] and w["gpu_memory"] > 0 and w["gpu_slots"] == 1 for w in status["workers"]), status

    @flow(task_runner=GPUDaskTaskRunner())
    def nightly():
        from prefect.context import FlowRunContext

        result = on_the_gpu.submit().result()
        return result, FlowRunContext.get().task_runner.records

    (pid, device), records = nightly()
    assert pid in worker_pids(runtime, host)
    assert records and records[0].gpu_uuid, records
    print(f"host cluster: {status['workers']}; task ran on {device}")


def test_only_its_owner_gets_in(runtime, host_cluster, caplog):
    host = host_cluster()
    with pytest.raises(Exception, match="TLS"):
        Client(host.address, timeout=5, set_as_default=False)
    with pytest.raises(OSError, match="certificate"):
        Client(host.address, security=Security.temporary(), timeout=5, set_as_default=False)
    again = cli(runtime, "cluster", "start")
    assert again.returncode == 1 and f"already runs at {host.address}" in again.stderr

    (runtime / FILE_NAME).chmod(0o644)  # as if someone else could have written it
    try:

        @flow(task_runner=GPUDaskTaskRunner())
        def elsewhere() -> int:
            return held_until.submit("/", os.devnull).result()

        assert elsewhere() not in worker_pids(runtime, host)
        assert "Not joining a host cluster" in caplog.text and "mode 0600" in caplog.text
    finally:
        (runtime / FILE_NAME).chmod(0o600)


def test_the_default_runner_joins_in_a_fraction_of_a_cluster_start(host_cluster):
    host = host_cluster()
    joined = GPUDaskTaskRunner()
    with joined:
        began = time.perf_counter()
        client = joined.client
        join_s = time.perf_counter() - began
        assert client.scheduler.address == host.address
    private = GPUDaskTaskRunner(host_cluster=False)
    with private:
        began = time.perf_counter()
        client = private.client
        start_s = time.perf_counter() - began
        assert client.scheduler.address != host.address
    # Figures in benchmarks/; here only the order of things, on a busy machine.
    assert join_s < start_s, (join_s, start_s)


def test_the_default_runner_joins_the_host_cluster_which_shows_and_outlives_its_flow_runs(
    runtime, host_cluster, tmp_path
):
    host = host_cluster()
    shown = cli(runtime, "cluster", "status", "--json")
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    assert status["running"] and status["address"] == host.address
    assert [w["gpu_slots"] for w in status["workers"]] == [1.0] and status["flow_runs"] == []
    assert "certificate" not in status and "key" not in status
    pids = worker_pids(runtime, host)

    go, started = tmp_path / "go", tmp_path / "started"

    @flow(task_runner=GPUDaskTaskRunner())
    def nightly() -> tuple[int, str]:
        from prefect.runtime import flow_run

        return held_until.submit(str(go), str(started)).result(), flow_run.id

    outcome: dict[str, object] = {}
    # In this test's context: its Prefect settings (the session's API server) go along.
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(lambda: outcome.update(result=nightly()),))
    thread.start()
    try:
        until = time.monotonic() + 120
        while not started.exists() and time.monotonic() < until:
            time.sleep(0.05)
        assert started.exists(), "the flow run's gpu task never started"
        busy = json.loads(cli(runtime, "cluster", "status", "--json").stdout)
        assert len(busy["flow_runs"]) == 1, busy
        refused = cli(runtime, "cluster", "stop")
        assert refused.returncode == 1 and "1 flow run(s) use the host cluster" in refused.stderr
        assert alive(host.pid)
        text = cli(runtime, "cluster", "status")
        assert text.returncode == 0 and f"flow run {busy['flow_runs'][0]}" in text.stdout
    finally:
        go.touch()
        thread.join(120)
    task_pid, flow_run_id = outcome["result"]
    assert task_pid in pids, "the gpu task did not run on the host cluster's worker"
    assert busy["flow_runs"] == [str(flow_run_id)]
    assert find_host_cluster(runtime) == host, "the host cluster closed with the flow run"

    stopped = cli(runtime, "cluster", "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert not wait_gone([host.pid, *pids]), "processes left behind after stop"
    assert not (runtime / FILE_NAME).exists()
    assert cli(runtime, "cluster", "status").returncode == 3


def test_a_killed_host_cluster_leaves_nothing_behind_and_flow_runs_start_their_own(runtime, host_cluster):
    host = host_cluster()
    pids = worker_pids(runtime, host)
    os.kill(host.pid, signal.SIGKILL)
    assert not wait_gone([host.pid, *pids]), "worker processes outlived their host cluster"

    @flow(task_runner=GPUDaskTaskRunner())
    def after_the_crash() -> int:
        return held_until.submit("/", os.devnull).result()

    assert after_the_crash() not in pids
    assert not (runtime / FILE_NAME).exists(), "the stale discovery file is still there"
    assert cli(runtime, "cluster", "status").returncode == 3


def test_bad_options_are_named_before_anything_starts(runtime):
    for args, named in (
        (("--workers", "0"), "workers 0"),
        (("--resources", "GPU"), "'GPU'"),
        (("--resources", "GPU=many"), "'GPU=many'"),
    ):
        result = cli(runtime, "cluster", "start", *args, timeout=60)
        assert result.returncode == 2 and named in result.stderr, result.stderr
    assert not (runtime / FILE_NAME).exists()
    assert cli(runtime, "cluster", "stop").stdout.strip() == "No host cluster runs"
