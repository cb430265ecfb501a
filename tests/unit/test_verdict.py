"""Verdicts, restart reasons, settings and the guard's readings, driven by a scripted probe
(no GPU, no cluster, no server)."""

from __future__ import annotations

import pytest

from prefect_gpu_dask.records import CACHED, CLEAN, LEAK, LIBRARY
from prefect_gpu_dask.settings import RunnerSettings
from prefect_gpu_dask.worker.probe import AllocatorBytes, MemorySample
from prefect_gpu_dask.worker.verdict import restart_reason, verdict_for
from tests.scripted_probe import ScriptedProbe

MiB = 2**20
GiB = 2**30
SETTINGS = RunnerSettings(leak_threshold="256MiB", memory_limit=0.9)


class Flushes:
    def __init__(self):
        self.count = 0

    def __call__(self):
        self.count += 1


def run(probe, before=1 * GiB, settings=SETTINGS, tasks_run=1, grew_before=False):
    flushes, sleeps = Flushes(), []
    start = MemorySample(before, before, probe.total, owned=before)
    verdict = verdict_for(
        probe, start, settings, tasks_run, flushes, sleeps.append, probe.allocator_bytes, grew_before
    )
    return verdict, flushes.count, sleeps


def test_clean_task_needs_no_flush():
    verdict, flushes, sleeps = run(ScriptedProbe(1 * GiB + 10 * MiB))
    assert (verdict.status, flushes, sleeps) == (CLEAN, 0, [])
    assert verdict.delta == 10 * MiB
    assert verdict.restart_reason is None


def test_pool_churn_is_not_a_leak():
    # 4 GiB still cached by the pool after the task; the flush gives it back.
    verdict, flushes, _ = run(ScriptedProbe(5 * GiB, 1 * GiB))
    assert (verdict.status, flushes) == (CACHED, 1)
    assert verdict.restart_reason is None


def test_driver_slow_to_release_is_not_a_leak():
    verdict, flushes, sleeps = run(ScriptedProbe(2 * GiB, 2 * GiB, 1 * GiB + MiB))
    assert verdict.status == CACHED
    assert sleeps == [SETTINGS.settle_s]


def test_memory_kept_alive_is_a_leak():
    verdict, flushes, sleeps = run(ScriptedProbe(1 * GiB + 512 * MiB))
    assert verdict.status == LEAK
    assert verdict.delta == 512 * MiB
    assert flushes == 1 and len(sleeps) == 1
    assert verdict.restart_reason.startswith("leak: task left 512.00 MiB")


def test_threshold_is_inclusive():
    verdict, _, _ = run(ScriptedProbe(1 * GiB + 256 * MiB))
    assert verdict.status == CLEAN


def test_device_wide_figure_when_process_memory_is_unknown():
    probe = ScriptedProbe(-1, device_used=3 * GiB)
    start = MemorySample(-1, 1 * GiB, probe.total)
    # No allocator to ask: the first such growth is a library's, the second a leak.
    verdict = verdict_for(probe, start, SETTINGS, 1, Flushes(), lambda s: None)
    assert verdict.status == LIBRARY and verdict.delta == 2 * GiB and verdict.restart_reason is None
    verdict = verdict_for(probe, start, SETTINGS, 1, Flushes(), lambda s: None, grew_before=True)
    assert verdict.status == LEAK and verdict.delta == 2 * GiB


def test_memory_limit_recycles_without_a_leak():
    probe = ScriptedProbe(1 * GiB, device_used=int(0.95 * 16 * GiB))
    verdict, _, _ = run(probe)
    assert verdict.status == CLEAN
    assert verdict.restart_reason.startswith("memory limit: GPU 95% used")


def test_restart_after_tasks():
    settings = RunnerSettings(restart_after_tasks=3)
    after = MemorySample(0, 0, GiB)
    assert restart_reason(CLEAN, after, 0, 2, settings) is None
    assert restart_reason(CLEAN, after, 0, 3, settings).startswith("recycle: 3 GPU tasks")


@pytest.mark.parametrize(
    "kwargs, bad",
    [
        ({"leak_threshold": "lots"}, "'lots'"),
        ({"leak_threshold": -5}, "-5"),
        ({"leak_threshold": 0}, "0"),
        ({"leak_threshold": True}, "True"),
        ({"leak_threshold": 1.5}, "1.5"),
        ({"memory_limit": 0}, "0"),
        ({"memory_limit": 1.5}, "1.5"),
        ({"memory_limit": "0.9"}, "'0.9'"),
        ({"memory_limit": float("nan")}, "nan"),
        ({"restart_after_tasks": 0}, "0"),
        ({"restart_after_tasks": 2.5}, "2.5"),
        ({"restart": "sometimes"}, "'sometimes'"),
        ({"oom_retries": -1}, "-1"),
        ({"oom_retries": 1.5}, "1.5"),
        ({"memory_probe": "no-colon"}, "'no-colon'"),
    ],
)
def test_bad_settings_name_the_value(kwargs, bad):
    with pytest.raises(ValueError) as err:
        RunnerSettings(**kwargs)
    assert bad in str(err.value)


