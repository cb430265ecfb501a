"""Flow runs sharing one cluster, each reporting to a Prefect API of its own: every flow
run's task runs land in its own API, none in another's.

Each flow run is a process of its own (``tests.shared_api_flows``), as under a process
work pool or a cron job: with its own ``PREFECT_HOME`` and no ``PREFECT_API_URL``, it
starts Prefect's temporary server on its own SQLite database, which the test reads back
once the process has ended; with ``PREFECT_API_URL``, it reports to that server.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from tests.conftest import DaskProcesses

ROOT = Path(__file__).resolve().parents[2]
TASKS = 3


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory) -> Iterator[DaskProcesses]:
    """A ``dask scheduler`` and one two-thread ``dask worker`` labelled GPU=1, started
    once: every flow run of this module shares its worker process."""
    procs = DaskProcesses(tmp_path_factory.mktemp("shared-api-dask"))
    procs.start_scheduler()
    procs.start_worker("gpu", "--nthreads", "2", "--resources", "GPU=1")
    procs.wait_for_workers(1)
    yield procs
    procs.close()
    procs.print_log_tails()


class FlowRunProcess:
    """One flow run in a process of its own; ``api_url`` None: its own temporary server
    on a database under ``home``."""

    def __init__(
        self, address: str, ledger: Path, home: Path, label: str, api_url: str | None, port: int | None = None
    ):
        self.home, self.label, self.api_url = home, label, api_url
        home.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        env.update(
            PREFECT_HOME=str(home),
            PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            # Four temporary servers start at once on a 2-core machine.
            PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180",
        )
        if api_url:
            env["PREFECT_API_URL"] = api_url
        if port:
            env["EPHEMERAL_PORT"] = str(port)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.shared_api_flows", address, str(ledger), str(TASKS), label],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output = ""

    def wait(self, timeout: float) -> None:
        try:
            self.output = self.proc.communicate(timeout=timeout)[0]
        finally:
            self.proc.kill()

    @property
    def flow_run_id(self) -> str:
        return self.output.split("flow-run-id ")[1].split()[0]

    def recorded(self) -> tuple[list[str], dict[str, str]]:
        """The flow run ids and the task runs (id: state type) its own API holds."""
        if self.api_url is None:
            with sqlite3.connect(self.home / "prefect.db") as db:
                flow_runs = [row[0] for row in db.execute("SELECT id FROM flow_run")]
                task_runs = dict(db.execute("SELECT id, state_type FROM task_run").fetchall())
            return flow_runs, task_runs
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[self.flow_run_id]))
            )
        return [self.flow_run_id], {str(run.id): run.state_type.value for run in runs}


def run_together(address: str, ledger: Path, homes: Path, apis: list[str | None], timeout: float) -> list:
    """Start one flow run per API in ``apis`` at once; wait for them all."""
    runs = [
        FlowRunProcess(address, ledger, homes / f"run-{i}", f"{homes.name}-{i}", api)
        for i, api in enumerate(apis)
    ]
    deadline = time.monotonic() + timeout
    for run in runs:
        run.wait(max(deadline - time.monotonic(), 1))
    for run in runs:
        assert run.proc.returncode == 0, f"{run.label}:\n{run.output}"
        assert "final-state COMPLETED" in run.output, run.output
        assert "recorded 0 of" not in run.output and "task runs before stopping" not in run.output, run.output
    return runs


def executions(ledger: Path) -> dict[str, Counter]:
    """Each flow run's task bodies as the ledger saw them run: label -> task run id -> count."""
    seen: dict[str, Counter] = {}
    for line in ledger.read_text().splitlines():
        task_run_id, _, label = line.split()
        seen.setdefault(label, Counter())[task_run_id] += 1
    return seen


def assert_each_in_its_own_api(runs: list, ledger: Path) -> None:
    ran = executions(ledger)
    for run in runs:
        flow_runs, task_runs = run.recorded()
        own = ran.get(run.label, Counter())
        assert len(own) == TASKS and set(own.values()) == {1}, f"{run.label} ran {dict(own)}"
        if run.api_url is None:  # a database of its own: nothing of another flow run's
            assert flow_runs == [run.flow_run_id], (run.label, flow_runs)
        assert task_runs == dict.fromkeys(own, "COMPLETED"), (
            f"{run.label}'s API holds {task_runs}, ran {set(own)}"
        )


def test_four_flow_runs_with_their_own_temporary_servers_on_one_cluster_each_keep_their_task_runs(
    shared_cluster, tmp_path
):
    """Four flow scripts, each its own ``PREFECT_HOME`` (SQLite) and so its own temporary
    server, on one shared worker process at once: each database holds its flow run's
    task runs, all final, and nothing of the others'."""
    ledger = tmp_path / "ledger"
    runs = run_together(shared_cluster.address, ledger, tmp_path / "at-once", [None] * 4, timeout=240)
    assert_each_in_its_own_api(runs, ledger)


def test_busy_night_short_two_rounds_of_four_flow_runs_on_a_shared_cluster(
    shared_cluster, prefect_api, tmp_path
):
    """The busy night's short version: two rounds of four flow runs at once on one
    shared worker process, the second mixing temporary servers with a long-running
    server two of them share. No failure, no task run lost or run twice, every one
    recorded in its own flow run's API."""
    ledger = tmp_path / "ledger"
    first = run_together(shared_cluster.address, ledger, tmp_path / "round-1", [None] * 4, timeout=240)
    second = run_together(
        shared_cluster.address,
        ledger,
        tmp_path / "round-2",
        [None, prefect_api, None, prefect_api],
        timeout=240,
    )
    assert_each_in_its_own_api(first + second, ledger)
    assert len(executions(ledger)) == 8


def test_a_later_temporary_server_at_an_earlier_ones_url_gets_none_of_its_events(shared_cluster, tmp_path):
    """Flow runs one after another on a shared worker, each with its own temporary server,
    at one URL (the same port, as Prefect's random pick of 1,000 sometimes gives): the
    later server's database holds its own flow run and all its task runs, nothing of the
    earlier one's. Prefect's events client resends what a server has not checkpointed
    whenever it reconnects; the worker's events worker for that URL must not outlive the
    flow run whose server it served."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ledger = tmp_path / "ledger"
    runs = []
    for i in range(2):
        deadline = time.monotonic() + 120  # the earlier server's connections leave the port in TIME_WAIT
        while not _bindable(port) and time.monotonic() < deadline:
            time.sleep(1)
        home, label = tmp_path / f"run-{i}", f"same-url-{i}"
        run = FlowRunProcess(shared_cluster.address, ledger, home, label, None, port)
        run.wait(180)
        assert run.proc.returncode == 0, f"{run.label}:\n{run.output}"
        assert f"127.0.0.1:{port}" in run.output, run.output
        assert "task runs before stopping" not in run.output, run.output
        runs.append(run)
    assert_each_in_its_own_api(runs, ledger)


def _bindable(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
