"""Leaks inside RMM pools, judged from scripted answers (no GPU, no RMM): the driver sees
only the pool, RMM's statistics see what each task keeps."""

from __future__ import annotations

import asyncio
import sys
import types
from dataclasses import dataclass

import pytest

from prefect_gpu_dask.records import CLEAN, LEAK
from prefect_gpu_dask.settings import RunnerSettings
from prefect_gpu_dask.worker import probe as probe_module
from prefect_gpu_dask.worker.probe import AllocatorBytes, GPUIdentity, MemorySample, RmmCounters
from prefect_gpu_dask.worker.verdict import verdict_for

MiB = 2**20
GiB = 2**30
TOTAL = 80 * GiB
CONTEXT = 500 * MiB
SETTINGS = RunnerSettings(leak_threshold="256MiB", memory_limit=0.9)


class PoolProbe:
    """A worker on an RMM pool of ``pool`` bytes: the driver sees the context and the
    pool (which grows when asked for more than it has, and never shrinks); RMM's
    statistics see what is handed out."""

    gpu = GPUIdentity(0, "GPU-rmm-pool")

    def __init__(self, pool: int = 8 * GiB):
        self.pool = pool
        self.owned = 0

    def allocate(self, nbytes: int) -> None:
        self.owned += nbytes
        self.pool = max(self.pool, self.owned)

    def sample(self) -> MemorySample:
        used = CONTEXT + self.pool
        return MemorySample(used, used, TOTAL)

    def allocator_bytes(self) -> AllocatorBytes:
        return AllocatorBytes(self.pool - self.owned, self.owned, "rmm")


class AsyncPoolProbe(PoolProbe):
    """``rmm_async``: the reservation is known only as RMM's peak (``RmmCounters``), which
    a task keeping memory inside the primed pool raises as much as what it hands out:
    the driver's figure less the pool's free part does not move, RMM's count does."""

    def __init__(self, pool: int = 8 * GiB):
        super().__init__(pool)
        self.peak = 0

    def allocate(self, nbytes: int) -> None:
        super().allocate(nbytes)
        self.peak = max(self.peak, self.owned)

    def allocator_bytes(self) -> AllocatorBytes:
        return AllocatorBytes(self.peak - self.owned, self.owned, "rmm")


def judge_task(probe: PoolProbe, task, alone: bool = True):
    flushes = []
    before = probe.sample()
    held = probe.allocator_bytes()
    before = MemorySample(*before[:3], held.cached, held.owned, held.allocator)
    task(probe)
    return verdict_for(
        probe,
        before,
        SETTINGS,
        1,
        lambda: flushes.append(1),
        lambda s: None,
        probe.allocator_bytes,
        alone=alone,
    ), len(flushes)


def keep_1gib(probe: PoolProbe) -> None:
    probe.allocate(1 * GiB)


def churn_2gib(probe: PoolProbe) -> None:
    probe.allocate(2 * GiB)
    probe.allocate(-2 * GiB)


@pytest.mark.parametrize("pool", [PoolProbe, AsyncPoolProbe])
def test_memory_kept_inside_the_pool_is_a_leak_on_every_call(pool):
    probe = pool()
    for _ in range(2):
        verdict, flushes = judge_task(probe, keep_1gib)
        assert verdict.status == LEAK and flushes == 1
        assert verdict.delta == 1 * GiB and verdict.allocator_delta == 1 * GiB
        assert verdict.restart_reason.startswith("leak: task left 1.00 GiB")
        assert verdict.after.judged == verdict.before.judged  # the driver saw nothing
        assert verdict.after.allocator == "rmm"


def test_memory_allocated_and_freed_inside_the_pool_is_clean_without_a_flush():
    verdict, flushes = judge_task(PoolProbe(), churn_2gib)
    assert (verdict.status, verdict.delta, verdict.restart_reason, flushes) == (CLEAN, 0, None, 0)
    verdict, flushes = judge_task(AsyncPoolProbe(), churn_2gib)  # a new peak, inside the pool
    assert (verdict.status, verdict.restart_reason, flushes) == (CLEAN, None, 0)


@pytest.mark.parametrize("pool", [PoolProbe, AsyncPoolProbe])
def test_the_pools_own_growth_is_never_the_tasks(pool):
    # A 1 GiB pool asked for 2 GiB grows to 2 GiB and keeps it: cached, not the task's.
    probe = pool(pool=1 * GiB)
    verdict, _ = judge_task(probe, churn_2gib)
    assert verdict.after.judged - verdict.before.judged == 1 * GiB
    assert verdict.status != LEAK and verdict.restart_reason is None
    # An async pool's primed part is not known to RMM: a first peak inside it reads as less.
    assert verdict.delta == 0 if pool is PoolProbe else verdict.delta <= 0