def test_size_strings():
    assert RunnerSettings(leak_threshold="1GiB").leak_threshold == GiB
    assert RunnerSettings(leak_threshold="512 MB").leak_threshold == 512 * 10**6
    assert RunnerSettings(leak_threshold=4096).leak_threshold == 4096


def test_growth_explained_by_pool_free_blocks_is_judged_without_a_flush():
    probe = ScriptedProbe(5 * GiB)
    flushes = Flushes()
    start = MemorySample(1 * GiB, 1 * GiB, probe.total)
    verdict = verdict_for(
        probe, start, SETTINGS, 1, flushes, lambda s: None, lambda: AllocatorBytes(cached=4 * GiB)
    )
    assert (verdict.status, flushes.count) == (CACHED, 0)


def test_pool_free_blocks_do_not_hide_a_leak():
    # 4 GiB grew, only 1 GiB of it is free pool blocks: flush, re-sample, still a leak.
    probe = ScriptedProbe(5 * GiB)
    flushes = Flushes()
    start = MemorySample(1 * GiB, 1 * GiB, probe.total, owned=1 * GiB)
    held = AllocatorBytes(cached=1 * GiB, owned=4 * GiB)
    verdict = verdict_for(probe, start, SETTINGS, 1, flushes, lambda s: None, lambda: held)
    assert (verdict.status, flushes.count) == (LEAK, 1)


def test_over_limit_flushes_caches_before_recycling():
    probe = ScriptedProbe(1 * GiB)
    probe.device_used = int(0.95 * probe.total)
    flushes = Flushes()

    def flush():
        flushes()
        probe.device_used = int(0.5 * probe.total)  # the pool gave its blocks back

    verdict = verdict_for(
        probe, MemorySample(1 * GiB, 1 * GiB, probe.total), SETTINGS, 1, flush, lambda s: None
    )
    assert verdict.restart_reason is None and flushes.count == 1


def test_leak_served_from_the_pools_free_blocks_is_caught():
    # The pool already held 4 GiB free; a 512 MiB leak reused it, so the driver's figure
    # did not move. In-use memory did: flush, re-sample, and it is a leak.
    probe = ScriptedProbe(5 * GiB, 5 * GiB, 1536 * MiB)
    cached_bytes = iter([int(3.5 * GiB), int(3.5 * GiB), 0, 0])
    flushes = Flushes()
    start = MemorySample(5 * GiB, 5 * GiB, probe.total, cached=4 * GiB, owned=1 * GiB)
    verdict = verdict_for(
        probe,
        start,
        SETTINGS,
        1,
        flushes,
        lambda s: None,
        lambda: AllocatorBytes(next(cached_bytes), 1536 * MiB),  # the pool hands out 512 MiB more
    )
    assert (verdict.status, flushes.count) == (LEAK, 1)
    assert verdict.delta == 512 * MiB


class TwoReadingsProbe(ScriptedProbe):
    """A probe with the cheaper per-process reading: device figures left at 0."""

    def __init__(self, *process_bytes: int, device_used: int):
        super().__init__(*process_bytes, device_used=device_used)
        self.calls: list[str] = []

    def sample(self) -> MemorySample:
        self.calls.append("sample")
        return super().sample()

    def sample_process(self) -> MemorySample:
        self.calls.append("sample_process")
        return super().sample()._replace(device_used=0, device_total=0)


def started_guard(probe):
    import asyncio

    from prefect_gpu_dask.worker.guard import GPUMemoryGuard

    class Worker:
        address = name = "tcp://127.0.0.1:1"

        def log_event(self, topic, msg):
            pass

    # No health timer: it needs a real worker (tests/integration/test_quarantine.py).
    guard = GPUMemoryGuard(RunnerSettings(memory_probe=lambda: probe, health_check_s=None))
    asyncio.run(guard.setup(Worker()))
    probe.calls.clear()
    return guard


@pytest.mark.parametrize(
    "after, device_used, status, reason",
    [
        (1 * GiB + 10 * MiB, 2 * GiB, CLEAN, None),
        (1 * GiB + 512 * MiB, 2 * GiB, LEAK, "leak: task left 512.00 MiB"),
        # The device-wide figures are read after the task, so the memory limit still holds.
        (1 * GiB, int(0.95 * 16 * GiB), CLEAN, "memory limit: GPU 95% used"),
    ],
)
def test_guard_reads_the_process_only_before_a_task_and_judges_the_same(after, device_used, status, reason):
    probe = TwoReadingsProbe(1 * GiB, 1 * GiB, after, device_used=device_used)
    guard = started_guard(probe)
    ticket, before, started = guard.begin()
    assert probe.calls == ["sample_process"] and before.judged == 1 * GiB
    verdict, peak, _, _ = guard.end(ticket, before, started)
    assert probe.calls[1] == "sample"  # the first reading after the task is a full one
    assert verdict.status == status and verdict.after.device_used == device_used
    assert (verdict.restart_reason or "").startswith(reason or "") and bool(verdict.restart_reason) == bool(
        reason
    )
    assert peak == max(1 * GiB, verdict.after.judged)


