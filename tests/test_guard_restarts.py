"""The guard and restart policies on real Dask workers, with a scripted memory probe.

The workers are real processes under real nannies; only the memory figure is scripted
(tests/scripted_probe.py), so this runs on CPU-only CI.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from distributed import Client
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterId,
)
from prefect.context import FlowRunContext

from prefect_gpu_dask import GPUDaskTaskRunner, GPUMemoryGuard, GuardSettings
from prefect_gpu_dask.guard import PLUGIN_NAME
from tests.scripted_probe import churn, fake_probe, leak

MiB = 2**20


def start_guarded_cluster(procs, settings: GuardSettings) -> str:
    procs.start_scheduler()
    procs.start_worker("gpu-worker", "--nthreads", "4", "--resources", "GPU=1")
    procs.start_worker("cpu-worker", "--nthreads", "4")
    procs.wait_for_workers(2)
    with Client(procs.address) as client:
        # Registered first, so the runner's own (identical, idempotent) registration keeps it.
        client.register_plugin(GPUMemoryGuard(settings, probe_factory=fake_probe), name=PLUGIN_NAME)
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
    settings = GuardSettings(leak_threshold="256MiB")
    address = start_guarded_cluster(dask_processes, settings)
    ledger = str(tmp_path / "ledger")

    @flow(task_runner=GPUDaskTaskRunner(address=address, leak_threshold="256MiB"))
    def nightly():
        leaked = leaky.submit(ledger, 512 * MiB)
        doubled = double.submit(ledger, leaked)  # depends on a result held by the leaking worker
        others = [clean.submit(ledger, i) for i in range(6)]
        old_pid = others[0].result()
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
            "restarts": list(runner._restarts.restarts),
        }

    out = nightly()
    assert out["doubled"] == 42 and out["after"] == 42
    assert out["new_pid"] != out["old_pid"]
    assert len(out["others"]) == 6
    ids = runs(Path(ledger))
    assert len(ids) == len(set(ids)), "a task ran twice"
    assert sum("leaky" in line for line in Path(ledger).read_text().splitlines()) == 1
    [restart] = out["restarts"]
    assert restart["reason"].startswith("leak: task left 512.00 MiB")
    assert restart["worker_name"] == "gpu-worker" and restart["new_pid"] == out["new_pid"]
    assert restart["memory_after"] == 0  # the fresh process holds nothing
    [artifact] = gpu_memory_artifact(out["flow_run_id"])
    assert '"verdict": "leak"' in artifact.data and "leaky" in artifact.data


def test_pool_churn_is_clean_and_never_restarts(dask_processes, tmp_path):
    settings = GuardSettings(leak_threshold="256MiB")
    address = start_guarded_cluster(dask_processes, settings)
    ledger = str(tmp_path / "ledger")

    @flow(task_runner=GPUDaskTaskRunner(address=address))
    def churning():
        pids = [churner.submit(ledger, 4096 * MiB).result() for _ in range(3)]
        runner = FlowRunContext.get().task_runner
        return pids, FlowRunContext.get().flow_run.id, runner

    pids, flow_run_id, runner = churning()
    assert len(set(pids)) == 1
    [artifact] = gpu_memory_artifact(flow_run_id)
    assert '"verdict": "leak"' not in artifact.data
    assert (
        artifact.data.count('"verdict": "cached"') + artifact.data.count('"verdict": "clean"') == 3
    )


@pytest.mark.parametrize("policy", ["cluster", "never"])
def test_restart_policies(dask_processes, tmp_path, policy):
    address = start_guarded_cluster(dask_processes, GuardSettings())
    ledger = str(tmp_path / "ledger")

    @flow(task_runner=GPUDaskTaskRunner(address=address, restart=policy))
    def nightly():
        with Client(address) as probe_client:
            before = {
                w["name"]: a
                for a, w in probe_client.scheduler_info(n_workers=-1)["workers"].items()
            }
        leaky.submit(ledger, 512 * MiB).result()
        deadline = time.monotonic() + (30 if policy == "cluster" else 5)
        runner = FlowRunContext.get().task_runner
        while time.monotonic() < deadline and not runner._restarts.restarts:
            clean.submit(ledger, 0).result()
            time.sleep(0.2)
        return before, list(runner._restarts.restarts)

    before, restarts = nightly()
    if policy == "never":
        assert restarts == []
    else:
        [restart] = restarts
        assert restart["policy"] == "cluster"
        with Client(address) as client:
            after = {
                w["name"]: a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()
            }
        assert set(after) == set(before)
        assert all(after[name] != before[name] for name in before), (before, after)


def test_restart_after_tasks_recycles_on_count(dask_processes, tmp_path):
    address = start_guarded_cluster(dask_processes, GuardSettings(restart_after_tasks=3))
    ledger = str(tmp_path / "ledger")

    @flow(task_runner=GPUDaskTaskRunner(address=address, restart_after_tasks=3))
    def recycled():
        pids = [clean.submit(ledger, i).result() for i in range(3)]
        new_pid = wait_for_new_pid(ledger, pids[0])
        return pids, new_pid, list(FlowRunContext.get().task_runner._restarts.restarts)

    pids, new_pid, restarts = recycled()
    assert len(set(pids)) == 1 and new_pid != pids[0]
    assert restarts[0]["reason"].startswith("recycle: 3 GPU tasks")
