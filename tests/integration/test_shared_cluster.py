"""Flow runs sharing one cluster: each keeps its own settings, and a recycle one of them
orders loses, fails or re-runs nothing of another."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from distributed import Client
from prefect import flow, task
from prefect.settings import PREFECT_API_URL

from prefect_gpu_dask import GPUDaskTaskRunner, read_flow_run_gpu_report
from prefect_gpu_dask.flow.flow_run_report import FlowRunGPUReport
from prefect_gpu_dask.records import LEAK
from tests.scripted_probe import FAKE_PROBE, leak

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


@task(tags=["gpu"])
def keep(nbytes: int) -> int:
    leak(nbytes)
    return nbytes


def keeping(address: str, threshold: str) -> FlowRunGPUReport:
    """Run a flow that keeps 512 MiB on a GPU worker; its report, read back at once."""

    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE, leak_threshold=threshold))
    def keeps() -> int:
        return keep.submit(512 * MiB).result()

    state = keeps(return_state=True)
    assert state.is_completed(), state
    return read_flow_run_gpu_report(state.state_details.flow_run_id)


def test_each_flow_run_is_judged_by_its_own_threshold(dask_processes):
    dask_processes.start_scheduler()
    dask_processes.start_worker("gpu", "--nthreads", "2", "--resources", "GPU=1")
    dask_processes.wait_for_workers(1)
    # The lenient flow reaches the cluster first: its guard plugin is the one registered.
    lenient = keeping(dask_processes.address, "2GiB")
    strict = keeping(dask_processes.address, "256MiB")
    [lenient_record] = lenient.records
    [strict_record] = strict.records
    assert lenient_record.verdict != LEAK and not lenient.restarts
    assert strict_record.verdict == LEAK, strict_record
    assert [r.outcome for r in strict.restarts] == ["replaced"]


def test_a_recycle_another_flow_run_orders_runs_nothing_of_this_one_twice(dask_processes, tmp_path):
    dask_processes.start_scheduler()
    for name in ("gpu-0", "gpu-1"):
        dask_processes.start_worker(name, "--nthreads", "2", "--resources", "GPU=1")
    dask_processes.wait_for_workers(2)
    ledger = tmp_path / "ledger"
    env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    other = subprocess.Popen(
        [sys.executable, "-m", "tests.shared_cluster_flows", dask_processes.address, str(ledger), "40"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    restarts = []
    while other.poll() is None:  # leak (and recycle) while the other flow run works
        restarts += keeping(dask_processes.address, "256MiB").restarts
    out = other.communicate(timeout=120)[0]
    assert other.returncode == 0, out
    runs = Counter(line.split()[0] for line in ledger.read_text().splitlines())
    assert len(runs) == 40 and set(runs.values()) == {1}, [k for k, v in runs.items() if v > 1]
    assert restarts and all(r.outcome == "replaced" for r in restarts), restarts


def test_flow_runs_leave_no_event_subscriptions_on_a_long_lived_scheduler(dask_processes):
    """A scheduler keeps a client's event subscriptions after the client has gone: each
    flow run's runner takes its own off (its records, its hung tasks, its sick GPUs)."""
    dask_processes.start_scheduler()
    dask_processes.start_worker("gpu", "--nthreads", "2", "--resources", "GPU=1")
    dask_processes.wait_for_workers(1)

    def subscribed(dask_scheduler=None) -> dict[str, int]:
        topics = dask_scheduler._broker._topics.items()
        return {name: len(topic.subscribers) for name, topic in topics if name.startswith("prefect-gpu-dask")}

    with Client(dask_processes.address, set_as_default=False) as monitor:
        keeping(dask_processes.address, "256MiB")  # a leak, a recycle
        keeping(dask_processes.address, "2GiB")
        assert set(monitor.run_on_scheduler(subscribed).values()) == {0}, monitor.run_on_scheduler(subscribed)