class SlowVerdictProbe(TwoReadingsProbe):
    """A GPU drawing a steady 200 W, whose readings take ``slow_s``."""

    def __init__(self, slow_s: float):
        super().__init__(1 * GiB, 1 * GiB, 1 * GiB, device_used=2 * GiB)
        self.slow_s = slow_s

    def activity_reader(self):
        from tests.scripted_probe import ScriptedActivity

        return ScriptedActivity()

    def sample(self) -> MemorySample:
        import time

        time.sleep(self.slow_s)
        return super().sample()

    def sample_process(self) -> MemorySample:
        import time

        time.sleep(self.slow_s)
        return super().sample_process()


def test_a_tasks_energy_spans_its_duration_not_the_verdict_after_it():
    import time

    probe = SlowVerdictProbe(slow_s=0.0)
    guard = started_guard(probe)
    guard.end(*guard.begin())  # the activity thread starts with a guard's first task
    ticket, before, started = guard.begin()
    probe.slow_s = 0.5  # the verdict's reading after the task
    time.sleep(0.5)
    verdict, _, duration, activity = guard.end(ticket, before, started)
    assert verdict.status == CLEAN and 0.5 <= duration < 0.7
    # Over the verdict too, it would read about twice as much.
    assert activity.energy_j == pytest.approx(200 * duration, rel=0.1), (activity, duration)


class ClockProbe:
    """Process memory as a function of time since ``t0``; counts the reads."""

    gpu = ScriptedProbe.gpu

    def __init__(self, spike_from: float, spike_to: float):
        import time

        self.t0, self.reads = time.monotonic(), 0
        self.spike = (spike_from, spike_to)

    def sample(self) -> MemorySample:
        import time

        self.reads += 1
        elapsed = time.monotonic() - self.t0
        used = 3 * GiB if self.spike[0] <= elapsed < self.spike[1] else 1 * GiB
        return MemorySample(used, used, 16 * GiB)


def test_peak_sampler_catches_a_spike_and_backs_off_on_long_tasks():
    import time

    from prefect_gpu_dask.worker.guard import PeakSampler

    probe = ClockProbe(spike_from=0.02, spike_to=0.12)
    sampler = PeakSampler(probe, interval_s=0.005, max_interval_s=0.1)
    sampler.start(1, 1 * GiB)
    time.sleep(1.0)
    peak = sampler.stop(1, 1 * GiB)
    assert peak == 3 * GiB  # read at ~5, 15, 35, 75 ms: the spike is seen
    # 5 ms throughout would be ~200 reads; doubling to 100 ms leaves about a dozen.
    assert 5 <= probe.reads <= 20, probe.reads


def test_a_task_starting_after_a_long_one_is_watched_closely_from_its_start():
    import time

    from prefect_gpu_dask.worker.guard import PeakSampler

    probe = ClockProbe(spike_from=10.0, spike_to=10.0)  # no spike during the long task
    sampler = PeakSampler(probe, interval_s=0.005, max_interval_s=1.0)
    sampler.start(1, 1 * GiB)
    time.sleep(2.5)  # the sampler now waits 1 s between readings
    sampler.stop(1, 1 * GiB)
    probe.t0, probe.spike = time.monotonic(), (0.02, 0.08)  # the next task spikes early
    sampler.start(2, 1 * GiB)
    time.sleep(0.15)
    assert sampler.stop(2, 1 * GiB) == 3 * GiB


def test_a_process_reading_that_cannot_attribute_memory_falls_back_to_the_full_one():
    from prefect_gpu_dask.worker.probe import process_sampler

    class Unattributed(ScriptedProbe):
        def sample_process(self) -> MemorySample:
            return MemorySample(-1, 0, 0)

    probe = Unattributed(-1, device_used=3 * GiB)
    assert process_sampler(probe)().judged == 3 * GiB


class DeviceAndProcess:
    """A GPU whose full reading and process reading are counted, and scripted apart."""

    total = 16 * GiB

    def __init__(self, process: int, device_used: int):
        self.process, self.device_used = process, device_used
        self.full_reads = self.process_reads = 0

    def sample(self) -> MemorySample:
        self.full_reads += 1
        return MemorySample(self.process, self.device_used, self.total)

    def sample_process(self) -> MemorySample:
        self.process_reads += 1
        return MemorySample(self.process, 0, 0)

    def allocator_bytes(self) -> AllocatorBytes:
        return AllocatorBytes(0, self.process)


