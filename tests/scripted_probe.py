"""A memory probe for CPU-only machines: "device memory" is the bytes held by live FakeBlocks.

It behaves like a GPU allocator where it matters to the guard: a block kept in a global
is a leak (the "allocator" says it is still handed out); a block left in unreachable
garbage (a reference cycle) is freed only when the guard's cache release runs
``gc.collect()``, just as a pool keeps freed blocks until ``free_all_blocks()``; a
block made by ``native`` is outside the allocator, as a library's handles and
workspaces are.
"""

from __future__ import annotations

import itertools
import json
import os
import time
import weakref
from pathlib import Path

from prefect_gpu_dask.health import HealthReadings
from prefect_gpu_dask.worker.activity import Instant, Tick
from prefect_gpu_dask.worker.probe import AllocatorBytes, GPUIdentity, MemorySample

TOTAL = 16 * 2**30
LEAKED: list[FakeBlock] = []
# The runner's memory_probe for tests: workers import it by this path.
FAKE_PROBE = "tests.scripted_probe:fake_probe"
SM_FILE_ENV = "FAKE_GPU_SM_FILE"  # a file whose number is the scripted GPU's SM % now
# A directory where ``<worker name>.json`` holds that worker's GPU health readings
# (``HealthReadings`` fields); no file: healthy.
HEALTH_DIR_ENV = "FAKE_GPU_HEALTH_DIR"


class FakeBlock:
    """Device memory held while the block lives. Probes read the sizes alone: a reader
    that held the blocks themselves, even for a moment on another thread, would keep
    garbage alive through the guard's ``gc.collect()`` and make a cache look like a leak."""

    sizes: dict[int, tuple[int, bool]] = {}  # live block's serial -> (bytes, pooled)
    _serials = itertools.count()

    def __init__(self, nbytes: int, pooled: bool = True):
        self.nbytes = nbytes
        self.pooled = pooled
        serial = next(FakeBlock._serials)
        FakeBlock.sizes[serial] = (nbytes, pooled)
        weakref.finalize(self, FakeBlock.sizes.pop, serial, None)

    @staticmethod
    def held() -> list[tuple[int, bool]]:
        return list(FakeBlock.sizes.values())  # one C call: no thread changes it meanwhile


class FakeDeviceProbe:
    gpu = GPUIdentity(0, "GPU-00000000-fake-0000-0000-000000000000", "NVIDIA FakeGPU G1", TOTAL)

    def sample(self) -> MemorySample:
        used = sum(nbytes for nbytes, _ in FakeBlock.held())
        return MemorySample(used, used, TOTAL)

    def sample_device(self) -> tuple[int, int]:
        """As NVML's device figure: a leak or a free moves it (``probe.ProcessReader``)."""
        return sum(nbytes for nbytes, _ in FakeBlock.held()), TOTAL

    def sample_process_and_others(self) -> tuple[MemorySample, int]:
        return self.sample(), 0  # each worker process has a scripted GPU of its own

    def allocator_bytes(self) -> AllocatorBytes:
        return AllocatorBytes(owned=sum(nbytes for nbytes, pooled in FakeBlock.held() if pooled))

    def activity_reader(self) -> ScriptedActivity:
        return ScriptedActivity()

    def health_reader(self) -> ScriptedHealth:
        from distributed import Worker

        [worker] = list(Worker._instances)
        return ScriptedHealth(str(worker.name))


class ScriptedHealth:
    """Health readings a test writes to ``$FAKE_GPU_HEALTH_DIR/<worker name>.json``."""

    limits = ()

    def __init__(self, worker_name: str):
        self.path = Path(os.environ.get(HEALTH_DIR_ENV, "/nonexistent")) / f"{worker_name}.json"

    def __call__(self) -> HealthReadings:
        return HealthReadings(FakeDeviceProbe.gpu.uuid, **scripted_readings(self.path))


