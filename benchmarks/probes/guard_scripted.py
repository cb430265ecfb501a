"""The guard's own cost, without a driver: ``begin()`` + ``end()`` around an empty task
and its activity record's start + stop, with every reading scripted to answer at once,
so what is left is Python and the guard's threads. Runs on any machine; for an A/B, put
another tree's package first on the path:

    python benchmarks/probes/guard_scripted.py
    PYTHONPATH=/path/to/older/tree python benchmarks/probes/guard_scripted.py
"""

import asyncio
import os
import statistics
import sys

# Appended: a tree named in PYTHONPATH comes first, for an A/B.
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.common import p95, runs_of  # noqa: E402
from prefect_gpu_dask.settings import RunnerSettings  # noqa: E402
from prefect_gpu_dask.worker.guard import GPUMemoryGuard  # noqa: E402
from prefect_gpu_dask.worker.probe import AllocatorBytes, GPUIdentity, MemorySample  # noqa: E402
from tests.scripted_probe import ScriptedActivity  # noqa: E402

SAMPLES = 5000


class InstantProbe:
    """Answers every reading at once: a GPU whose driver costs nothing."""

    gpu = GPUIdentity(0, "GPU-instant", "scripted", 2**34)

    def sample(self) -> MemorySample:
        return MemorySample(100, 1000, 2**34)

    def sample_process(self) -> MemorySample:
        return MemorySample(100, 0, 0)

    def allocator_bytes(self) -> AllocatorBytes:
        return AllocatorBytes(0, 100)

    def activity_reader(self) -> ScriptedActivity:
        return ScriptedActivity()


def instant_probe() -> InstantProbe:
    return InstantProbe()


class Worker:
    address, name = "probe", "probe"

    def log_event(self, topic: str, msg: object) -> None:
        pass


def median_us(step, samples: int = SAMPLES) -> tuple[float, float]:
    costs = runs_of(step, samples)
    return statistics.median(costs) * 1e6, p95(costs) * 1e6


if __name__ == "__main__":
    import prefect_gpu_dask

    print(f"# package: {os.path.dirname(prefect_gpu_dask.__file__)}; {os.cpu_count()} cores")
    guard = GPUMemoryGuard(RunnerSettings(health_check_s=None, memory_probe=f"{__name__}:instant_probe"))
    asyncio.run(guard.setup(Worker()))
    watch = guard.activity
    tickets = iter(range(-1, -(10**9), -1))

    def begin_end() -> None:
        ticket, before, started = guard.begin()
        guard.end(ticket, before, started)

    def activity() -> None:
        ticket = next(tickets)
        watch.start(ticket)
        watch.stop(ticket)

    for round_ in range(1, 4):
        guard_us, guard_p95 = median_us(begin_end)
        activity_us, _ = median_us(activity)
        print(
            f"round {round_}: begin()+end() median {guard_us:.1f} µs (p95 {guard_p95:.1f}),"
            f" activity start+stop {activity_us:.1f} µs"
        )