def test_after_a_task_the_device_figure_is_a_recent_full_one_moved_by_the_process():
    from prefect_gpu_dask.worker.probe import AfterSampler

    now = [0.0]
    probe = DeviceAndProcess(1 * GiB, device_used=5 * GiB)
    read = AfterSampler(probe, max_age_s=1.0, clock=lambda: now[0])
    assert read() == MemorySample(1 * GiB, 5 * GiB, probe.total) and probe.full_reads == 1
    probe.process, probe.device_used = 3 * GiB, 9 * GiB  # this process +2 GiB, another +2 GiB
    now[0] = 0.9
    assert read() == MemorySample(3 * GiB, 7 * GiB, probe.total)  # the other's not seen yet
    assert (probe.full_reads, probe.process_reads) == (1, 1)
    now[0] = 1.1
    assert read() == MemorySample(3 * GiB, 9 * GiB, probe.total) and probe.full_reads == 2
    probe.process = -1  # the driver cannot attribute memory (MIG, vGPU): full readings only
    now[0] = 1.2
    read(), read()
    assert (probe.full_reads, probe.process_reads) == (4, 2)


def test_a_memory_limit_an_old_device_figure_says_is_passed_is_read_again_in_full():
    from prefect_gpu_dask.worker.probe import AfterSampler

    now = [0.0]
    limit = int(SETTINGS.memory_limit * DeviceAndProcess.total)
    probe = DeviceAndProcess(1 * GiB, device_used=limit - 100 * MiB)
    read = AfterSampler(probe, max_age_s=1.0, clock=lambda: now[0])
    read()  # the full reading: just under the limit
    probe.process, probe.device_used = 1 * GiB + 200 * MiB, 10 * GiB  # +200 MiB here, others freed
    start = MemorySample(1 * GiB, limit - 100 * MiB, probe.total, owned=1 * GiB)

    def judged():
        return verdict_for(
            probe, start, SETTINGS, 1, Flushes(), lambda s: None, probe.allocator_bytes, sample=read
        )

    # The old figure moved by +200 MiB is over the limit; the full reading is not.
    verdict = judged()
    assert verdict.status == CLEAN and verdict.restart_reason is None
    assert verdict.after.device_used == 10 * GiB and (probe.full_reads, probe.process_reads) == (2, 1)
    assert judged().restart_reason is None and probe.full_reads == 2  # estimated from the new reading
    probe.device_used = limit + 1 * GiB  # others fill the GPU: seen once the reading is old
    assert judged().restart_reason is None
    now[0] = 1.5
    assert judged().restart_reason.startswith("memory limit")


def test_growth_outside_every_allocator_is_a_library_once_then_a_leak():
    # cuSOLVER's handles on a thread new to it: 900 MiB, none of it handed out by a pool.
    grew = 1 * GiB + 900 * MiB
    verdict, flushes, sleeps = run(ScriptedProbe(grew, outside=900 * MiB))
    assert verdict.status == LIBRARY and verdict.restart_reason is None
    assert verdict.delta == 900 * MiB and verdict.allocator_delta == 0
    assert flushes == 1 and len(sleeps) == 1  # caches had their chance first
    verdict, _, _ = run(ScriptedProbe(grew, outside=900 * MiB), grew_before=True)
    assert verdict.status == LEAK and verdict.restart_reason.startswith("leak: task left 900.00 MiB")


def test_memory_a_pool_still_hands_out_is_a_leak_even_beside_library_growth():
    # 512 MiB of arrays kept alive in a global, plus a library's first-use growth.
    verdict, _, _ = run(ScriptedProbe(1 * GiB + 512 * MiB + 300 * MiB, outside=300 * MiB))
    assert verdict.status == LEAK and verdict.allocator_delta == 512 * MiB


def test_library_growth_recycles_only_over_the_memory_limit():
    probe = ScriptedProbe(1 * GiB + 900 * MiB, outside=900 * MiB, device_used=int(0.95 * 16 * GiB))
    verdict, _, _ = run(probe)
    assert verdict.status == LIBRARY and verdict.restart_reason.startswith("memory limit")


def test_the_guard_allows_library_growth_once_per_task_and_worker_thread():
    import threading

    probe = TwoReadingsProbe(1 * GiB, device_used=2 * GiB)
    probe.outside = 1 * GiB  # every sample after the first shows +1 GiB outside the pool
    guard = started_guard(probe)

    def judged(task: str) -> str:
        probe.samples = [1 * GiB, 2 * GiB]
        probe.reads = 0
        ticket, before, started = guard.begin()
        before = before._replace(owned=1 * GiB)
        return guard.end(ticket, before, started, task)[0].status

    assert judged("svd") == LIBRARY
    assert judged("matmul") == LIBRARY  # another task: its own first use
    other: list[str] = []
    thread = threading.Thread(target=lambda: other.append(judged("svd")))
    thread.start()
    thread.join()
    assert other == [LIBRARY]  # another thread: its own handles
    assert judged("svd") == LEAK  # the same task on the same thread, growing again


