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
from prefect_gpu_dask.worker.host_gpu_lock import HandoverWait, HostGPUClaim, MemoryHandover

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


# -- the hand-over: the memory goes with the turn ------------------------------------

GiB = 2**30
OWN = 100  # the taker's PID in scripted process lists


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def scripted_handover(*lists: dict[int, int], **kwargs) -> tuple[MemoryHandover, FakeClock, list[int]]:
    """A hand-over reading ``lists`` in order (the last repeats), on a fake clock."""
    clock, reads = FakeClock(), []

    def read() -> dict[int, int]:
        reads.append(1)
        return lists[min(len(reads) - 1, len(lists) - 1)]

    handover = MemoryHandover(
        read, own_pid=OWN, allowance=GiB, poll_s=0.1, clock=clock, sleep=clock.sleep, **kwargs
    )
    return handover, clock, reads


def test_a_gpu_nobody_else_fills_is_taken_at_once():
    # this process's own memory, contexts within the allowance, unattributed memory: no wait
    handover, _, reads = scripted_handover({OWN: 60 * GiB, 7: GiB // 2, 8: GiB, 9: -1})
    assert handover.wait() == HandoverWait(0.0, 0, 0, "free")
    assert len(reads) == 1


def test_the_taker_waits_until_another_process_gives_its_memory_back():
    filled = {OWN: GiB // 2, 7: 49 * GiB}
    handover, clock, reads = scripted_handover(filled, filled, {OWN: GiB // 2, 7: GiB // 2})
    wait = handover.wait()
    assert wait.outcome == "free" and wait.left == 0 and wait.pids == ()
    assert wait.held == 48 * GiB  # beyond the allowance
    assert wait.waited_s == pytest.approx(0.2) and len(reads) == 3


def test_memory_that_stops_coming_back_is_waited_for_briefly_and_once():
    steady = {OWN: 0, 7: 20 * GiB}
    handover, clock, _ = scripted_handover(steady, steady_s=1.0, timeout_s=30)
    wait = handover.wait()
    assert wait.outcome == "steady" and wait.pids == (7,) and wait.left == 19 * GiB
    assert 1.0 <= wait.waited_s <= 1.2
    # next hand-over: the same memory is not waited for again...
    assert handover.wait() == HandoverWait(0.0, 0, 0, "free")
    # ...unless that process grows past it
    assert handover.filling({OWN: 0, 7: 30 * GiB}) == {7: 29 * GiB}


def test_memory_still_falling_is_waited_for_up_to_the_bound():
    falling = [{7: (80 - i) * GiB} for i in range(1000)]
    handover, _, _ = scripted_handover(*falling, steady_s=1.0, timeout_s=5.0)
    wait = handover.wait()
    assert wait.outcome == "timeout" and 5.0 <= wait.waited_s <= 5.2
    assert wait.left < wait.held


def test_a_probe_that_fails_never_fails_the_task(caplog):
    def broken() -> dict[int, int]:
        raise OSError("NVML went away")

    wait = MemoryHandover(broken, own_pid=OWN).wait()
    assert wait.outcome == "unread" and wait.waited_s == 0.0
    assert "Could not list the processes on the GPU" in caplog.text


class PooledProcess:
    """A worker process of another cluster on a scripted GPU: a finished task's memory
    stays in its pool until it flushes."""

    PID = 7

    def __init__(self, pooled: int, frees: bool = True):
        self.pooled = pooled
        self.frees = frees
        self.flushed_at: float | None = None

    def flush(self) -> None:
        self.flushed_at = time.monotonic()
        if self.frees:
            self.pooled = 0

    def process_memories(self) -> dict[int, int]:
        return {self.PID: GiB // 2 + self.pooled}


def _take_turn(claim: HostGPUClaim, got: list) -> None:
    with claim.hold() as waited:
        got.append((time.monotonic(), waited))


def test_the_giver_flushes_its_pools_before_the_taker_enters(tmp_path):
    giver_process = PooledProcess(pooled=48 * GiB)
    giver = HostGPUClaim(UUID, "tcp://127.0.0.1:1", directory=tmp_path, flush=giver_process.flush)
    handover = MemoryHandover(giver_process.process_memories, own_pid=OWN)
    taker = HostGPUClaim(UUID, "tcp://127.0.0.1:2", directory=tmp_path, handover=handover)
    got: list = []
    with giver.hold():
        thread = threading.Thread(target=_take_turn, args=(taker, got))
        thread.start()
        time.sleep(0.3)  # the taker asks meanwhile
        assert not got and giver_process.flushed_at is None  # no flush while the task runs
    thread.join(30)
    [(entered, waited)] = got
    assert giver_process.flushed_at is not None and giver_process.flushed_at < entered
    assert waited.handover == HandoverWait(0.0, 0, 0, "free")  # nothing left to wait for


def test_a_lingering_turn_is_flushed_and_given_up_as_soon_as_another_cluster_asks(tmp_path, monkeypatch):
    monkeypatch.setattr(host_gpu_lock, "LINGER_S", 60.0)
    giver_process = PooledProcess(pooled=48 * GiB)
    giver = HostGPUClaim(UUID, "tcp://127.0.0.1:1", directory=tmp_path, flush=giver_process.flush)
    taker = HostGPUClaim(UUID, "tcp://127.0.0.1:2", directory=tmp_path)
    with giver.hold():
        pass
    assert taker.in_use_elsewhere()  # lingering, nobody asked: the pool stays warm
    assert giver_process.flushed_at is None
    with taker.hold() as waited:
        assert waited < 10  # not the linger's 60 s
        assert giver_process.flushed_at is not None


def test_the_taker_waits_for_memory_a_flush_did_not_give_back_then_starts(tmp_path, monkeypatch, caplog):
    giver_process = PooledProcess(pooled=48 * GiB, frees=False)  # say, arrays still alive
    giver = HostGPUClaim(UUID, "tcp://127.0.0.1:1", directory=tmp_path, flush=giver_process.flush)
    handover = MemoryHandover(giver_process.process_memories, own_pid=OWN, steady_s=0.3)
    taker = HostGPUClaim(UUID, "tcp://127.0.0.1:2", directory=tmp_path, handover=handover)
    with giver.hold():
        pass
    caplog.set_level("INFO", logger=host_gpu_lock.__name__)
    with taker.hold() as waited:
        wait = waited.handover
    assert wait.outcome == "steady" and wait.pids == (PooledProcess.PID,) and wait.left == 47 * GiB
    assert waited >= wait.waited_s >= 0.3
    assert "waiting for 47.00 GiB held by process(es) [7]" in caplog.text


def test_no_hand_over_while_the_turn_stays_with_one_cluster(tmp_path, monkeypatch):
    monkeypatch.setattr(host_gpu_lock, "LINGER_S", 0.0)
    reads: list[int] = []
    handover = MemoryHandover(lambda: reads.append(1) or {}, own_pid=OWN)
    claim = HostGPUClaim(UUID, "tcp://127.0.0.1:1", directory=tmp_path, handover=handover)
    with claim.hold() as first:
        assert first.handover is not None  # the first entry: nobody said whose turn it was
    deadline = time.monotonic() + 30
    while claim.in_use_elsewhere() or claim._fd is not None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with claim.hold() as again:  # the gate was dropped and entered again: still this cluster's turn
        assert again.handover is None
    assert len(reads) == 1


def test_claims_read_other_processes_through_the_probe(monkeypatch):
    from prefect_gpu_dask.worker.guard import release_allocator_caches

    monkeypatch.setattr(host_gpu_lock, "_claims", {})
    probe = PooledProcess(pooled=0)
    claim = host_gpu_lock.claim_for(UUID, "tcp://127.0.0.1:9", probe)
    assert claim._flush is release_allocator_caches
    assert claim._handover is not None and claim._handover._read == probe.process_memories
    assert host_gpu_lock.claim_for(UUID, "tcp://127.0.0.1:9", probe) is claim
    assert host_gpu_lock.claim_for(UUID, "tcp://127.0.0.1:8", object())._handover is None
