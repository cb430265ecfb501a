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
from prefect_gpu_dask.worker import host_gpu_lock
from prefect_gpu_dask.worker.host_gpu_lock import HostGPUClaim

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


def test_the_gate_lingers_between_task_runs_then_drops(tmp_path, monkeypatch):
    monkeypatch.setattr(host_gpu_lock, "LINGER_S", 1.0)  # wide enough for a busy machine
    mine = HostGPUClaim(UUID, "tcp://127.0.0.1:1", directory=tmp_path)
    other = HostGPUClaim(UUID, "tcp://127.0.0.1:2", directory=tmp_path)
    entries: list[int] = []
    enter = mine._enter
    monkeypatch.setattr(mine, "_enter", lambda fd: entries.append(fd) or enter(fd))
    with mine.hold():
        pass
    with mine.hold() as waited:  # the next run on the slot: no second entry
        assert waited == 0.0
    assert len(entries) == 1
    assert other.in_use_elsewhere()  # still held, lingering
    deadline = time.monotonic() + 30
    while other.in_use_elsewhere():  # ...then dropped
        assert time.monotonic() < deadline, "the lingering turn was never given back"
        time.sleep(0.1)


def test_a_cluster_running_task_after_task_lets_a_waiting_one_in(tmp_path):
    """One cluster runs short gpu task runs back to back, each next one within the gate's
    linger; another cluster asking for the GPU gets it between two of them."""
    busy = HostGPUClaim(UUID, "tcp://127.0.0.1:1", directory=tmp_path)
    waiter = HostGPUClaim(UUID, "tcp://127.0.0.1:2", directory=tmp_path)
    stop = threading.Event()
    overlapped: list[bool] = []
    holding = threading.Event()
    got_in = threading.Event()

    def back_to_back() -> None:
        while not stop.is_set():
            with busy.hold():
                overlapped.append(holding.is_set())
                time.sleep(0.01)
            time.sleep(0.002)

    def wait_for_the_gpu() -> None:
        with waiter.hold():
            holding.set()
            got_in.set()
            time.sleep(0.05)
            holding.clear()

    runner = threading.Thread(target=back_to_back, daemon=True)
    runner.start()
    time.sleep(0.1)
    asked = time.monotonic()
    threading.Thread(target=wait_for_the_gpu, daemon=True).start()
    try:
        assert got_in.wait(10), "the waiting cluster never got the GPU"
        waited = time.monotonic() - asked
    finally:
        stop.set()
        runner.join(30)
    assert waited < 2.0, f"the waiting cluster waited {waited:.2f} s"
    assert not any(overlapped), "both clusters held the GPU at once"


def test_a_waiter_that_gave_up_does_not_hold_the_gpu_back(tmp_path):
    """A cluster that asked to wait and then stopped asking (its run cancelled) leaves
    the GPU to the cluster that had it, without the 2 s a dead waiter's entry lasts."""
    mine = HostGPUClaim(UUID, "tcp://127.0.0.1:1", directory=tmp_path)
    gone = HostGPUClaim(UUID, "tcp://127.0.0.1:2", directory=tmp_path)
    with mine.hold():
        fd = os.open(gone.gate, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            assert not gone._enter(fd)  # registered as waiting, then never asks again
        finally:
            os.close(fd)
    time.sleep(host_gpu_lock.WAITER_LIVE_S + host_gpu_lock.POLL_S)
    with mine.hold() as waited:
        assert waited < 1.0


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