def test_work_on_a_pool_thread_new_to_the_task_renews_the_allowance_though_none_is_new():
    """A long-lived pool's threads are all started early; a later run of the same task
    may still reach one of them for the first time (its library handles are new)."""
    import concurrent.futures

    from prefect_gpu_dask.worker import task_threads

    probe = TwoReadingsProbe(1 * GiB, device_used=2 * GiB)
    probe.outside = 1 * GiB
    guard = started_guard(probe)
    pools = [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpu-graph") for _ in range(2)]
    for pool in pools:
        pool.submit(int).result()  # every pool thread alive before the first run

    def judged(*on: concurrent.futures.ThreadPoolExecutor) -> str:
        probe.samples = [1 * GiB, 2 * GiB]
        probe.reads = 0
        ticket, before, started = guard.begin()
        with task_threads.recording() as used:
            for pool in on:
                pool.submit(task_threads.noting(int)).result()
        before = before._replace(owned=1 * GiB)
        return guard.end(ticket, before, started, "svd", threads=frozenset(used))[0].status

    try:
        assert judged(pools[0]) == LIBRARY
        assert judged(pools[1]) == LIBRARY  # a thread this task's work had not run on
        assert judged(pools[0], pools[1]) == LEAK  # both used before: growing again is a leak
    finally:
        for pool in pools:
            pool.shutdown()


def test_a_pool_new_since_the_allowance_renews_it_though_its_threads_are_daemons():
    """Chunks of a task on a worker run in pools started from the worker's daemon
    threads, so their threads are daemons too: new ones still bring new handles."""
    import concurrent.futures
    import threading

    probe = TwoReadingsProbe(1 * GiB, device_used=2 * GiB)
    probe.outside = 1 * GiB
    guard = started_guard(probe)
    verdicts: list[str] = []

    def judged_on_a_worker_thread(start_pool: bool) -> None:
        pool = None
        probe.samples = [1 * GiB, 2 * GiB]
        probe.reads = 0
        ticket, before, started = guard.begin()
        if start_pool:
            pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="gpu-graph")
            pool.submit(int).result()
        before = before._replace(owned=1 * GiB)
        verdicts.append(guard.end(ticket, before, started, "cube")[0].status)
        if pool is not None:
            pools.append(pool)  # its threads stay alive past end(), as a worker's pool's do

    pools: list[concurrent.futures.ThreadPoolExecutor] = []
    worker_thread = threading.Thread(
        target=lambda: [judged_on_a_worker_thread(start) for start in (False, True, False)], daemon=True
    )
    worker_thread.start()
    worker_thread.join()
    for pool in pools:
        pool.shutdown()
    # First use; a new pool's threads make handles of their own; then growing again is a leak.
    assert verdicts == [LIBRARY, LIBRARY, LEAK]


def _exception(module: str, name: str, base: type = Exception) -> type:
    return type(name, (base,), {"__module__": module})


@pytest.mark.parametrize(
    "exc, library, requested",
    [
        (
            _exception("cupy.cuda.memory", "OutOfMemoryError")(
                "Out of memory allocating 4,294,967,296 bytes (allocated so far: 0 bytes)."
            ),
            "cupy",
            4 * GiB,
        ),
        (
            _exception("torch.cuda", "OutOfMemoryError", RuntimeError)(
                "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79 GiB"
            ),
            "torch",
            20 * GiB,
        ),
        (
            MemoryError("std::bad_alloc: out_of_memory: CUDA error at: rmm/mr/device/cuda_memory_resource"),
            "rmm",
            None,
        ),
        (
            _exception("numba.cuda.cudadrv.driver", "CudaAPIError")(
                "[2] Call to cuMemAlloc results in CUDA_ERROR_OUT_OF_MEMORY"
            ),
            "numba",
            None,
        ),
    ],
)
def test_cuda_out_of_memory_is_recognised_per_library(exc, library, requested):
    from prefect_gpu_dask.worker.verdict import out_of_memory

    found = out_of_memory(exc)
    assert found is not None and (found.library, found.requested) == (library, requested)
    try:
        raise RuntimeError("task failed") from exc  # behind a wrapper, too
    except RuntimeError as wrapped:
        assert out_of_memory(wrapped).library == library


@pytest.mark.parametrize("exc", [ValueError("bad input"), MemoryError("host"), RuntimeError("out of time")])
def test_other_failures_are_not_out_of_memory(exc):
    from prefect_gpu_dask.worker.verdict import out_of_memory

    assert out_of_memory(exc) is None


def test_an_oom_whose_memory_comes_back_is_oom_without_a_restart():
    from prefect_gpu_dask.worker.verdict import OutOfMemory

    oom = OutOfMemory("cupy", 200 * GiB, "Out of memory allocating ...")
    # The failed fill-until-OOM left 12 GiB in the pool; the flush gives it back.
    probe = ScriptedProbe(1 * GiB + 10 * MiB)
    flushes = Flushes()
    start = MemorySample(1 * GiB, 1 * GiB, probe.total, owned=1 * GiB)
    verdict = verdict_for(probe, start, SETTINGS, 1, flushes, lambda s: None, probe.allocator_bytes, oom=oom)
    assert verdict.status == "oom" and verdict.restart_reason is None and flushes.count == 1
    assert verdict.oom.requested == 200 * GiB
    # ... and one whose memory stays held recycles its worker.
    probe = ScriptedProbe(13 * GiB)
    verdict = verdict_for(
        probe, start, SETTINGS, 1, Flushes(), lambda s: None, probe.allocator_bytes, oom=oom
    )
    assert verdict.status == "oom" and verdict.restart_reason.startswith("oom: 12.00 GiB still held")


