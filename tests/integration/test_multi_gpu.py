"""The paths that need two real GPUs: an out-of-memory retry moving to the GPU with the
most free memory, and queued work leaving a quarantined GPU. Skipped with fewer GPUs.

A real ``LocalCUDACluster`` (one worker per GPU), NVML, CuPy and a real Prefect API. What
no test can make happen on a real GPU is laid on top and said so: another process holding
most of GPU 0's memory, and ECC errors scripted over GPU 0's real NVML health readings
(``tests.gpu_faults``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from prefect import flow, task
from prefect.context import FlowRunContext

from prefect_gpu_dask import GPUDaskTaskRunner
from tests.conftest import recorded_task_run
from tests.gpu_faults import NVML_WITH_FAULTS, make_gpu_sick
from tests.scripted_probe import HEALTH_DIR_ENV

pytestmark = pytest.mark.gpu
GiB = 2**30


def gpu_count() -> int:
    from prefect_gpu_dask.nvml import visible_gpu_count

    return visible_gpu_count()


def first_two_gpus() -> tuple[str, list[int]]:
    """The ``CUDA_VISIBLE_DEVICES`` entry of the cluster's first GPU worker, and the NVML
    indices of the first two visible GPUs (what the workers' records name)."""
    from prefect_gpu_dask import nvml

    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return first, [nvml.device_index(handle) for handle in nvml.visible_handles()[:2]]


@pytest.fixture(autouse=True)
def two_gpus():
    if gpu_count() < 2:
        pytest.skip("needs two GPUs")


def this_gpu() -> int:
    """The NVML index of the GPU this worker process computes on."""
    from prefect_gpu_dask.worker.guard import current_guard

    return current_guard().probe.gpu.index


@task(tags=["gpu"])
def holds(nbytes: int, seconds: float) -> int:
    """Allocates ``nbytes`` on this worker's GPU, holds them for ``seconds``, frees them."""
    import cupy

    block = cupy.empty(nbytes, dtype=cupy.uint8)
    block.fill(1)
    cupy.cuda.Device().synchronize()
    time.sleep(seconds)
    del block
    cupy.get_default_memory_pool().free_all_blocks()
    return this_gpu()


@task(tags=["gpu"])
def where(seconds: float) -> int:
    time.sleep(seconds)
    return this_gpu()


HOG = """
import sys, time, cupy
left, blocks = int(sys.argv[1]), []
for _ in range(3):  # memory another process is still giving back comes free meanwhile
    free, _ = cupy.cuda.runtime.memGetInfo()
    if free > left:
        blocks.append(cupy.empty(free - left, dtype=cupy.uint8))
        blocks[-1].fill(1)
        cupy.cuda.Device().synchronize()
    time.sleep(0.5)
print("held", sum(b.nbytes for b in blocks), flush=True)
sys.stdin.read()
"""


@pytest.fixture
def gpu0_nearly_full():
    """Another process holds all but 4 GiB of the first GPU for the test."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": first_two_gpus()[0]}
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG, str(4 * GiB)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = hog.stdout.readline()
        assert line.startswith("held"), f"the process meant to fill GPU 0 said {line!r}"
        yield int(line.split()[1])
    finally:
        hog.kill()
        hog.wait()


def test_an_out_of_memory_retry_moves_to_the_gpu_with_the_most_free_memory(gpu0_nearly_full):
    """Two 8 GiB tasks at once, one per GPU: GPU 0 has 4 GiB free, so the one there runs
    out of memory; its retry (the task run's own, one run count more) runs on GPU 1. GPU 0
    stays above the memory limit, by the other process's memory only: no restart."""

    @flow(task_runner=GPUDaskTaskRunner(oom_retries=1))
    def two_at_once():
        futures = [holds.submit(8 * GiB, 1.0) for _ in range(2)]
        for future in futures:
            future.wait()
        runner = FlowRunContext.get().task_runner
        return [(f.state, f.task_run_id) for f in futures], runner.records

    gpu0, gpu1 = first_two_gpus()[1]
    runs, records = two_at_once()
    print(f"GPU 0 held by another process: {gpu0_nearly_full / GiB:.1f} GiB")
    for r in records:
        print(f"record: {r.task_run_name:<14} GPU {r.gpu_index} {r.verdict:<6} asked {r.oom_requested}")
    assert all(state.is_completed() for state, _ in runs), [state.message for state, _ in runs]
    assert [state.result() for state, _ in runs] == [gpu1, gpu1]  # every attempt that ran to the end
    by_run = {
        task_run_id: [(r.gpu_index, r.verdict) for r in records if r.task_run_id == str(task_run_id)]
        for _, task_run_id in runs
    }
    moved = [attempts for attempts in by_run.values() if len(attempts) == 2]
    assert len(moved) == 1, by_run
    assert moved[0][0] == (gpu0, "oom") and moved[0][1][0] == gpu1
    [moved_id] = [task_run_id for task_run_id, attempts in by_run.items() if len(attempts) == 2]
    assert recorded_task_run(moved_id).run_count == 2
    # A restart would not give the other process's memory back: none is asked for.
    assert [r.restart_reason for r in records] == [None] * len(records)


def test_queued_work_leaves_a_gpu_quarantined_before_its_task(tmp_path, monkeypatch):
    """Both GPUs serve; then GPU 0 reads one uncorrectable ECC error. Its worker's check
    before its next task quarantines it and gives its GPU slot up: the queued tasks run on
    GPU 1, and nothing is lost."""
    health = tmp_path / "health"
    health.mkdir()
    monkeypatch.setenv(HEALTH_DIR_ENV, str(health))  # the worker processes inherit it

    @flow(task_runner=GPUDaskTaskRunner(memory_probe=NVML_WITH_FAULTS, health_check_s=3600))
    def nightly():
        before = [f.result() for f in [where.submit(0.3) for _ in range(4)]]
        make_gpu_sick(health, gpu0, ecc_volatile_uncorrectable=1)
        after = [f.result() for f in [where.submit(0.05) for _ in range(12)]]
        return before, after, FlowRunContext.get().task_runner.quarantines

    gpu0, gpu1 = first_two_gpus()[1]
    started = time.monotonic()
    before, after, quarantines = nightly()
    print("before:", before, "after:", after, f"in {time.monotonic() - started:.1f} s")
    for q in quarantines:
        print("quarantined:", q.describe(), "withdrawn", q.withdrawn)
    assert set(before) == {gpu0, gpu1}
    assert after == [gpu1] * 12
    [sick] = quarantines
    assert (sick.gpu_index, sick.withdrawn, sick.healthy_gpu_workers) == (gpu0, True, 1)
    assert sick.reasons == ("1 volatile uncorrectable ECC error",)
