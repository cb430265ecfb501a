"""The restart path on a worker: drain, resume, wait for a dead process's GPU memory,
and refuse a task run whose previous worker died running it.

Two doors: the guard hands each record to its ``WorkerRecycling`` (which drains the
worker when the record asks for a restart, and, in a replacement, holds tasks off until
the old process's GPU memory is gone); a task run passes ``admit`` before Prefect's
engine starts. The flow's ``Recycler`` calls ``drain`` and ``resume`` on the
worker's event loop through ``client.run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from distributed.core import Status

if TYPE_CHECKING:
    from prefect import Task
    from prefect.client.schemas.objects import State
from prefect_gpu_dask._compat import current_worker
from prefect_gpu_dask.errors import WorkerDiedError, died_running, worker_died_message
from prefect_gpu_dask.records import (
    ENDED_TOPIC,
    INTERRUPTED,
    RESULT_LOST,
    STARTED_THERE,
    STARTED_TOPIC,
    TaskRecord,
)
from prefect_gpu_dask.worker.taskwrap import refused, with_around

logger = logging.getLogger(__name__)

# A drained worker whose flow never restarts it (the flow ended, restart="never"
# elsewhere) takes tasks again after this long.
DRAIN_EXPIRY_S = 120.0
RELEASE_WAIT_S = 15.0
# How long a task run whose result was lost with its worker waits for Prefect's API to
# hear how it ended (its final state travels as an event, late on a busy server).
LOST_RESULT_WAIT_S = 10.0
LOST_RESULT_POLL_S = 0.25
ANNOUNCE_TIMEOUT_S = 30.0  # for the scheduler to answer that it heard a task run start
# Worker-side states of tasks assigned to this worker that have not started running.
NOT_STARTED = {"waiting", "ready", "constrained"}

_drains: weakref.WeakKeyDictionary[Any, object] = weakref.WeakKeyDictionary()


def drain(dask_worker: Any, expiry_s: float = DRAIN_EXPIRY_S) -> dict[str, Any]:
    """Stop a worker from starting tasks; say what it still runs and what never started.

    The worker reports ``closing_gracefully``, as in ``retire_workers``: the scheduler
    sends it nothing new, tasks already queued there wait, running ones finish, and it
    still serves its results. Unlike ``paused``, the memory monitor never undoes it.
    Each call re-arms the expiry: a drain ends by itself only once nobody asks for it.
    """
    if dask_worker.status in (Status.running, Status.paused) or dask_worker in _drains:
        if dask_worker.status != Status.closing_gracefully:
            dask_worker.status = Status.closing_gracefully
        token = _drains[dask_worker] = object()
        dask_worker.loop.call_later(expiry_s, _expire_drain, dask_worker, token)
    state = dask_worker.state
    return {
        "running": len(state.executing) + len(state.long_running),
        "not_started": [ts.key for ts in state.tasks.values() if ts.state in NOT_STARTED],
    }


def resume(dask_worker: Any) -> None:
    """Undo our ``drain`` (never a ``retire_workers`` someone else started)."""
    if _drains.pop(dask_worker, None) is not None and dask_worker.status == Status.closing_gracefully:
        dask_worker.status = Status.running


def _expire_drain(dask_worker: Any, token: object) -> None:
    if _drains.get(dask_worker) is token:
        logger.warning("Worker %s was drained for a restart that never came: resuming", dask_worker.address)
        resume(dask_worker)


class WorkerRecycling:
    """One worker's part of the restart path, as its guard sees it."""

    def __init__(self, worker: Any, policy: str):
        self.worker = worker
        self.policy = policy
        self.memory_released_at: float | None = None  # wall clock, once a dead worker's memory was gone

    async def wait_for_predecessor(self, probe: Any) -> None:
        """In a replacement's guard setup: hold its tasks off until the GPU memory of the
        process it replaces is gone (where ``probe`` can list the GPU's processes)."""
        pids = getattr(probe, "process_pids", None)
        if pids is not None:
            await wait_for_released_memory(pids)
            self.memory_released_at = time.time()

    def hand(self, record: TaskRecord, quarantined: bool, policy: str | None = None) -> None:
        """A guarded task's record, under ``policy`` (its flow run's ``restart``). One
        that asks for a restart (``restart="worker"``, the GPU not quarantined) drains
        the worker: it starts nothing new from now on, and the flow restarts it once
        what it runs has finished. Queued before the task returns, so the next task
        waiting for its slot never starts here."""
        if record.restart_reason and (policy or self.policy) == "worker" and not quarantined:
            self.worker.loop.add_callback(drain, self.worker)