def test_a_failed_task_is_judged_after_its_frames_let_go(tmp_path):
    """A task that fails while its locals hold device memory is not a leak: the guard
    clears the traceback's frames before judging."""
    from prefect_gpu_dask.worker import guard as guard_module
    from tests.scripted_probe import FakeBlock, FakeDeviceProbe

    class Worker:
        address = name = "tcp://127.0.0.1:1"
        events: list = []

        def log_event(self, topic, msg):
            self.events.append(msg)

    import asyncio

    guard = guard_module.GPUMemoryGuard(RunnerSettings(memory_probe=FakeDeviceProbe, health_check_s=None))
    asyncio.run(guard.setup(Worker()))

    def failing_task():
        held = FakeBlock(2 * GiB)  # noqa: F841 - alive in this frame until it is cleared
        raise ValueError("bad row")

    verdicts = []
    original = guard_module.current_guard
    guard_module.current_guard = lambda: guard
    guard_module._log_record = lambda record: verdicts.append(record.verdict)
    guard.report = lambda record: None
    try:
        with pytest.raises(ValueError, match="bad row"), guard_module.guarding():
            failing_task()
    finally:
        guard_module.current_guard = original
    assert verdicts == ["clean"]


def test_memory_other_processes_hold_never_recycles_this_worker():
    """Over the limit because another process holds most of the GPU: a restart of this
    worker would not bring it back under, so none is asked for (it would repeat after
    every task). Where this worker's own memory takes it over, it is recycled."""
    others = int(0.93 * 16 * GiB)
    verdict, _, _ = run(ScriptedProbe(1 * GiB, device_used=others + 1 * GiB))
    assert verdict.status == CLEAN and verdict.restart_reason is None
    # This worker holds 4 GiB from earlier tasks; without them the GPU is at 70 %.
    verdict, _, _ = run(ScriptedProbe(4 * GiB, device_used=int(0.95 * 16 * GiB)), before=4 * GiB)
    assert verdict.status == CLEAN
    assert verdict.restart_reason.startswith("memory limit: GPU 95% used")


def test_a_restart_that_would_bring_back_its_own_context_over_the_limit_is_not_asked_for():
    """Others hold just under the limit: this worker's 1 GiB takes the GPU over it, but
    its replacement's CUDA context (512 MiB here) would take it over again."""
    others = int(0.9 * 16 * GiB) - 256 * MiB
    probe = ScriptedProbe(1 * GiB, device_used=others + 1 * GiB)
    start = MemorySample(1 * GiB, 1 * GiB, probe.total, owned=1 * GiB)

    def verdict(replacement_bytes):
        return verdict_for(
            probe, start, SETTINGS, 1, Flushes(), lambda s: None, replacement_bytes=replacement_bytes
        )

    assert verdict(0).restart_reason.startswith("memory limit")
    assert verdict(512 * MiB).restart_reason is None


def test_the_peak_sampler_is_not_woken_for_each_task_and_goes_idle_between_them():
    import time

    from prefect_gpu_dask.worker.guard import PeakSampler
    from tests.unit.test_activity import CountingEvent

    probe = ClockProbe(spike_from=10.0, spike_to=10.0)
    sampler = PeakSampler(probe, interval_s=0.005, max_interval_s=0.1)
    sampler._wake = wake = CountingEvent()
    for ticket in range(200):
        sampler.start(ticket, 1 * GiB)
        sampler.stop(ticket, 1 * GiB)
    assert wake.sets <= 3, wake.sets
    deadline = time.monotonic() + 5
    while wake.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not wake.is_set()
    reads = probe.reads
    time.sleep(0.2)
    assert probe.reads == reads  # idle: no reading without a task


class DeviceFirst:
    """A GPU read as NVML is: the device's figure (``sample_device``), the process list
    (``sample_process_and_others``: this process's bytes, and how many other processes
    are on the GPU), and the full reading, each counted; ``during_list`` runs inside the
    list's reading, as an allocation landing while the driver answers would."""

    gpu = ScriptedProbe.gpu
    total = 16 * GiB

    def __init__(self, process: int, others: int, other_processes: int = 0):
        self.process, self.others, self.owned = process, others, process
        self.other_processes = other_processes
        self.device_reads = self.process_reads = self.full_reads = 0
        self.during_list = None

    def sample_device(self) -> tuple[int, int]:
        self.device_reads += 1
        return max(self.process, 0) + self.others, self.total

    def sample_process_and_others(self) -> tuple[MemorySample, int]:
        self.process_reads += 1
        if self.during_list is not None:
            self.during_list()
        return MemorySample(self.process, 0, 0), self.other_processes

    def sample(self) -> MemorySample:
        self.full_reads += 1
        return MemorySample(self.process, max(self.process, 0) + self.others, self.total)

    def allocator_bytes(self) -> AllocatorBytes:
        return AllocatorBytes(0, self.owned)


