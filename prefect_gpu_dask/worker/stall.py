"""Stalled ``gpu`` tasks: stuck with no ``timeout_seconds`` to end them.

A task is stalled when, for its flow run's ``stall_s``, all of these held at every
look: its thread stayed at one point of one call (the innermost Python frame and its
last instruction), that thread used no CPU (the kernel's count for it), and its GPU did
no work (no SM activity on the GPU, no change in the process's GPU memory). A long
kernel keeps the GPU busy and a Python loop moves and burns CPU, so neither is ever
stalled; a thread waiting on an event, a lock or a dead peer, with an idle GPU, is.

One background thread per worker looks at every watched task (``StallWatch``), about
four times per ``stall_s``. A stall is reported once per task run, as a ``HungTask``
with ``stalled=True`` on the worker's event stream: the flow logs a WARNING and emits a
Prefect event, and with ``on_stall="fail"`` also ends the run ``TimedOut`` and recycles
the worker (the hung-task path, ``flow.recycling``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from prefect_gpu_dask import nvml
from prefect_gpu_dask.records import HungTask

logger = logging.getLogger(__name__)

CPU_IDLE_SHARE = 0.02  # of the time between looks: less CPU than this is no progress
MIN_LOOK_S = 0.05
MAX_LOOK_S = 5.0


@dataclass(frozen=True)
class Look:
    """What one look saw of a watched task."""

    position: tuple[int, int] | None  # (id of the innermost frame's code, its last instruction)
    cpu_s: float | None  # the thread's CPU time so far; None where the kernel does not say
    memory: int | None  # the process's GPU memory
    gpu_busy: bool


def progressed(before: Look, now: Look, elapsed_s: float) -> bool:
    """Whether the task showed any sign of work between two looks."""
    if now.gpu_busy or now.position != before.position or now.memory != before.memory:
        return True
    if now.cpu_s is not None and before.cpu_s is not None:
        return now.cpu_s - before.cpu_s > CPU_IDLE_SHARE * elapsed_s
    return False


def thread_cpu_s(native_id: int) -> float | None:
    """A thread of this process's CPU time (user + system), from ``/proc``."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def position_of(ident: int) -> tuple[int, int] | None:
    frame = sys._current_frames().get(ident)
    return None if frame is None else (id(frame.f_code), frame.f_lasti)


@dataclass
class _Watched:
    thread: threading.Thread
    stall_s: float
    hung: HungTask
    last: Look
    last_at: float
    still_since: float
    reported: bool = False


class StallWatch:
    """Watches the running tasks of one worker that asked for ``stall_s``.

    ``read_memory``: the process's GPU memory; ``read_busy``: whether the GPU is doing
    work now; ``report``: called once with each stalled task's ``HungTask``.
    """

    def __init__(
        self,
        read_memory: Callable[[], int | None],
        read_busy: Callable[[], bool],
        report: Callable[[HungTask], None],
    ):
        self._read_memory = read_memory
        self._read_busy = read_busy
        self._report = report
        self._watched: dict[int, _Watched] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, ticket: int, stall_s: float, hung: HungTask) -> None:
        """From the task's own thread, as it starts."""
        now = time.monotonic()
        look = self._look(threading.current_thread())
        with self._lock:
            self._watched[ticket] = _Watched(threading.current_thread(), stall_s, hung, look, now, now)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpu-stall-watch", daemon=True)
            self._thread.start()
        self._wake.set()

    def unwatch(self, ticket: int) -> None:
        with self._lock:
            self._watched.pop(ticket, None)

    def _look(self, thread: threading.Thread) -> Look:
        try:
            memory = self._read_memory()
        except nvml.READ_ERRORS:  # a reading that fails is no sign either way
            memory = None
        try:
            busy = self._read_busy()
        except nvml.READ_ERRORS:
            busy = True  # unknown: never call a task stalled on a guess
        cpu = thread_cpu_s(thread.native_id) if thread.native_id is not None else None
        return Look(position_of(thread.ident or 0), cpu, memory, busy)

    def _run(self) -> None:
        while True:
            with self._lock:
                watched = list(self._watched.values())
            if not watched:
                self._wake.clear()
                self._wake.wait()
                continue
            time.sleep(min(MAX_LOOK_S, max(MIN_LOOK_S, min(w.stall_s for w in watched) / 4)))
            for w in watched:
                try:
                    self._check(w)
                except Exception:  # a failing look must never break the worker
                    logger.exception("Looking for a stalled task failed")

    def _check(self, w: _Watched) -> None:
        now = time.monotonic()
        look = self._look(w.thread)
        if progressed(w.last, look, now - w.last_at):
            w.still_since = now
        w.last, w.last_at = look, now
        if w.reported or now - w.still_since < w.stall_s:
            return
        w.reported = True
        stalled_s = round(now - w.still_since, 1)
        logger.warning(
            "Task run %r is stalled: in one call with no CPU and no GPU work for %.1f s (stall_s=%g)",
            w.hung.task_run_name,
            stalled_s,
            w.stall_s,
        )
        self._report(replace(w.hung, running_s=stalled_s))
