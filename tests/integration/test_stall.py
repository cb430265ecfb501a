"""Stalled gpu tasks (``stall_s``): a task blocked in one call with no CPU while its GPU
does nothing is called stalled, and with ``on_stall="fail"`` ends TimedOut, once; a
Python loop making progress, or a GPU busy with a kernel, never is. Real Dask and
Prefect processes; the GPU's SM activity is scripted through a file the worker reads."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from distributed import Client
from prefect import flow, task
from prefect.context import FlowRunContext

from prefect_gpu_dask import GPUDaskTaskRunner
from prefect_gpu_dask.flow.reporting import STALLED_EVENT
from tests.scripted_probe import FAKE_PROBE, SM_FILE_ENV
from tests.ui_helpers import read_events


@pytest.fixture
def sm_file(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "sm"
    path.write_text("0")  # an idle GPU
    monkeypatch.setenv(SM_FILE_ENV, str(path))  # the worker processes inherit it
    return path


def start_gpu_worker(procs) -> str:
    procs.start_scheduler()
    procs.start_worker("gpu-worker", "--nthreads", "2", "--resources", "GPU=1")
    procs.wait_for_workers(1)
    return procs.address


@task(tags=["gpu"])
def blocked(seconds: float, ledger: str) -> int:
    with open(ledger, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    threading.Event().wait(seconds)  # one C call, no CPU: the event is never set
    return os.getpid()


@task(tags=["gpu"])
def spinning_in_python(seconds: float) -> int:
    until, n = time.monotonic() + seconds, 0
    while time.monotonic() < until:
        n += 1
    return n


def test_a_blocked_task_on_an_idle_gpu_is_stalled_and_progress_or_a_busy_gpu_is_not(
    dask_processes, sm_file, tmp_path
):
    address = start_gpu_worker(dask_processes)
    ledger = str(tmp_path / "ledger")

    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE, stall_s=1.5))
    def night() -> tuple:
        stuck = blocked.submit(4.0, ledger)
        stuck.wait()
        loop = spinning_in_python.submit(4.0)
        loop.wait()
        sm_file.write_text("85")  # a kernel keeps the GPU busy while the thread waits on it
        waiting_on_kernel = blocked.submit(4.0, ledger)
        waiting_on_kernel.wait()
        ids = [str(f.task_run_id) for f in (stuck, loop, waiting_on_kernel)]
        return [f.state for f in (stuck, loop, waiting_on_kernel)], ids, str(FlowRunContext.get().flow_run.id)

    states, ids, flow_run_id = night()
    assert all(s.is_completed() for s in states), states  # "warn" only says so
    events = read_events(
        [STALLED_EVENT], related=f"prefect.flow-run.{flow_run_id}", until=lambda evs: len(evs) >= 1
    )
    time.sleep(2)  # a second event, were there one, would have arrived
    events = read_events([STALLED_EVENT], related=f"prefect.flow-run.{flow_run_id}", until=lambda evs: True)
    assert [e.resource.id for e in events] == [f"prefect.task-run.{ids[0]}"]
    assert events[0].payload["stalled"] and 1.5 <= events[0].payload["running_s"] < 4


def test_with_on_stall_fail_a_stalled_task_ends_timed_out_once_and_its_worker_is_recycled(
    dask_processes, sm_file, tmp_path
):
    address = start_gpu_worker(dask_processes)
    ledger = tmp_path / "ledger"
    with Client(address, set_as_default=False) as client:
        [old_pid] = client.run(os.getpid).values()

    @flow(
        task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE, stall_s=1.5, on_stall="fail")
    )
    def night() -> tuple:
        started = time.monotonic()
        stuck = blocked.submit(60.0, str(ledger))
        stuck.wait()
        settled_s = time.monotonic() - started
        runner = FlowRunContext.get().task_runner
        deadline = time.monotonic() + 30
        while not runner.restarts and time.monotonic() < deadline:
            time.sleep(0.1)
        return stuck.state, settled_s, list(runner.restarts)

    state, settled_s, restarts = night()
    assert state.name == "TimedOut" and "Task run stalled" in state.message, state
    assert settled_s < 30
    assert ledger.read_text().split() == [str(old_pid)], "the stalled task ran again"
    [restart] = restarts
    assert restart.reason.startswith("hung:") and "stalled for" in restart.reason
    assert restart.new_pid != old_pid


@task(tags=["gpu"])
def kernel_spinning(seconds: float) -> float:
    """One CUDA kernel that keeps an SM busy for ``seconds``; the thread waits on it in C."""
    import cupy

    spin = cupy.RawKernel(
        r"""
        extern "C" __global__ void spin(long long cycles) {
            long long start = clock64();
            while (clock64() - start < cycles) {}
        }""",
        "spin",
    )
    khz = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["clockRate"]
    started = time.monotonic()
    spin((1,), (1,), (cupy.int64(int(seconds * khz * 1000)),))
    cupy.cuda.Device().synchronize()
    return time.monotonic() - started


@pytest.mark.gpu
def test_on_a_gpu_a_long_kernel_is_not_stalled_and_a_task_blocked_on_an_event_is(tmp_path):
    ledger = tmp_path / "ledger"

    @flow(task_runner=GPUDaskTaskRunner(stall_s=2.0, on_stall="fail"))
    def night() -> tuple:
        kernel = kernel_spinning.submit(6.0)
        kernel.wait()
        stuck = blocked.submit(60.0, str(ledger))
        stuck.wait()
        return kernel.state, kernel.result(raise_on_failure=False), stuck.state

    kernel_state, kernel_s, stuck_state = night()
    print(f"kernel: {kernel_state.name} after {kernel_s:.1f} s")
    print(f"blocked: {stuck_state.name}: {stuck_state.message}")
    assert kernel_state.is_completed() and kernel_s >= 5.5, (kernel_state, kernel_s)
    assert stuck_state.name == "TimedOut" and "Task run stalled" in stuck_state.message
    assert len(ledger.read_text().split()) == 1, "the stalled task ran again"
