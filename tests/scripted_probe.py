"""A memory probe for CPU-only machines: "device memory" is the bytes held by live FakeBlocks.

It behaves like a GPU allocator where it matters to the guard: a block kept in a global
is a leak; a block left in unreachable garbage (a reference cycle) is freed only when
the guard's cache release runs ``gc.collect()``, just as a pool keeps freed blocks
until ``free_all_blocks()``.
"""

from __future__ import annotations

import weakref

from prefect_gpu_dask.probe import GPUIdentity, MemorySample

TOTAL = 16 * 2**30
LEAKED: list[FakeBlock] = []
# The runner's memory_probe for tests: workers import it by this path.
FAKE_PROBE = "tests.scripted_probe:fake_probe"


class FakeBlock:
    live: weakref.WeakSet[FakeBlock] = weakref.WeakSet()

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        FakeBlock.live.add(self)


class FakeDeviceProbe:
    gpu = GPUIdentity(0, "GPU-00000000-fake-0000-0000-000000000000")

    def sample(self) -> MemorySample:
        used = sum(block.nbytes for block in list(FakeBlock.live))
        return MemorySample(used, used, TOTAL)


def fake_probe() -> FakeDeviceProbe:
    return FakeDeviceProbe()


def leak(nbytes: int) -> None:
    LEAKED.append(FakeBlock(nbytes))


def churn(nbytes: int) -> None:
    """Leave ``nbytes`` in cyclic garbage: freed only by a collection."""
    import gc

    gc.disable()  # the worker's own collections must not beat the guard to it
    block = FakeBlock(nbytes)
    block.cycle = block
    del block


class ScriptedProbe:
    """Returns the given samples in order (the last one repeats)."""

    gpu = GPUIdentity(3, "GPU-scripted")

    def __init__(self, *process_bytes: int, device_used: int | None = None, total: int = TOTAL):
        self.samples = list(process_bytes)
        self.device_used = device_used
        self.total = total
        self.reads = 0

    def sample(self) -> MemorySample:
        value = self.samples[min(self.reads, len(self.samples) - 1)]
        self.reads += 1
        used = self.device_used if self.device_used is not None else max(value, 0)
        return MemorySample(value, used, self.total)