async def wait_for_released_memory(pids: Callable[[], list[int]], timeout_s: float = RELEASE_WAIT_S) -> float:
    """Hold a new worker's tasks off until dead processes' GPU memory is gone.

    The driver frees a killed process's memory asynchronously; a new worker that
    allocates before then can OOM (dask-cuda #859, #1075). Returns the seconds waited.
    """
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if all(os.path.exists(f"/proc/{pid}") for pid in pids()):
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    logger.warning("GPU memory of a previous worker was not released in %.0f s", timeout_s)
    return time.monotonic() - started


def _marks() -> tuple[Any, dict[str, Any]]:
    """The current task's key and the annotations the scheduler sent with it."""
    worker = current_worker()
    try:
        key = worker.get_current_task()
        ts = worker.state.tasks.get(key)
    except (AttributeError, KeyError):  # not in a task (or outside any worker)
        return None, {}
    return key, (ts.annotations or {}) if ts is not None else {}


def announce_start() -> tuple[str | None, bool]:
    """In a task: tell the scheduler this task run is starting on this worker
    (``InterruptedTasks`` remembers it until the task leaves the worker), and wait until
    it has heard. Returns the worker that died running this task before, if any, and
    whether that worker had started it (rather than only queued it)."""
    heard, dead, started_there = _start_notice()
    heard()
    return dead, started_there


def _start_notice() -> tuple[Callable[[], None], str | None, bool]:
    """Send this task's start notice; returns a wait for the scheduler's answer, and
    ``announce_start``'s two marks."""
    key, marks = _marks()
    heard = _tell_scheduler(current_worker(), key) if isinstance(key, str) else _nothing_to_hear
    return heard, marks.get(INTERRUPTED), bool(marks.get(STARTED_THERE))


def _nothing_to_hear() -> None:
    return None


def _tell_scheduler(worker: Any, key: str) -> Callable[[], None]:
    """``STARTED_TOPIC`` for ``key``, over the worker's RPC to the scheduler; returns a
    wait that ends once the scheduler has handled it, which the task run's function
    passes before it starts. On the worker's batched stream alone the notice would
    leave with the stream's next batch, which a process killed meanwhile (the task
    itself, the OOM killer) never sends, and the run would be taken for one that never
    started."""
    if worker.thread_id == threading.get_ident():  # on the event loop: no waiting there
        worker.log_event(STARTED_TOPIC, {"keys": [key], "worker": worker.address})
        return _nothing_to_hear
    return start_notices(worker).tell(key)


def start_notices(worker: Any) -> StartNotices:
    notices = _notices.get(worker)
    if notices is None:
        notices = _notices.setdefault(worker, StartNotices(worker))
    return notices


class StartNotices:
    """One worker's start notices, each answered before its task run's function starts.

    Notices made while one is on its way leave together in the next: one round trip per
    batch, not per task run, on a worker whose threads start tasks faster than the
    scheduler answers.
    """

    def __init__(self, worker: Any):
        self.worker = worker
        self._lock = threading.Lock()
        self._waiting: list[tuple[str, threading.Event]] = []
        self._sending = False

    def tell(self, key: str) -> Callable[[], None]:
        """Send ``key``'s notice (with others waiting); returns the wait for its answer."""
        heard = self._queue(key)

        def wait() -> None:
            if heard.wait(ANNOUNCE_TIMEOUT_S):
                return
            logger.warning(
                "The scheduler did not hear that %s started within %.0f s: sending it on the stream",
                key,
                ANNOUNCE_TIMEOUT_S,
            )
            self.worker.loop.add_callback(self.worker.log_event, STARTED_TOPIC, self._notice([key]))

        return wait

    def _queue(self, key: str) -> threading.Event:
        heard = threading.Event()
        with self._lock:
            self._waiting.append((key, heard))
            send, self._sending = not self._sending, True
        if send:
            self.worker.loop.add_callback(self._send)
        return heard

    def _notice(self, keys: list[str]) -> dict[str, Any]:
        return {"keys": keys, "worker": self.worker.address}

    async def _send(self) -> None:
        while True:
            with self._lock:
                batch, self._waiting = self._waiting, []
                if not batch:
                    self._sending = False
                    return
            keys = [key for key, _ in batch]
            try:
                await asyncio.wait_for(
                    self.worker.scheduler.log_event(topic=STARTED_TOPIC, msg=self._notice(keys)),
                    ANNOUNCE_TIMEOUT_S,
                )
            except (OSError, asyncio.TimeoutError) as exc:  # the stream still carries them, later
                logger.warning(
                    "Could not tell the scheduler that %d task run(s) started (%r): sending on the stream",
                    len(keys),
                    exc,
                )
                self.worker.log_event(STARTED_TOPIC, self._notice(keys))
            for _, heard in batch:
                heard.set()