def test_the_process_list_is_read_again_only_once_the_device_or_an_allocator_moved():
    from prefect_gpu_dask.worker.probe import process_sampler

    now = [0.0]
    probe = DeviceFirst(1 * GiB, others=3 * GiB)
    read = process_sampler(probe)
    read._clock = lambda: now[0]
    assert read() == MemorySample(1 * GiB, 4 * GiB, probe.total) and probe.process_reads == 1
    assert read() == MemorySample(1 * GiB, 4 * GiB, probe.total) and probe.process_reads == 1
    probe.others += 2 * GiB  # memory no process holds (the driver's): the device's figure moves
    assert read() == MemorySample(1 * GiB, 6 * GiB, probe.total) and probe.process_reads == 2
    probe.others -= 512 * MiB  # the driver gives back what this process takes from it...
    probe.process += 512 * MiB
    probe.owned += 512 * MiB  # ...but this process's allocator says it handed out more
    assert read().judged == 1 * GiB + 512 * MiB and probe.process_reads == 3
    assert read().judged == 1 * GiB + 512 * MiB and probe.process_reads == 3
    now[0] = 1.5  # nothing moved, but the reading is older than a second
    assert read().judged == 1 * GiB + 512 * MiB and probe.process_reads == 4


def test_a_process_reading_while_the_device_moved_stands_for_no_later_one():
    from prefect_gpu_dask.worker.probe import process_sampler

    probe = DeviceFirst(1 * GiB, others=3 * GiB)
    read = process_sampler(probe)

    def this_process_allocates():
        probe.process += 256 * MiB
        probe.during_list = None

    probe.during_list = this_process_allocates  # lands after the device's figure was read
    # The device's figure read after the list goes with it.
    assert read() == MemorySample(1 * GiB + 256 * MiB, 4 * GiB + 256 * MiB, probe.total)
    probe.process -= 256 * MiB  # and is freed: the device reads 4 GiB again
    # The 4 GiB read before the list does not stand for what the list said.
    assert read().judged == 1 * GiB and probe.process_reads == 2


def test_with_another_process_on_the_gpu_every_reading_reads_the_list():
    from prefect_gpu_dask.worker.probe import process_sampler

    probe = DeviceFirst(1 * GiB, others=3 * GiB)
    read = process_sampler(probe)
    read(), read()
    assert probe.process_reads == 1
    probe.other_processes, probe.others = 1, 5 * GiB  # another cluster's worker comes, with 2 GiB
    assert read().judged == 1 * GiB and probe.process_reads == 2
    # It frees 512 MiB as this process takes them: the device's figure stands still.
    probe.others, probe.process = probe.others - 512 * MiB, probe.process + 512 * MiB
    device_reads = probe.device_reads
    assert read().judged == 1 * GiB + 512 * MiB and probe.process_reads == 3
    assert read().judged == 1 * GiB + 512 * MiB and probe.process_reads == 4
    assert probe.device_reads == device_reads  # the list alone, as before the device's figure
    probe.other_processes, probe.others = 0, 3 * GiB  # it leaves: alone again
    read(), read(), read(), read()
    assert probe.process_reads == 6  # the list that shows it gone, then one kept


def test_a_guarded_task_that_moved_nothing_reads_no_process_list_and_a_leak_is_still_one():
    probe = DeviceFirst(1 * GiB, others=3 * GiB)
    probe.calls = []  # started_guard clears it
    guard = started_guard(probe)
    reads_before = probe.process_reads
    for _ in range(3):
        ticket, before, started = guard.begin()
        verdict, _, _, _ = guard.end(ticket, before, started)
        assert verdict.status == CLEAN and verdict.after.device_used == 4 * GiB
    assert probe.process_reads - reads_before <= 1  # the first reading only, if the baseline's was not kept
    ticket, before, started = guard.begin()
    probe.process += 512 * MiB  # the task keeps 512 MiB its allocator still hands out
    probe.owned += 512 * MiB
    verdict, _, _, _ = guard.end(ticket, before, started)
    assert verdict.status == LEAK and verdict.after.judged == 1 * GiB + 512 * MiB
    assert verdict.after.device_used == 4 * GiB + 512 * MiB


def test_after_a_flush_the_leak_is_confirmed_by_full_readings():
    probe = DeviceFirst(1 * GiB, others=3 * GiB)
    probe.calls = []
    guard = started_guard(probe)
    ticket, before, started = guard.begin()
    probe.process += 512 * MiB  # outside every allocator: a flush and a settle read it again
    full_reads = probe.full_reads
    verdict, _, _, _ = guard.end(ticket, before, started)
    assert verdict.status == LIBRARY and verdict.after.judged == 1 * GiB + 512 * MiB
    assert probe.full_reads - full_reads == 2  # after the flush, and after the settle


