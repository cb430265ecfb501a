"""A task's GPU activity (utilisation, energy, temperature, throttling) from scripted
NVML answers: the bookkeeping, not the driver."""

from __future__ import annotations

import threading
import time

import pytest

from prefect_gpu_dask.worker.activity import (
    DEVICE,
    PROCESS,
    Activity,
    ActivityWatch,
    Instant,
    Tick,
    _Open,
    judge,
)


def test_energy_is_the_counter_between_ticks_stretched_to_the_task_by_its_power():
    opened = _Open(Instant(100.0, 300_000, 50, 0), first=(100.1, 1_000_000), last=(101.9, 1_540_000))
    activity = judge(opened, Instant(102.0, 300_000, 55, 0), device_utilization=None)
    # 540 J between the ticks, 0.1 s at 300 W before the first and after the last.
    assert activity.energy_j == pytest.approx(540 + 30 + 30)
    assert activity.temperature_peak_c == 55


def test_a_task_between_two_ticks_gets_its_power_times_its_time_and_the_device_utilisation():
    start, end = Instant(5.0, 100_000, 40, 0), Instant(5.5, 300_000, 41, 0x40)
    activity = judge(_Open(start), end, device_utilization=12)
    assert activity.energy_j == pytest.approx(0.5 * 200)  # mean power, watts x seconds
    assert (activity.sm_util_mean, activity.sm_util_peak, activity.util_scope) == (12, 12, DEVICE)
    assert activity.throttle_reasons == ("hw_thermal",)


def test_idle_application_clocks_are_not_throttling():
    idle = Instant(0.0, None, None, 0x1 | 0x2)  # GPU idle, application clocks
    activity = judge(_Open(idle, reasons=0x4), Instant(1.0, None, None, 0), None)
    assert activity.throttle_reasons == ("sw_power_cap",)
    assert activity.energy_j is None and activity.sm_util_mean is None and activity.util_scope is None


class Reader:
    """Power 250 W; the SMs of this process 90 % busy; the energy counter runs with time."""

    def __init__(self) -> None:
        self.ticks = 0

    def instant(self) -> Instant:
        return Instant(time.time(), 250_000, 60, 0)

    def tick(self) -> Tick:
        self.ticks += 1
        now = time.time()
        return Tick(now, int(250_000 * now), 70, 0x8, ((now, 90),), PROCESS)

    def device_utilization(self) -> int:
        raise AssertionError("process samples were there: the device figure is not read")


def test_the_watch_ticks_while_a_task_runs_and_judges_it_when_it_ends():
    reader = Reader()
    watch = ActivityWatch(reader, tick_s=0.05)
    started = time.time()
    watch.start(1)
    time.sleep(0.5)
    activity = watch.stop(1)
    took = time.time() - started  # the sleep may overrun on a busy machine
    assert reader.ticks >= 5
    assert activity.energy_j == pytest.approx(took * 250, rel=0.1)
    assert (activity.sm_util_mean, activity.sm_util_peak, activity.util_scope) == (90, 90, PROCESS)
    assert activity.temperature_peak_c == 70 and activity.throttle_reasons == ("hw_slowdown",)
    ticks = reader.ticks
    time.sleep(0.2)
    assert reader.ticks <= ticks + 1  # no task open: the thread stops reading


class CountingReader(Reader):
    """``Reader`` that counts the readings a task thread takes itself."""

    def __init__(self) -> None:
        super().__init__()
        self.instants = 0

    def instant(self) -> Instant:
        self.instants += 1
        return super().instant()


def test_a_tick_without_power_leaves_the_readings_to_the_task_thread():
    class NoPower(CountingReader):
        def device_utilization(self) -> int:
            return 12

    reader = NoPower()  # its ticks carry no power reading
    watch = ActivityWatch(reader, tick_s=1.0)
    watch.start(1)
    deadline = time.monotonic() + 5
    while reader.ticks == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.start(2)
    activity = watch.stop(2)
    assert reader.instants == 3 and activity.energy_j is not None
    watch.stop(1)


def test_a_reader_that_fails_never_fails_the_task():
    class Broken(Reader):
        def instant(self) -> Instant:
            raise OSError("NVML went away")

    watch = ActivityWatch(Broken(), tick_s=0.05)
    watch.start(1)
    assert watch.stop(1) is None


