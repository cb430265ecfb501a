"""Flow runs sharing one cluster: each keeps its own settings, and a recycle one of them
orders loses, fails or re-runs nothing of another."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from uuid import uuid4

from distributed import Client
from prefect import flow, task
from prefect.context import FlowRunContext
from prefect.settings import PREFECT_API_URL

from prefect_gpu_dask import GPUDaskTaskRunner, read_flow_run_gpu_report
from prefect_gpu_dask.flow.flow_run_report import FlowRunGPUReport
from prefect_gpu_dask.records import HUNG_TOPIC, LEAK, HungTask
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


@task(tags=["gpu"], timeout_seconds=2)
def hangs_on_the_gpu(started: str) -> str:
    Path(started).write_text(str(time.time()))
    time.sleep(40)  # outside Python bytecode: only the end of its process frees the thread
    return "finished"


@task(tags=["gpu"])
def worker_pid() -> int:
    return os.getpid()


def test_a_hung_task_on_the_only_worker_holds_another_flow_run_only_until_the_restart(
    dask_processes, tmp_path
):
    """A hung task keeps the only GPU worker's one slot until its process ends, and the
    restart waits for a result another flow run holds there: that flow run takes it into
    its flow when asked, the restart goes on, and its next task runs on the replacement,
    long before the hung task would have returned. Nothing runs twice."""
    dask_processes.start_scheduler()
    dask_processes.start_worker("gpu", "--nthreads", "2", "--resources", "GPU=1")
    dask_processes.wait_for_workers(1)
    ledger, started = tmp_path / "ledger", tmp_path / "hang-started"
    env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    other = subprocess.Popen(
        [sys.executable, "-m", "tests.shared_cluster_flows", dask_processes.address, str(ledger)]
        + ["--across-a-hang", str(started)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    @flow(task_runner=GPUDaskTaskRunner(address=dask_processes.address, memory_probe=FAKE_PROBE))
    def hangs() -> tuple:
        stuck = hangs_on_the_gpu.submit(str(started))
        stuck.wait(timeout=60)
        after = worker_pid.submit().result()  # on the replacement
        return stuck.state, after, FlowRunContext.get().task_runner.restarts

    try:
        deadline = time.monotonic() + 120
        while not ledger.exists() or not ledger.read_text():  # its first task ran: it holds the result
            assert other.poll() is None and time.monotonic() < deadline, other.communicate()[0]
            time.sleep(0.05)
        state, after_pid, restarts = hangs()
        out = other.communicate(timeout=120)[0]
    finally:
        other.kill()
    assert other.returncode == 0, out
    hung_at = float(started.read_text())
    ended_at = float(out.split("ended at ")[-1].split()[0])
    print(f"the other flow run ended {ended_at - hung_at:.1f} s after the hang (the hung task sleeps 40 s)")
    assert state.name == "TimedOut", state
    assert "Took 1 result(s) of this flow run off" in out, out
    assert ended_at - hung_at < 30, f"the other flow run ended {ended_at - hung_at:.1f} s after the hang"
    runs = [line.split() for line in ledger.read_text().splitlines()]
    assert sorted(i for _, i, _ in runs) == ["0", "1"], runs  # each once
    [(_, _, first_pid), (_, _, later_pid)] = sorted(runs, key=lambda run: run[1])
    assert later_pid != first_pid and str(after_pid) == later_pid, (runs, after_pid)
    assert [r.outcome for r in restarts] == ["replaced"], restarts


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


def test_another_flow_runs_hung_task_heard_before_this_ones_first_task_is_left_alone(dask_processes):
    """A runner hears every hung-task event on a shared cluster from the moment its client
    joins. One naming another flow run, heard before this run submitted anything, is
    that run's to end: this runner neither marks it nor restarts its worker."""
    dask_processes.start_scheduler()
    dask_processes.start_worker("gpu", "--nthreads", "2", "--resources", "GPU=1")
    dask_processes.wait_for_workers(1)

    @flow(task_runner=GPUDaskTaskRunner(address=dask_processes.address, memory_probe=FAKE_PROBE))
    def joins_then_hears() -> tuple:
        runner = FlowRunContext.get().task_runner
        client = runner.client  # joined and subscribed; nothing submitted yet
        [(worker, pid)] = client.run(os.getpid).items()
        hung = HungTask(
            task_run_id=str(uuid4()),
            task_run_name="elsewhere",
            flow_run_id=str(uuid4()),
            key="elsewhere-key",
            worker=worker,
            worker_name="gpu",
            pid=pid,
            timeout_s=1.0,
            running_s=2.0,
        )
        with Client(dask_processes.address, set_as_default=False) as other:
            other.log_event(HUNG_TOPIC, hung.to_event())
        time.sleep(4.0)  # a restart it started would be done by now
        return runner.restarts, pid, list(client.run(os.getpid).values())

    restarts, pid, pids_after = joins_then_hears()
    assert restarts == ()
    assert pids_after == [pid]
