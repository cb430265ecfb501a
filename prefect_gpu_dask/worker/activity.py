"""What a guarded task did with its GPU besides memory: SM utilisation, energy,
temperature and clock throttling, from NVML, on the worker that ran it.

Two of these readings are slow (the energy counter and the utilisation samples take
milliseconds a call, ``benchmarks/probes/nvml_activity_cost.py``), so a task's own
thread never makes them. One daemon thread per worker ("gpu-activity") reads them
while guarded tasks run: at once when a task starts, then every ``TICK_S``. A task's
energy is the counter's difference between the ticks inside it, stretched to its own
start and end by the power there. Its start and end readings (power, temperature,
throttle reasons) are the latest tick's while that is fresh; tasks too short to be
open when the thread looks keep them fresh by a glance at those cheap readings alone.
So in a stream of tasks, short ones too, the task thread makes no driver call at all;
only after a quiet spell does it read them itself (microseconds each).

``ActivityWatch`` is pure bookkeeping over an ``ActivityReader``: NVML on a GPU
(``NvmlActivity``), scripted answers in the tests.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from prefect_gpu_dask import nvml

logger = logging.getLogger(__name__)

TICK_S = 0.25
PROCESS, DEVICE = "process", "device"
# NVML clock event reasons that slow a GPU down (idle and application clocks do not).
THROTTLE_REASONS = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clock",
}


class Instant(NamedTuple):
    """The cheap readings, taken on the task thread as a task starts and ends."""

    time: float  # seconds since the epoch
    power_mw: int | None
    temperature_c: int | None
    reasons: int  # clock event reasons bitmask (0: unknown or none)


class Tick(NamedTuple):
    """The slow readings, taken on the activity thread."""

    time: float
    energy_mj: int | None  # the device's energy counter (None: not supported)
    temperature_c: int | None
    reasons: int
    utilization: tuple[tuple[float, int], ...]  # (time, SM %) samples since the last tick
    scope: str | None  # PROCESS: this process's samples; DEVICE: the whole GPU's
    power_mw: int | None = None
    device_utilization: int | None = None  # the whole GPU's latest SM %

    def instant(self, at: float) -> Instant:
        """These readings as a task's start or end at ``at``."""
        return Instant(at, self.power_mw, self.temperature_c, self.reasons)


class ActivityReader(Protocol):
    def instant(self) -> Instant: ...

    def tick(self) -> Tick: ...

    def device_utilization(self) -> int | None: ...


class Activity(NamedTuple):
    """One task's GPU activity, for its record (a tuple: one is made per task)."""

    sm_util_mean: float | None
    sm_util_peak: float | None
    util_scope: str | None
    energy_j: float | None
    temperature_peak_c: int | None
    throttle_reasons: tuple[str, ...]


@functools.cache  # a GPU shows few distinct masks, and every task asks
def throttle_names(reasons: int) -> tuple[str, ...]:
    if not reasons:
        return ()
    return tuple(name for bit, name in THROTTLE_REASONS.items() if reasons & bit)


@dataclass
class _Open:
    """What the ticks saw of one running task."""

    start: Instant
    first: tuple[float, int] | None = None  # (time, energy mJ) of the first tick inside it
    last: tuple[float, int] | None = None
    temperature_peak: int | None = None
    reasons: int = 0
    utilization: list[int] = field(default_factory=list)
    scope: str | None = None


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def judge(opened: _Open, end: Instant, device_utilization: int | None) -> Activity:
    """The activity of a task from what the ticks saw and its own start and end readings."""
    start = opened.start
    duration = max(end.time - start.time, 0.0)
    energy = None
    if opened.first is not None and opened.last is not None:
        (t0, e0), (t1, e1) = opened.first, opened.last
        before = (start.power_mw or 0) * max(t0 - start.time, 0.0)  # mJ
        after = (end.power_mw or 0) * max(end.time - t1, 0.0)
        energy = (e1 - e0 + before + after) / 1000
    elif start.power_mw is not None and end.power_mw is not None:
        energy = (start.power_mw + end.power_mw) / 2 * duration / 1000
    samples, scope = opened.utilization, opened.scope
    if not samples and device_utilization is not None:
        # A task shorter than the driver's sampling: the device's latest figure.
        samples, scope = [device_utilization], DEVICE
    temperature = _max(_max(start.temperature_c, end.temperature_c), opened.temperature_peak)
    return Activity(
        sm_util_mean=sum(samples) / len(samples) if samples else None,
        sm_util_peak=float(max(samples)) if samples else None,
        util_scope=scope if samples else None,
        energy_j=energy,
        temperature_peak_c=temperature,
        throttle_reasons=throttle_names(start.reasons | end.reasons | opened.reasons),
    )


