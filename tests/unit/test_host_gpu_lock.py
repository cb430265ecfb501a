"""The host-wide GPU claim, across real processes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from prefect_gpu_dask.private_dir import DIRECTORY_ENV, SharedDirectoryError, private_directory
from prefect_gpu_dask.worker.host_gpu_lock import LINGER_S, HostGPUClaim

UUID = "GPU-test-0000"


def _hold(directory: str, seconds: float, ready, cluster: str = "tcp://127.0.0.1:1") -> None:
    claim = HostGPUClaim(UUID, cluster, directory=Path(directory))
    with claim.hold():
        ready.set()
        time.sleep(seconds)


def _spawn_holder(tmp_path, seconds: float, cluster: str = "tcp://127.0.0.1:1"):
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_hold, args=(str(tmp_path), seconds, ready, cluster))
    proc.start()
    assert ready.wait(60), "the holder never took the claim"
    return proc


def test_another_cluster_waits_for_the_gpu_and_threads_of_one_process_share_it(tmp_path):
    holder = _spawn_holder(tmp_path, 1.0)
    claim = HostGPUClaim(UUID, "tcp://127.0.0.1:2", directory=tmp_path)
    assert claim.in_use_elsewhere()
    waits: list[float] = []
    together = threading.Barrier(3, timeout=30)  # passed only if all three hold the turn at once

    def run() -> None:
        with claim.hold() as waited:
            waits.append(waited)
            together.wait()

    threads = [threading.Thread(target=run) for _ in range(3)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    holder.join(30)
    assert time.monotonic() - started >= 0.5  # they waited for the other process
    assert max(waits) >= 0.5 and len(waits) == 3  # ...and then held it together
    assert not together.broken
    assert not claim.in_use_elsewhere()


def test_processes_of_one_cluster_share_its_turn(tmp_path):
    holder = _spawn_holder(tmp_path, 30)
    try:
        same = HostGPUClaim(UUID, "tcp://127.0.0.1:1", directory=tmp_path)
        with same.hold() as waited:
            assert waited < 1
    finally:
        holder.kill()
        holder.join(30)


def test_a_killed_holder_leaves_no_stuck_claim(tmp_path):
    holder = _spawn_holder(tmp_path, 60)
    claim = HostGPUClaim(UUID, "tcp://127.0.0.1:2", directory=tmp_path)
    assert claim.in_use_elsewhere()
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(30)
    with claim.hold() as waited:
        assert waited < 5


def test_the_gate_lingers_between_task_runs_then_drops(tmp_path):
    mine = HostGPUClaim(UUID, "tcp://127.0.0.1:1", directory=tmp_path)
    other = HostGPUClaim(UUID, "tcp://127.0.0.1:2", directory=tmp_path)
    with mine.hold():
        pass
    mutex_before = mine.mutex.stat().st_mtime_ns
    with mine.hold() as waited:  # the next run on the slot: no second entry
        assert waited == 0.0
    assert other.in_use_elsewhere()  # still held, lingering
    time.sleep(LINGER_S + 0.2)
    assert not other.in_use_elsewhere()
    assert mine.mutex.stat().st_mtime_ns == mutex_before


def test_a_cluster_running_task_after_task_lets_a_waiting_one_in(tmp_path):
    """One cluster runs short gpu task runs back to back, each next one within the gate's
    linger; another cluster asking for the GPU gets it between two of them."""
    busy = HostGPUClaim(UUID, "tcp://127.0.0.1:1", directory=tmp_path)
    waiter = HostGPUClaim(UUID, "tcp://127.0.0.1:2", directory=tmp_path)
    stop = threading.Event()
    overlapped: list[bool] = []
    holding = threading.Event()

    def back_to_back() -> None:
        while not stop.is_set():
            with busy.hold():
                overlapped.append(holding.is_set())
                time.sleep(0.01)
            time.sleep(0.002)

    runner = threading.Thread(target=back_to_back)
    runner.start()
    try:
        time.sleep(0.1)
        asked = time.monotonic()
        with waiter.hold():
            holding.set()
            waited = time.monotonic() - asked
            time.sleep(0.05)
            holding.clear()
    finally:
        stop.set()
        runner.join(30)
    assert waited < 1.0, f"the waiting cluster waited {waited:.2f} s"
    assert not any(overlapped), "both clusters held the GPU at once"


def test_a_directory_others_can_use_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv(DIRECTORY_ENV, str(shared))
    with pytest.raises(SharedDirectoryError, match="mode 0700"):
        private_directory()
    if os.getuid() == 0:  # only root can hand a directory to another user
        shared.chmod(0o700)
        os.chown(shared, 12345, -1)
        with pytest.raises(SharedDirectoryError, match="uid 12345"):
            private_directory()


def test_a_new_directory_is_private(tmp_path, monkeypatch):
    monkeypatch.setenv(DIRECTORY_ENV, str(tmp_path / "mine"))
    path = private_directory()
    assert path.stat().st_mode & 0o777 == 0o700
    with pytest.raises(ValueError, match="cannot name a lock file"):
        HostGPUClaim("../x", "tcp://127.0.0.1:1", directory=path)