def test_beside_another_guarded_task_rmms_count_alone_does_not_convict():
    # RMM's statistics are the process's: what only they see may be the other task's.
    verdict, flushes = judge_task(AsyncPoolProbe(), keep_1gib, alone=False)
    assert (verdict.status, verdict.restart_reason, flushes) == (CLEAN, None, 0)


# -- RmmCounters over a scripted ``rmm.mr`` -----------------------------------------


@dataclass
class Counts:
    current_bytes: int
    peak_bytes: int


class Resource:
    def __init__(self, upstream=None):
        self.upstream = upstream

    def get_upstream(self):
        return self.upstream


class PoolMemoryResource(Resource):
    def __init__(self, size):
        super().__init__()
        self.size = size

    def pool_size(self):
        return self.size


class CudaAsyncMemoryResource(Resource):
    pass


class LimitingResourceAdaptor(Resource):
    pass


class StatisticsResourceAdaptor(Resource):
    def __init__(self, upstream):
        super().__init__(upstream)
        self.allocation_counts = Counts(0, 0)


def fake_rmm(monkeypatch, resource) -> types.SimpleNamespace:
    mr = types.SimpleNamespace(
        PoolMemoryResource=PoolMemoryResource,
        CudaAsyncMemoryResource=CudaAsyncMemoryResource,
        StatisticsResourceAdaptor=StatisticsResourceAdaptor,
        current=resource,
    )
    mr.get_current_device_resource = lambda: mr.current
    statistics = types.ModuleType("rmm.statistics")

    def enable_statistics():
        if not isinstance(mr.current, StatisticsResourceAdaptor):
            mr.current = StatisticsResourceAdaptor(mr.current)

    statistics.enable_statistics = enable_statistics
    rmm = types.ModuleType("rmm")
    rmm.mr = mr
    monkeypatch.setitem(sys.modules, "rmm", rmm)
    monkeypatch.setitem(sys.modules, "rmm.statistics", statistics)
    monkeypatch.setattr(probe_module, "_rmm_counters", None)
    return mr


def test_a_pools_reservation_is_cached_and_its_allocations_owned(monkeypatch):
    mr = fake_rmm(monkeypatch, LimitingResourceAdaptor(PoolMemoryResource(8 * GiB)))
    assert probe_module.loaded_allocator_bytes() == AllocatorBytes(0, None, None)  # statistics off
    assert probe_module.enable_rmm_statistics()
    mr.current.allocation_counts = Counts(3 * GiB, 5 * GiB)
    assert probe_module.loaded_allocator_bytes() == AllocatorBytes(5 * GiB, 3 * GiB, "rmm")
    assert probe_module.enable_rmm_statistics()  # idempotent: one adaptor
    assert isinstance(mr.current.upstream, LimitingResourceAdaptor)


def test_an_async_pool_keeps_its_peak(monkeypatch):
    mr = fake_rmm(monkeypatch, CudaAsyncMemoryResource())
    counters = RmmCounters(sys.modules["rmm"])
    assert counters() is None
    probe_module.enable_rmm_statistics()
    mr.current.allocation_counts = Counts(1 * GiB, 3 * GiB)
    assert counters() == (1 * GiB, 2 * GiB)


def test_rmm_is_never_imported_to_ask(monkeypatch):
    monkeypatch.delitem(sys.modules, "rmm", raising=False)
    monkeypatch.setattr(probe_module, "_rmm_counters", None)
    assert not probe_module.enable_rmm_statistics()
    assert probe_module.loaded_allocator_bytes().allocator is None
    assert "rmm" not in sys.modules


# -- the guard: which tasks ran alone ----------------------------------------------


def started_guard(probe):
    from prefect_gpu_dask.worker.guard import GPUMemoryGuard

    class Worker:
        address = name = "tcp://127.0.0.1:1"

        def log_event(self, topic, msg):
            pass

    guard = GPUMemoryGuard(RunnerSettings(memory_probe=lambda: probe, health_check_s=None))
    asyncio.run(guard.setup(Worker()))
    return guard


@pytest.mark.parametrize("overlap", [False, True])
def test_the_guard_judges_by_rmm_only_a_task_that_ran_alone(overlap):
    probe = AsyncPoolProbe()
    guard = started_guard(probe)
    first = guard.begin()
    second = guard.begin() if overlap else None
    probe.allocate(1 * GiB)
    verdict, *_ = guard.end(*first, task="keeps")
    assert verdict.status == (CLEAN if overlap else LEAK)
    if second is not None:
        assert guard.end(*second, task="other")[0].status == CLEAN
    third = guard.begin()  # alone again: the next leak is seen
    probe.allocate(1 * GiB)
    assert guard.end(*third, task="keeps")[0].status == LEAK