class ActivityWatch:
    """Tracks the activity of every guarded task running on one worker's GPU."""

    def __init__(self, reader: ActivityReader, tick_s: float = TICK_S):
        self._reader = reader
        self._tick_s = tick_s
        self._open: dict[int, _Open] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._read_failed = False  # said once: the thread reads every tick
        self._started = threading.Event()  # a task started: tick now
        self._thread: threading.Thread | None = None
        self._last_tick = float("-inf")  # monotonic, of the last tick
        self._last_look = float("-inf")  # monotonic, of the last tick or glance
        self._glances = True  # False once a glance came without power: it keeps nothing fresh
        self._latest: tuple[float, Tick] | None = None  # (monotonic time, tick) with a power reading
        self._starts = 0  # tasks started so far: the thread tells a stream from a quiet spell

    @property
    def reader(self) -> ActivityReader:
        return self._reader

    def _fresh(self) -> Tick | None:
        """The latest tick, if it is recent enough to stand for a reading now."""
        latest = self._latest
        return latest[1] if latest is not None and time.monotonic() - latest[0] <= self._tick_s else None

    def _instant(self, fresh: Tick | None) -> Instant:
        return fresh.instant(time.time()) if fresh is not None else self._reader.instant()

    def start(self, ticket: int) -> None:
        try:
            start = self._instant(self._fresh())
        except nvml.READ_ERRORS:  # activity is a bonus: never fail a task for it
            return
        with self._lock:
            self._open[ticket] = _Open(start)
            self._starts += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpu-activity", daemon=True)
            self._thread.start()
        # Waking the thread costs the task thread the GIL handoff: only when its last
        # tick is old enough that a new one would be taken at once (a glance is no tick:
        # a task that runs on gets its first tick as soon as after any other start).
        if time.monotonic() - self._last_tick > self._tick_s / 5 and not self._started.is_set():
            self._started.set()
        if not self._wake.is_set():
            self._wake.set()

    def stop(self, ticket: int) -> Activity | None:
        with self._lock:  # the thread goes idle by itself: see PeakSampler.stop
            opened = self._open.pop(ticket, None)
        if opened is None:
            return None
        try:
            fresh = self._fresh()
            end = self._instant(fresh)
            device = None
            if not opened.utilization:
                device = fresh.device_utilization if fresh is not None else None
                device = device if device is not None else self._reader.device_utilization()
        except nvml.READ_ERRORS:
            return None
        return judge(opened, end, device)

    def _run(self) -> None:
        seen = 0  # self._starts at the last look
        while True:
            self._wake.wait()
            if not self._started.is_set():
                self._started.wait(self._tick_s)
            # A start ticks at once, but never sooner than this after the last reading:
            # a stream of short tasks must not keep the thread reading.
            time.sleep(max(0.0, self._last_look + self._tick_s / 5 - time.monotonic()))
            self._started.clear()
            with self._lock:
                busy, streaming, seen = bool(self._open), self._starts != seen, self._starts
                if not busy and not (streaming and self._glances):
                    self._wake.clear()  # start() sets it again after adding its task
                    continue
            self._last_look = time.monotonic()
            if busy:
                self._last_tick = self._last_look
            try:
                # Tasks shorter than the look between ticks are rarely open when it comes:
                # a glance keeps the readings their starts and ends take fresh.
                tick = self._reader.tick() if busy else self._glance()
            except Exception as exc:  # the thread's loop: a failing read must never end it
                if not self._read_failed:
                    self._read_failed = True
                    logger.warning("GPU activity not readable (%r): task records go without it", exc)
                time.sleep(self._tick_s)
                continue
            # Without power (a failed read), a task reads its own start and end instead.
            self._latest = (time.monotonic(), tick) if tick.power_mw is not None else None
            if not busy and tick.power_mw is None:
                self._glances = False
            with self._lock:
                for opened in self._open.values():
                    self._see(opened, tick)

    def _glance(self) -> Tick:
        """The readings a task's start and end take, without the slow ones."""
        now = self._reader.instant()
        try:
            device = self._reader.device_utilization()
        except nvml.READ_ERRORS:
            device = None
        return Tick(now.time, None, now.temperature_c, now.reasons, (), None, now.power_mw, device)

    @staticmethod
    def _see(opened: _Open, tick: Tick) -> None:
        if tick.energy_mj is not None and tick.time >= opened.start.time:
            if opened.first is None:
                opened.first = (tick.time, tick.energy_mj)
            opened.last = (tick.time, tick.energy_mj)
        opened.temperature_peak = _max(opened.temperature_peak, tick.temperature_c)
        opened.reasons |= tick.reasons
        for sampled_at, percent in tick.utilization:
            if sampled_at >= opened.start.time:
                opened.utilization.append(percent)
                opened.scope = tick.scope


class NvmlActivity:
    """``ActivityReader`` over NVML for one GPU and one process (``nvml``'s readers: a
    reading the GPU does not support is None; one that fails fails the whole reading,
    which ``ActivityWatch`` goes without)."""

    def __init__(self, handle: Any, pid: int):
        self._handle = handle
        self._pid = pid
        self._seen_us = int(time.time() * 1e6)
        self._scope: str | None = PROCESS

    def instant(self) -> Instant:
        handle = self._handle
        return Instant(
            time.time(),
            nvml.power_mw(handle),
            nvml.temperature_c(handle),
            int(nvml.clock_event_reasons(handle) or 0),
        )

    def device_utilization(self) -> int | None:
        return nvml.utilization_percent(self._handle)

    def _utilization(self) -> tuple[tuple[tuple[float, int], ...], str | None]:
        import pynvml

        since, self._seen_us = self._seen_us, int(time.time() * 1e6)
        if self._scope == PROCESS:
            try:
                samples = nvml.process_utilization(self._handle, since)
            except pynvml.NVMLError:  # e.g. no permission: the whole GPU's figures instead
                samples = None
            if samples is not None:
                mine = tuple((at, percent) for at, pid, percent in samples if pid == self._pid)
                return mine or ((self._seen_us / 1e6, 0),), PROCESS  # none: this process was idle
            self._scope = DEVICE  # per-process figures not supported here (MIG, vGPU)
        device_samples = nvml.utilization_samples(self._handle, since)
        return ((), None) if device_samples is None else (tuple(device_samples), DEVICE)

    def tick(self) -> Tick:
        utilization, scope = self._utilization()
        now = self.instant()
        return Tick(
            now.time,
            nvml.energy_mj(self._handle),
            now.temperature_c,
            now.reasons,
            utilization,
            scope,
            now.power_mw,
            self.device_utilization(),
        )