def test_while_a_tick_is_fresh_the_task_thread_reads_nothing_itself():
    class Counting(CountingReader):
        def tick(self) -> Tick:
            tick = super().tick()
            return tick._replace(power_mw=100_000, device_utilization=33)  # the reader says 250 W

    reader = Counting()
    watch = ActivityWatch(reader, tick_s=1.0)
    watch.start(1)  # nothing read yet: the task thread reads its start itself
    deadline = time.monotonic() + 5
    while watch._fresh() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reader.instants == 1 and reader.ticks >= 1
    started = time.perf_counter()
    watch.start(2)
    time.sleep(0.1)
    activity = watch.stop(2)
    took = time.perf_counter() - started
    assert reader.instants == 1  # start, end and utilisation all from the fresh tick
    assert activity.energy_j == pytest.approx(took * 100, rel=0.1)  # the tick's 100 W
    assert activity.temperature_peak_c == 70 and activity.throttle_reasons == ("hw_slowdown",)
    assert (activity.sm_util_mean, activity.util_scope) == (33, DEVICE)  # no tick inside it
    watch.stop(1)


class CountingEvent(threading.Event):
    """An event that counts how often it is set: each set of a clear one wakes its waiter."""

    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


def test_a_stream_of_tasks_does_not_wake_the_thread_for_each_one():
    class Streaming(Reader):
        def device_utilization(self) -> int:
            return 0  # a task shorter than a tick reads the device figure at its end

    reader = Streaming()
    watch = ActivityWatch(reader, tick_s=1.0)
    watch._wake = wake = CountingEvent()
    for ticket in range(200):
        watch.start(ticket)
        watch.stop(ticket)
    # The thread goes idle by itself, once per tick at most: not once per task.
    assert wake.sets <= 3, wake.sets
    deadline = time.monotonic() + 5
    while wake.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not wake.is_set()  # no task open: it went idle
    ticks = reader.ticks
    time.sleep(0.3)
    assert reader.ticks == ticks
    watch.start(1000)  # and a new task wakes it again
    while reader.ticks == ticks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reader.ticks > ticks
    watch.stop(1000)


class ThreadCountingReader(Reader):
    """``Reader`` that counts the readings task threads (not the watch's own) take."""

    def __init__(self) -> None:
        super().__init__()
        self.on_task_threads = 0

    def instant(self) -> Instant:
        if threading.current_thread().name != "gpu-activity":
            self.on_task_threads += 1
        return super().instant()

    def device_utilization(self) -> int:
        if threading.current_thread().name != "gpu-activity":
            self.on_task_threads += 1
        return 33


def stream(watch: ActivityWatch, seconds: float, first: int = 0) -> tuple[int, Activity]:
    """Tasks open for microseconds, 2 ms apart, for ``seconds``; how many, and the last one's."""
    ticket, until = first, time.monotonic() + seconds
    while time.monotonic() < until:
        watch.start(ticket)
        activity = watch.stop(ticket)
        ticket += 1
        time.sleep(0.002)
    return ticket - first, activity


def test_a_stream_of_tasks_too_short_to_be_seen_open_reads_nothing_on_the_task_thread():
    reader = ThreadCountingReader()
    watch = ActivityWatch(reader, tick_s=1.0)
    stream(watch, 0.05)  # until the thread's first glance, tasks read for themselves
    deadline = time.monotonic() + 5
    while watch._fresh() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    read_before = reader.on_task_threads
    tasks, activity = stream(watch, 1.0, first=10_000)
    assert reader.on_task_threads - read_before <= 2, (reader.on_task_threads - read_before, tasks)
    assert reader.ticks == 0  # no task was open when the thread looked: glances only
    assert (activity.sm_util_mean, activity.util_scope) == (33, DEVICE)
    assert activity.energy_j is not None and activity.temperature_peak_c == 60


def test_a_task_that_runs_on_after_a_stream_is_ticked_at_once():
    reader = ThreadCountingReader()
    watch = ActivityWatch(reader, tick_s=0.25)
    stream(watch, 0.3)
    watch.start(-1)  # runs on: its first tick comes as soon as after any other start
    time.sleep(0.15)
    activity = watch.stop(-1)
    assert reader.ticks >= 1
    assert (activity.sm_util_mean, activity.util_scope) == (90, PROCESS)