def test_memory_the_driver_cannot_attribute_is_the_devices_figure():
    from prefect_gpu_dask.worker.probe import process_sampler

    now = [0.0]
    probe = DeviceFirst(-1, others=3 * GiB)
    probe.owned = 0
    read = process_sampler(probe)
    read._clock = lambda: now[0]
    assert read() == MemorySample(-1, 3 * GiB, probe.total) and probe.process_reads == 1
    probe.others = 4 * GiB
    assert read().judged == 4 * GiB and probe.process_reads == 1  # the device's figure alone
    now[0] = 1.5
    assert read().judged == 4 * GiB and probe.process_reads == 2  # the list again, once a second


def test_beside_another_process_the_reading_after_a_task_has_the_devices_figures():
    probe = DeviceFirst(1 * GiB, others=3 * GiB, other_processes=1)
    probe.calls = []
    guard = started_guard(probe)
    for _ in range(3):
        ticket, before, started = guard.begin()
        verdict, _, _, _ = guard.end(ticket, before, started)
        assert verdict.status == CLEAN and verdict.after.judged == 1 * GiB
        assert (verdict.after.device_used, verdict.after.device_total) == (4 * GiB, probe.total)


def test_beside_another_process_a_reading_after_a_task_reads_the_list_once():
    from prefect_gpu_dask.worker.probe import AfterSampler, process_sampler

    now = [0.0]
    probe = DeviceFirst(1 * GiB, others=3 * GiB, other_processes=1)
    reader = process_sampler(probe)
    reader._clock = lambda: now[0]
    after = AfterSampler(probe, clock=lambda: now[0], process=reader)
    reader()  # finds the other process
    for at in (5.0, 10.0, 10.5):  # tasks seconds apart, then one soon after
        now[0] = at
        lists, fulls = probe.process_reads, probe.full_reads
        assert after() == MemorySample(1 * GiB, 4 * GiB, probe.total)
        assert (probe.process_reads - lists, probe.full_reads - fulls) == (1, 0)


def test_a_reading_kept_while_alone_does_not_outlive_another_process_coming():
    from prefect_gpu_dask.worker.probe import process_sampler

    probe = DeviceFirst(1 * GiB, others=3 * GiB)
    read = process_sampler(probe)
    read(), read()  # kept: 4 GiB on the device, 1 GiB here
    probe.other_processes, probe.others = 1, 4 * GiB  # another process comes with 1 GiB
    assert read().judged == 1 * GiB
    # It leaves as this process takes 512 MiB no allocator knows of, and the driver's
    # own memory shrinks by as much: the device reads 4 GiB again.
    probe.other_processes, probe.others, probe.process = 0, 2.5 * GiB, 1.5 * GiB
    assert read().judged == 1.5 * GiB  # the list that shows it gone
    assert read().judged == 1.5 * GiB  # not the reading kept before it came


def test_mig_beside_other_processes_reads_the_list_once_a_second():
    from prefect_gpu_dask.worker.probe import process_sampler

    now = [0.0]
    probe = DeviceFirst(0, others=3 * GiB, other_processes=1)  # no context here yet
    read = process_sampler(probe)
    read._clock = lambda: now[0]
    assert read().judged == 0
    probe.process = -1  # the context made: memory no process list can attribute
    assert read() == MemorySample(-1, 3 * GiB, probe.total)
    lists = probe.process_reads
    for _ in range(10):
        read()
    assert probe.process_reads == lists
    now[0] = 1.5
    read(), read()
    assert probe.process_reads == lists + 1


@pytest.mark.parametrize(
    "mine, others, recycled",
    [(1 * GiB, 15 * GiB, False), (4 * GiB, 11 * GiB, True)],
    ids=["another process fills the GPU", "this worker fills it"],
)
def test_beside_another_process_the_memory_limit_recycles_only_for_this_workers_own(mine, others, recycled):
    now = [0.0]
    probe = DeviceFirst(1 * GiB, others=3 * GiB, other_processes=1)
    probe.calls = []
    guard = started_guard(probe)
    guard._read_after._clock = lambda: now[0]
    ticket, before, started = guard.begin()
    verdict, _, _, _ = guard.end(ticket, before, started)
    assert verdict.restart_reason is None and verdict.after.device_used == 4 * GiB
    probe.process, probe.owned, probe.others = mine, mine, others  # between tasks
    now[0] = 1.5  # the device's figure after a task is at most a second old
    ticket, before, started = guard.begin()
    verdict, _, _, _ = guard.end(ticket, before, started)
    assert verdict.status == CLEAN and verdict.after.device_used == mine + others
    assert (verdict.restart_reason or "").startswith("memory limit") == recycled