def scripted_readings(path: Path) -> dict[str, object]:
    """The ``HealthReadings`` fields a test wrote to ``path`` (none: healthy)."""
    try:
        values = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    if "xid_events" in values:
        values["xid_events"] = tuple(values["xid_events"])
    return values


class ScriptedActivity:
    """A GPU that draws a steady ``POWER_W``, is ``SM_PERCENT`` busy with this process's
    work, runs at ``TEMPERATURE_C`` and is held back by its software power cap."""

    POWER_W = 200
    SM_PERCENT = 37
    TEMPERATURE_C = 61
    REASONS = 0x4  # sw_power_cap

    def __init__(self) -> None:
        self.origin = time.time()

    def instant(self) -> Instant:
        return Instant(time.time(), self.POWER_W * 1000, self.TEMPERATURE_C, self.REASONS)

    def tick(self) -> Tick:
        now = time.time()
        energy_mj = int(self.POWER_W * 1000 * (now - self.origin))
        return Tick(now, energy_mj, self.TEMPERATURE_C, self.REASONS, ((now, self.SM_PERCENT),), "process")

    def device_utilization(self) -> int:
        """``SM_PERCENT``, or what ``$FAKE_GPU_SM_FILE`` says when a test writes one."""
        path = os.environ.get(SM_FILE_ENV)
        if path:
            try:
                return int(Path(path).read_text())
            except (OSError, ValueError):
                pass
        return self.SM_PERCENT


def make_sick(directory: Path, worker_name: str, **readings: object) -> None:
    """Script ``worker_name``'s GPU to read as ``readings`` from its next check on."""
    (directory / f"{worker_name}.json").write_text(json.dumps(readings))


def fake_probe() -> FakeDeviceProbe | None:
    """The fake GPU, on workers started with a ``GPU`` resource; None (no GPU) elsewhere."""
    from distributed import Worker

    workers = list(Worker._instances)  # plugins' setup runs outside any task: no get_worker()
    if len(workers) == 1 and not workers[0].state.total_resources.get("GPU"):
        return None
    return FakeDeviceProbe()


def leak(nbytes: int) -> None:
    LEAKED.append(FakeBlock(nbytes))


_NATIVE_DONE: set[str] = set()


def native_once(name: str, nbytes: int) -> None:
    """Grow ``nbytes`` outside the allocator, once per process and ``name``: what a
    library's first use leaves behind (handles, workspaces, loaded kernels)."""
    if name not in _NATIVE_DONE:
        _NATIVE_DONE.add(name)
        LEAKED.append(FakeBlock(nbytes, pooled=False))


def native(nbytes: int) -> None:
    """Grow ``nbytes`` outside the allocator every time: a leak no allocator can see."""
    LEAKED.append(FakeBlock(nbytes, pooled=False))


def churn(nbytes: int) -> None:
    """Leave ``nbytes`` in cyclic garbage: freed only by a collection."""
    import gc

    gc.disable()  # the worker's own collections must not beat the guard to it
    block = FakeBlock(nbytes)
    block.cycle = block
    del block


class ScriptedProbe:
    """Returns the given samples in order (the last one repeats).

    Its allocator hands out everything the last sample shows except ``outside`` bytes
    (what a library holds beyond any allocator) and ``cached`` free pool blocks.
    """

    gpu = GPUIdentity(3, "GPU-scripted")

    def __init__(
        self,
        *process_bytes: int,
        device_used: int | None = None,
        total: int = TOTAL,
        outside: int = 0,
        cached: int = 0,
    ):
        self.samples = list(process_bytes)
        self.device_used = device_used
        self.total = total
        self.outside = outside
        self.cached = cached
        self.reads = 0
        self.last = 0

    def sample(self) -> MemorySample:
        value = self.samples[min(self.reads, len(self.samples) - 1)]
        self.reads += 1
        self.last = max(value, 0)
        used = self.device_used if self.device_used is not None else max(value, 0)
        return MemorySample(value, used, self.total)

    def allocator_bytes(self) -> AllocatorBytes:
        return AllocatorBytes(self.cached, max(0, self.last - self.outside - self.cached))