_notices: weakref.WeakKeyDictionary[Any, StartNotices] = weakref.WeakKeyDictionary()


def announce_end(state: Any) -> None:
    """In a task, once its Prefect engine returned the run's final state and before the
    result leaves: tell the scheduler how the run ended, on the worker's stream, ahead of
    the task's own completion (``InterruptedTasks`` keeps it while the result is held).
    A worker that dies holding the result has then told how the run ended, which Prefect's
    API hears from events the dying process may not have sent."""
    key, _ = _marks()
    worker = current_worker()
    if not isinstance(key, str) or worker is None or getattr(state, "type", None) is None:
        return
    ended = {"key": key, "worker": worker.address, "type": state.type.value, "name": state.name}
    worker.log_event(ENDED_TOPIC, {**ended, "message": state.message})


def result_lost() -> dict[str, Any] | bool:
    """Whether this task run ended before, on a worker that died holding its result: how
    it ended, where that worker told the scheduler, else True; False if not."""
    lost = _marks()[1].get(RESULT_LOST)
    return lost if isinstance(lost, dict) else bool(lost)


def _ended_state(ended: dict[str, Any]) -> Any:
    from prefect.client.schemas.objects import State, StateType

    return State(type=StateType(ended["type"]), name=ended.get("name"), message=ended.get("message"))


def _final_state(task_run_state: Callable[[], Any], wait_s: float) -> Any:
    """The run's state in the API once it is final (waiting up to ``wait_s``), else the last one read."""
    deadline = time.monotonic() + wait_s
    while True:
        state = task_run_state()
        if (state is not None and state.is_final()) or time.monotonic() >= deadline:
            return state
        time.sleep(LOST_RESULT_POLL_S)


class HeardFirst:
    """The ``around`` of a task run's function: it waits for the scheduler to have heard
    the run start. Pickled with the task run's context (an out-of-memory retry's attempt
    on another worker), it waits for nothing: that run's first attempt had the answer."""

    def __init__(self, heard: Callable[[], None]):
        self._heard = heard

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self._heard()
        yield

    def __reduce__(self) -> tuple[Any, ...]:
        return (HeardFirst, (_nothing_to_hear,))


def admit(
    task: Task[..., Any], task_run_state: Callable[[], State[Any] | None]
) -> tuple[Task[..., Any] | None, State[Any] | None]:
    """Before a task run's engine starts on this worker: ``(task to run, None)``, or
    ``(None, state)`` where the run is over already and ``state`` is what it returns.

    Dask sends back every task a dead worker held. One that never started there runs
    now; one whose run already ended (the flow timed it out, then recycled the worker)
    returns that state; one that was running is refused, naming the dead worker, so its
    side effects do not run twice. A run whose result was lost with its worker after it
    ended returns the final state that worker told the scheduler of, else the one in the
    API, once the API has it; where the API never
    hears how it ended, a ``Crashed`` state saying so (the API is left as it is).
    ``task_run_state``: the run's state in Prefect's API (None where it has none), asked
    only for such a task.
    """
    heard, dead, started_there = _start_notice()
    # Prefect's engine starts while the scheduler hears of it; the function waits for that.
    if heard is not _nothing_to_hear:
        task = with_around(task, HeardFirst(heard))
    lost = result_lost()
    if dead is None and not lost:
        return task, None
    if isinstance(lost, dict):  # the worker that held the result told how the run ended
        return None, _ended_state(lost)
    state = task_run_state()
    if state is not None and state.is_final():
        return None, state
    if lost:
        state = _final_state(task_run_state, LOST_RESULT_WAIT_S)
        if state is not None and state.is_final():
            return None, state
        from prefect.states import Crashed

        return None, Crashed(
            message=(
                "The Dask worker holding this task run's result died after the run ended, and "
                f"Prefect's API did not say how it ended within {LOST_RESULT_WAIT_S:g} s; it was not "
                "run a second time (that could repeat its side effects). Submit it again to re-run it."
            )
        )
    assert dead is not None  # neither lost nor told how it ended: the worker it started on died
    if died_running(started_there, state):
        return refused(task, WorkerDiedError(worker_died_message(dead))), None
    return task, None
