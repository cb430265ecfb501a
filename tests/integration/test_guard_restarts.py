"""The guard and restart policies on real Dask workers, with a scripted memory probe.

The workers are real processes under real nannies; only the memory figure is scripted
(tests/scripted_probe.py), so this runs on CPU-only CI.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
from distributed import Client, LocalCluster
from prefect import flow, tags, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterId,
)
from prefect.context import FlowRunContext

from prefect_gpu_dask import GPUDaskTaskRunner
from prefect_gpu_dask.worker.recycling import drain
from tests.conftest import recorded_task_run
from tests.scripted_probe import FAKE_PROBE, churn, leak, native, native_once

MiB = 2**20


def start_guarded_cluster(procs) -> str:
    procs.start_scheduler()
    procs.start_worker("gpu-worker", "--nthreads", "4", "--resources", "GPU=1")
    procs.start_worker("cpu-worker", "--nthreads", "4")
    procs.wait_for_workers(2)
    return procs.address


def note_run(ledger: str, label: str) -> int:
    from prefect.runtime import task_run

    with open(ledger, "a") as fh:
        fh.write(f"{task_run.id} {label} {os.getpid()}\n")
    return os.getpid()


@task(tags=["gpu"])
def leaky(ledger: str, nbytes: int) -> int:
    note_run(ledger, "leaky")
    leak(nbytes)
    return 21


@task(tags=["gpu"])
def clean(ledger: str, i: int) -> int:
    return note_run(ledger, f"clean-{i}")


@task(tags=["gpu"])
def churner(ledger: str, nbytes: int) -> int:
    churn(nbytes)
    return note_run(ledger, "churn")


@task
def double(ledger: str, x: int) -> int:
    note_run(ledger, "double")
    time.sleep(0.5)  # still running when the leak verdict arrives
    return 2 * x


@task(tags=["gpu"])
def gpu_double(ledger: str, x: int) -> tuple[int, int]:
    return 2 * x, note_run(ledger, "gpu_double")


def runs(ledger: Path) -> list[str]:
    return [line.split()[0] for line in ledger.read_text().splitlines()]


def gpu_memory_artifact(flow_run_id) -> list:
    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["gpu-memory"])),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
        )


def wait_for_new_pid(ledger: str, old_pid: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    i = 0
    while time.monotonic() < deadline:
        i += 1
        pid = clean.submit(ledger, 100 + i).result()
        if pid != old_pid:
            return pid
        time.sleep(0.2)
    raise AssertionError("the leaking worker was never restarted")


def test_leak_restarts_only_that_worker_and_loses_nothing(dask_processes, tmp_path):
    address = start_guarded_cluster(dask_processes)
    ledger = str(tmp_path / "ledger")

    @flow(task_runner=GPUDaskTaskRunner(address=address, leak_threshold="256MiB", memory_probe=FAKE_PROBE))
    def nightly():
        old_pid = clean.submit(ledger, -1).result()
        leaked = leaky.submit(ledger, 512 * MiB)
        doubled = double.submit(ledger, leaked)  # depends on a result held by the leaking worker
        others = [clean.submit(ledger, i) for i in range(6)]
        new_pid = wait_for_new_pid(ledger, old_pid)
        after = double.submit(ledger, leaked)  # submitted after the restart: must not rerun leaky
        runner = FlowRunContext.get().task_runner
        return {
            "doubled": doubled.result(),
            "after": after.result(),
            "others": [f.result() for f in others],
            "old_pid": old_pid,
            "new_pid": new_pid,
            "flow_run_id": FlowRunContext.get().flow_run.id,
            "restarts": list(runner.restarts),
        }

    out = nightly()
    assert out["doubled"] == 42 and out["after"] == 42
    assert out["new_pid"] != out["old_pid"]
    assert len(out["others"]) == 6
    ids = runs(Path(ledger))
    assert len(ids) == len(set(ids)), "a task ran twice"
    assert sum("leaky" in line for line in Path(ledger).read_text().splitlines()) == 1
    [restart] = out["restarts"]
    assert restart.reason.startswith("leak: task left 512.00 MiB")
    assert restart.worker_name == "gpu-worker" and restart.new_pid == out["new_pid"]
    assert restart.memory_after == 0  # the fresh process holds nothing
    [artifact] = gpu_memory_artifact(out["flow_run_id"])
    assert '"verdict": "leak"' in artifact.data and "leaky" in artifact.data


def test_pool_churn_is_clean_and_never_restarts(dask_processes, tmp_path):
    address = start_guarded_cluster(dask_processes)
    ledger = str(tmp_path / "ledger")

    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE))
    def churning():
        pids = [churner.submit(ledger, 4096 * MiB).result() for _ in range(3)]
        runner = FlowRunContext.get().task_runner
        return pids, FlowRunContext.get().flow_run.id, runner

    pids, flow_run_id, runner = churning()
    assert len(set(pids)) == 1
    [artifact] = gpu_memory_artifact(flow_run_id)
    assert '"verdict": "leak"' not in artifact.data
    assert artifact.data.count('"verdict": "cached"') + artifact.data.count('"verdict": "clean"') == 3


@task(tags=["gpu"])
def first_use(ledger: str, i: int) -> int:
    native_once("solver", 512 * MiB)  # like cuSOLVER's handles: once per process
    return note_run(ledger, f"first-use-{i}")


@task(tags=["gpu"])
def native_leak(ledger: str) -> int:
    native(512 * MiB)  # outside any allocator, every time
    return note_run(ledger, "native-leak")


def test_one_time_library_growth_is_never_a_leak_but_recurring_growth_is(dask_processes, tmp_path):
    address = start_guarded_cluster(dask_processes)
    ledger = str(tmp_path / "ledger")

    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE))
    def first_uses():
        pids = [first_use.submit(ledger, i).result() for i in range(10)]
        runner = FlowRunContext.get().task_runner
        records = runner.records
        return pids, records, runner.restarts

    pids, records, restarts = first_uses()
    assert len(set(pids)) == 1 and restarts == ()
    verdicts = [r.verdict for r in sorted(records, key=lambda r: r.time)]
    assert verdicts == ["library"] + ["clean"] * 9, verdicts
    first = min(records, key=lambda r: r.time)
    assert first.delta == 512 * MiB and first.allocator_delta == 0 and first.restart_reason is None

    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE))
    def recurring():
        # One worker thread, so the task's second run is on the thread of its first.
        runner = FlowRunContext.get().task_runner
        for _ in range(2):
            native_leak.submit(ledger).result()
        deadline = time.monotonic() + 20
        while not runner.restarts and time.monotonic() < deadline:
            time.sleep(0.05)
        records = sorted(runner.records, key=lambda r: r.time)
        verdicts = [r.verdict for r in records if r.task_name == "native_leak"]
        return verdicts, runner.restarts

    dask_processes.start_worker("gpu-1-thread", "--nthreads", "1", "--resources", "GPU=2")
    dask_processes.wait_for_workers(3)
    with tags("gpu:2"):
        verdicts, restarts = recurring()
    assert verdicts == ["library", "leak"], verdicts
    [restart] = restarts
    assert restart.reason.startswith("leak: task left 512.00 MiB") and restart.worker_name == "gpu-1-thread"


@pytest.mark.parametrize("policy", ["cluster", "never"])
def test_restart_policies(dask_processes, tmp_path, policy):
    address = start_guarded_cluster(dask_processes)
    ledger = str(tmp_path / "ledger")

    @flow(task_runner=GPUDaskTaskRunner(address=address, restart=policy, memory_probe=FAKE_PROBE))
    def nightly():
        with Client(address) as probe_client:
            before = {w["name"]: a for a, w in probe_client.scheduler_info(n_workers=-1)["workers"].items()}
        leaky.submit(ledger, 512 * MiB).result()
        runner = FlowRunContext.get().task_runner
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(r.verdict == "leak" for r in runner.records):
            time.sleep(0.05)
        # The verdict is in: a restart, were one asked for, would take its worker off
        # the scheduler within moments (and "cluster" finishes within 30 s).
        deadline = time.monotonic() + (30 if policy == "cluster" else 2)
        while time.monotonic() < deadline and not runner.restarts:
            clean.submit(ledger, 0).result()
            time.sleep(0.2)
        with Client(address) as probe_client:
            now = {w["name"]: a for a, w in probe_client.scheduler_info(n_workers=-1)["workers"].items()}
        return before, now, [r.verdict for r in runner.records], list(runner.restarts)

    before, now, verdicts, restarts = nightly()
    assert "leak" in verdicts
    if policy == "never":
        assert restarts == [] and now == before, (restarts, before, now)
    else:
        [restart] = restarts
        assert restart.policy == "cluster"
        with Client(address) as client:
            after = {w["name"]: a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        assert set(after) == set(before)
        assert all(after[name] != before[name] for name in before), (before, after)


def test_restart_after_tasks_recycles_on_count(dask_processes, tmp_path):
    address = start_guarded_cluster(dask_processes)
    ledger = str(tmp_path / "ledger")

    @flow(task_runner=GPUDaskTaskRunner(address=address, restart_after_tasks=3, memory_probe=FAKE_PROBE))
    def recycled():
        pids = [clean.submit(ledger, i).result() for i in range(3)]
        new_pid = wait_for_new_pid(ledger, pids[0])
        return pids, new_pid, list(FlowRunContext.get().task_runner.restarts)

    pids, new_pid, restarts = recycled()
    assert len(set(pids)) == 1 and new_pid != pids[0]
    assert restarts[0].reason.startswith("recycle: 3 GPU tasks")


def test_no_task_starts_on_a_leaking_worker_after_its_verdict(dask_processes, tmp_path):
    """The only GPU worker leaks while 12 GPU tasks wait for its slot: none of them
    starts in the leaking process; all run once, in the replacement, which comes at
    once instead of after the queue has drained."""
    address = start_guarded_cluster(dask_processes)
    ledger = str(tmp_path / "ledger")

    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE))
    def queued_behind_a_leak():
        old_pid = clean.submit(ledger, -1).result()
        leaked = leaky.submit(ledger, 512 * MiB)
        queued = [clean.submit(ledger, i) for i in range(12)]  # GPU=1 each: they queue
        return old_pid, leaked.result(), [f.result() for f in queued], runner_restarts()

    old_pid, leaked, pids, restarts = queued_behind_a_leak()
    assert leaked == 21
    [restart] = restarts
    assert set(pids) == {restart.new_pid} and old_pid not in pids, (old_pid, pids, restart)
    ids = runs(Path(ledger))
    assert len(ids) == len(set(ids)) == 14, "a task ran twice or went missing"


def test_a_drained_worker_still_runs_what_only_it_can(dask_processes, tmp_path):
    """A GPU task needs the leaking task's result and only the leaking worker has a
    GPU: it runs there (the drain steps aside for it), then the worker restarts."""
    address = start_guarded_cluster(dask_processes)
    ledger = str(tmp_path / "ledger")

    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE))
    def dependent_on_the_leak():
        leaked = leaky.submit(ledger, 512 * MiB)
        doubled = gpu_double.submit(ledger, leaked)  # depends on a result only that worker holds
        return doubled.result(), runner_restarts(wait=True)

    (value, pid), restarts = dependent_on_the_leak()
    assert value == 42
    [restart] = restarts
    assert pid == restart.old_pid != restart.new_pid  # ran in the leaking process, before it went
    assert Path(ledger).read_text().count("leaky") == 1


def test_drain_stops_new_tasks_and_expires():
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            [report] = client.run(drain, expiry_s=1.0).values()
            assert report == {"running": 0, "not_started": []}
            statuses = [w["status"] for w in client.scheduler_info()["workers"].values()]
            assert statuses == ["closing_gracefully"]
            future = client.submit(sum, [1, 2])
            time.sleep(0.5)
            assert not future.done(), "a drained worker started a task"
            assert future.result(timeout=10) == 3  # the drain expired: nobody restarted it


def runner_restarts(wait: bool = True, timeout: float = 60) -> list:
    runner = FlowRunContext.get().task_runner
    deadline = time.monotonic() + timeout
    while wait and not runner.restarts and time.monotonic() < deadline:
        time.sleep(0.05)
    return list(runner.restarts)


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_recycle_cut_short_by_the_flow_ending_is_one_info_line(tmp_path):
    """The flow ends while its local cluster is recycling a leaking worker: no ERROR,
    no traceback; at most one INFO line saying what was not recycled."""
    ledger = str(tmp_path / "ledger")
    handler = Collect()
    watched = [logging.getLogger("prefect"), logging.getLogger("prefect_gpu_dask")]
    for logger in watched:
        logger.addHandler(handler)

    @flow(
        task_runner=GPUDaskTaskRunner(
            cluster_class="distributed.LocalCluster",
            cluster_kwargs={"n_workers": 1, "threads_per_worker": 2, "resources": {"GPU": 1}},
            memory_probe=FAKE_PROBE,
        )
    )
    def ends_mid_recycle() -> int:
        value = leaky.submit(ledger, 512 * MiB).result()
        time.sleep(0.5)  # the verdict reaches the flow; the recycle starts
        return value

    try:
        assert ends_mid_recycle() == 21
    finally:
        for logger in watched:
            logger.removeHandler(handler)
    errors = [r for r in handler.records if r.levelno >= logging.ERROR or r.exc_info]
    assert errors == [], [r.getMessage() for r in errors]
    skipped = [r for r in handler.records if "Not recycling" in r.getMessage()]
    assert len(skipped) <= 1 and all(r.levelno == logging.INFO for r in skipped)


def test_each_record_reaches_the_ui_while_the_flow_still_runs(dask_processes, tmp_path):
    from prefect.client.schemas.filters import ArtifactFilterTaskRunId

    address = start_guarded_cluster(dask_processes)
    ledger = str(tmp_path / "ledger")

    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE))
    def long_night():
        busy = half_gpu_busy.submit(0.8)
        leaked = leaky.submit(ledger, 512 * MiB)
        leaked.result()
        busy.wait()
        artifacts = {}
        deadline = time.monotonic() + 30
        with get_client(sync_client=True) as client:
            while time.monotonic() < deadline and len(artifacts) < 2:  # the flow still runs
                for future in (leaked, busy):
                    found = client.read_artifacts(
                        artifact_filter=ArtifactFilter(
                            task_run_id=ArtifactFilterTaskRunId(any_=[future.task_run_id])
                        )
                    )
                    if found:
                        artifacts[future] = found
                time.sleep(0.2)
        return artifacts.get(leaked, []), artifacts.get(busy, [])

    (leak_artifact,), (busy_artifact,) = long_night()
    assert leak_artifact.type == "table"
    [row] = json.loads(leak_artifact.data) if isinstance(leak_artifact.data, str) else leak_artifact.data
    assert row["verdict"] == "leak" and row["delta_bytes"] == 512 * MiB and row["delta"] == "512.00 MiB"
    # What else the task did on its GPU (tests/scripted_probe.py: 200 W, 37 % busy, 61 C).
    [row] = json.loads(busy_artifact.data) if isinstance(busy_artifact.data, str) else busy_artifact.data
    assert row["energy_j"] == pytest.approx(200 * row["duration_s"], rel=0.05), row
    assert (row["sm_util_mean"], row["sm_util_peak"], row["util_scope"]) == (37, 37, "process"), row
    assert row["temperature_peak_c"] == 61 and row["throttle_reasons"] == ["sw_power_cap"], row
    assert row["gpu_share"] == 0.5, row
    assert row["gpu_seconds"] == pytest.approx(0.5 * row["duration_s"], abs=1e-5), row


@task(tags=["gpu:0.5"])
def half_gpu_busy(seconds: float) -> None:
    time.sleep(seconds)


@task(tags=["gpu"])
def holds_then_runs_out(ledger: str, nbytes: int) -> str:
    import distributed

    name = str(distributed.get_worker().name)
    with open(ledger, "a") as fh:
        fh.write(f"{name} {os.getpid()}\n")
    if len(Path(ledger).read_text().splitlines()) == 1:
        leak(nbytes)  # still held after the failure: this GPU's memory does not come back
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")  # as torch says it
    return name


def test_an_oom_retry_runs_on_another_gpu_when_its_own_memory_did_not_come_back(dask_processes, tmp_path):
    """The retry is the task run's own (one task run, run count 2), its function runs on
    the other GPU worker under that worker's guard, and only the worker that ran out
    is restarted, once the task run is over."""
    dask_processes.start_scheduler()
    for name in ("gpu-a", "gpu-b"):
        dask_processes.start_worker(name, "--nthreads", "2", "--resources", "GPU=1")
    dask_processes.wait_for_workers(2)
    ledger = str(tmp_path / "ledger")

    @flow(
        task_runner=GPUDaskTaskRunner(address=dask_processes.address, memory_probe=FAKE_PROBE, oom_retries=1)
    )
    def retried_elsewhere():
        moved = holds_then_runs_out.submit(ledger, 4 * 2**30)
        ran_on = moved.result()
        runner = FlowRunContext.get().task_runner
        restarts = runner_restarts(wait=True)
        return (
            ran_on,
            moved.task_run_id,
            [r for r in runner.records if r.task_run_id == str(moved.task_run_id)],
            restarts,
        )

    ran_on, task_run_id, records, restarts = retried_elsewhere()
    first, second = [line.split()[0] for line in Path(ledger).read_text().splitlines()]
    assert first != second and ran_on == second
    run = recorded_task_run(task_run_id)
    with get_client(sync_client=True) as api:
        names = [s.name for s in api.read_task_run_states(task_run_id)]
    assert run.run_count == 2 and run.state.is_completed(), (run.run_count, names)
    assert "Retrying" in names or "AwaitingRetry" in names, names
    assert [(r.worker_name, r.verdict) for r in records] == [(first, "oom"), (second, "clean")], records
    [restart] = restarts
    assert restart.worker_name == first and restart.reason.startswith("oom"), restart
