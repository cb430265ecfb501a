"""The restart path on the flow side: ``Recycler`` takes "restart this worker, because"
and carries it out, losing no task and running none twice.

The path: drain -> hand back queued work -> move results -> restart -> wait for the
old process's GPU memory. It spans the three processes: this module (reasons in,
``RestartRecord``s out), ``scheduler.recycling`` (safe-point checks, hand-back,
restart, the lost-worker plugin) and ``worker.recycling`` (drain, resume, the memory
wait, refusing a task run whose worker died).

``restart="worker"``: the worker drains at once (its guard does that before the task
that asked returns; ``worker.recycling.drain``): it starts nothing new, and once it runs nothing,
the tasks queued on it go back to the scheduler and it restarts. Results it holds that
a pending task still needs are waited for (if only this worker can run that task, it
briefly takes tasks again); so are results another flow run's client holds, and where
no other worker can take them or that flow run's work, the worker keeps serving until
that flow run has them; where a hung task keeps it from serving that work, every flow
run is asked to take its results there into its flow (``ResultsOff``). Before the
restart, the Prefect states held there move into the flow (their futures get their
final state), so downstream tasks receive the state itself instead of a Dask key that
would vanish and be recomputed. The replacement's guard holds tasks off until the old
process's GPU memory is gone.

``restart="cluster"``: no new task enters the cluster (``submissions()`` is held) until
every worker is idle; then ``Scheduler.restart``, as ``client.restart()`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distributed import CancelledError
from prefect_dask.task_runners import PrefectDaskFuture

from prefect_gpu_dask import _compat
from prefect_gpu_dask.errors import died_running, worker_died_message
from prefect_gpu_dask.flow.prefect_api import API_ERRORS
from prefect_gpu_dask.flow.results import (
    PACKAGE_ERRORS,
    final_states_lock,
    is_moved,
    moved,
    settle,
)
from prefect_gpu_dask.records import (
    HUNG_TOPIC,
    LOST,
    REPLACED,
    RESULTS_OFF_TOPIC,
    GPUQuarantine,
    HungTask,
    RestartRecord,
    ResultsOff,
    TaskRecord,
    format_bytes,
)
from prefect_gpu_dask.resources import scheduler_identity
from prefect_gpu_dask.scheduler.metrics import count_restart
from prefect_gpu_dask.scheduler.recycling import (
    InterruptedTasks,
    blockers,
    hand_back_queued,
    keys_on,
    lost,
    mark_interrupted,
    other_clients,
    restart_if_safe,
    restore_no_workers_timeout,
    suspend_no_workers_timeout,
)
from prefect_gpu_dask.worker.guard import replacement_state
from prefect_gpu_dask.worker.recycling import drain, resume

if TYPE_CHECKING:
    import distributed
    from prefect.client.schemas.objects import State

logger = logging.getLogger(__name__)

POLL_S = 0.05
RESUMED_S = 0.2  # how long a resumed worker gets to pick up the task it must run
HOLD_S = 30.0  # the longest "cluster" blocks submissions before letting some through
GIVE_UP_S = 3600.0
# A worker holding a hung thread cannot close gracefully: its nanny waits most of this
# for it, then kills the process.
STUCK_RESTART_S = 8.0
# How long a worker that left before its restart may take to come back under its name:
# another flow run's restart of a hung worker takes about STUCK_RESTART_S, a nanny its
# cluster closed starts again after distributed.deploy.lost-worker-timeout.
REPLACEMENT_WAIT_S = 60.0
RESULTS_OFF_EVERY_S = 1.0  # how often other flow runs are asked again to take their results off
# Taking results off: the scheduler or a worker gone, a key released meanwhile.
TAKE_OFF_ERRORS: tuple[type[Exception], ...] = (*PACKAGE_ERRORS, KeyError)


@dataclass(frozen=True)
class _Request:
    worker: str
    reason: str
    record: TaskRecord | None
    worker_name: str | None = None


class Recycler:
    """Restart requests in (``request``), ``RestartRecord``s out (``restarts``).

    One background thread carries requests out in order. ``track`` registers the
    flow's futures so their results can move out of a worker before it restarts.
    ``start`` installs the scheduler's lost-worker plugin and subscribes to hung tasks:
    each is marked ``TimedOut`` and its worker recycled; and to other flow runs' requests
    to take this flow run's results off a worker they restart (``take_results_off``).
    Workers whose GPU is quarantined are left alone (``quarantined``).
    """

    def __init__(
        self,
        client: distributed.Client,
        policy: str,
        logger: logging.Logger,
        on_restart: Callable[[RestartRecord], None] = lambda record: None,
        timeout: float = 60.0,
        ours: Callable[[str | None], bool] = lambda flow_run_id: True,
    ):
        self.client = client
        self.policy = policy
        self.logger = logger
        self.on_restart = on_restart
        self.timeout = timeout
        self.ours = ours  # whether an event naming this flow run id is for this flow
        self._restarts: list[RestartRecord] = []
        self._futures: weakref.WeakValueDictionary[str, RecyclableFuture] = weakref.WeakValueDictionary()
        self._lock = threading.RLock()
        self._requests: queue.Queue[_Request | None] = queue.Queue()
        self._pending: set[str] = set()
        # Hung tasks per worker: only the process's end frees their threads, whatever the policy.
        self._stuck: dict[str, set[str]] = {}
        self._left_alone: dict[str, str] = {}  # worker -> why it is never restarted
        self._timed_out: dict[str, Any] = {}  # hung key -> its TimedOut state, until the flow has it
        self._closing = threading.Event()
        self._ending = threading.Event()  # close() was called: no new wait is worth it
        self._taking_off = threading.Lock()  # held while this flow run's results move off a worker
        self._thread: threading.Thread | None = None
        # Built in the flow's thread: its context (Prefect settings, the API) is the one
        # the background thread must run in; requests come from Dask's event loop.
        self._context = contextvars.copy_context()

    # -- what the runner uses -----------------------------------------------------
    def start(self) -> None:
        """Install the lost-worker plugin on the scheduler, and hear of hung tasks."""
        try:
            self.client.register_plugin(InterruptedTasks(), name=InterruptedTasks.name)
        except PACKAGE_ERRORS as exc:  # e.g. prefect-gpu-dask not installed on the scheduler
            self.logger.warning(
                "Could not install %s on the scheduler (%s): a task whose worker dies may run a second time",
                InterruptedTasks.name,
                exc,
            )
        self.client.subscribe_topic(HUNG_TOPIC, self._on_hung)
        self.client.subscribe_topic(RESULTS_OFF_TOPIC, self._on_results_off)

    @property
    def restarts(self) -> tuple[RestartRecord, ...]:
        return tuple(self._restarts)

    @contextlib.contextmanager
    def submissions(self) -> Iterator[None]:
        """Held around routing and submitting: a worker being recycled is not "missing",
        and no submission comes to depend on a worker between its checks and restart."""
        with self._lock:
            yield

    def leave_alone(self, worker: str, why: str) -> None:
        """Never restart ``worker``."""
        self._left_alone[worker] = why

    def quarantined(self, quarantine: GPUQuarantine) -> None:
        """A worker whose GPU is quarantined is never restarted: a restart would bring it
        back onto the same GPU."""
        self.leave_alone(quarantine.worker, "its GPU is quarantined")

    def track(self, key: str, future: RecyclableFuture) -> None:
        self._futures[key] = future

    def request(
        self,
        worker: str,
        reason: str,
        record: TaskRecord | None = None,
        stuck: tuple[str, ...] = (),
        worker_name: str | None = None,
    ) -> None:
        """Restart ``worker`` at its next safe point. Never blocks (called from the
        Dask client's event loop). ``stuck``: keys of tasks hung on it, which need not
        finish first and are not run again."""
        if stuck:  # read again on every attempt: a pending request learns of them too
            self._stuck.setdefault(worker, set()).update(stuck)
        elif self.policy == "never":
            return
        if worker in self._pending:
            return
        if self._closing.is_set() or (why := self._left_alone.get(worker)) is not None:
            if not self._closing.is_set():
                self.logger.info("Not recycling %s (%s): %s", worker, reason, why)
            self.settle_timed_out(stuck)  # no restart will settle them
            return
        self._pending.add(worker)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._context.run, args=(self._run,), name="gpu-recycler", daemon=True
            )
            self._thread.start()
        name = record.worker_name if record is not None else worker_name
        self._requests.put(_Request(worker, reason, record, name))

    def close(self, wait: bool) -> None:
        """Finish pending requests (``wait``), or drop them with one INFO line."""
        self._ending.set()
        if not wait:
            self._closing.set()
            dropped = []
            while not self._requests.empty():
                if (request := self._requests.get_nowait()) is not None:
                    dropped.append(request.worker)
            if dropped or self._pending:
                skipped = ", ".join(sorted(self._pending | set(dropped)))
                self.logger.info("Not recycling %s: the cluster is closing", skipped)
        if self._thread is not None:
            self._requests.put(None)
            self._thread.join(timeout=self.timeout if wait else 5)
        self._closing.set()  # a restart still waiting for its safe point stops here
        self.settle_timed_out(list(self._timed_out))
        unsubscribe(self.client, HUNG_TOPIC, RESULTS_OFF_TOPIC)

    # -- hung tasks ---------------------------------------------------------------
    def _on_hung(self, event: tuple[float, dict[str, Any]]) -> None:
        hung = HungTask.from_event(event[1])
        if not self.ours(hung.flow_run_id):
            return
        # Off Dask's event loop: marking the task run is a call to the Prefect API.
        action = self.time_out if hung.fail else self.stalled
        threading.Thread(
            target=self._context.copy().run, args=(action, hung), name="gpu-timeout", daemon=True
        ).start()

    def stalled(self, hung: HungTask) -> None:
        """Say that a task run is stalled (``on_stall="warn"``): a WARNING and an event."""
        self.logger.warning(
            "Task run %r is stalled on worker %s: in one call, with no CPU and no GPU work, for "
            "%g s (stall_s=%g); it goes on running",
            hung.task_run_name,
            hung.worker,
            hung.running_s,
            hung.timeout_s,
        )
        self._emit_stalled(hung)

    def _emit_stalled(self, hung: HungTask) -> None:
        """The Prefect event of a stalled task run."""
        from prefect_gpu_dask.flow.reporting import emit_stalled_event

        try:
            emit_stalled_event(hung)
        except Exception:  # a boundary: a report, which the flow run goes on without
            self.logger.exception("Could not emit the stalled event of %r", hung.task_run_name)

    def crash_interrupted(self, interrupted: Mapping[str, tuple[str, bool]], why: str) -> None:
        """Task runs a dead worker was running, with no worker left to refuse them as the
        next one would (``worker.recycling.admit``): ``Crashed`` in the API and in the
        flow, never run a second time. ``interrupted``: per key, the dead worker and
        whether it said it had started the run; ``why``: why no worker can take it.
        A run the API shows ended keeps that state; one only queued there that the API
        does not show running never started, and is left to fail as a missing worker does."""
        self._context.copy().run(self._crash_interrupted, interrupted, why)

    def _crash_interrupted(self, interrupted: Mapping[str, tuple[str, bool]], why: str) -> None:
        import httpx
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound
        from prefect.states import Crashed

        futures = {k: f for k in interrupted if (f := self._futures.get(k)) is not None and not is_moved(f)}
        if not futures:
            return
        with get_client(sync_client=True) as api:
            for key, future in futures.items():
                dead, started_there = interrupted[key]
                run_id = uuid.UUID(str(future.task_run_id))
                try:
                    run = api.read_task_run(run_id)
                except ObjectNotFound:  # its events never reached the API: killed early, or not started
                    run = None
                except (httpx.HTTPError, OSError):  # the API down or refusing: the next run may pass
                    self.logger.exception("Could not read task run %s", run_id)
                    continue
                state = run.state if run is not None else None
                if state is not None and state.is_final():
                    settle(future, state)  # it ended before its worker died
                    continue
                if not died_running(started_there, state):
                    continue
                message = worker_died_message(dead, why)
                crashed: State[Any] = Crashed(message=message)
                try:
                    crashed = api.set_task_run_state(run_id, crashed, force=True).state or crashed
                except ObjectNotFound:
                    self.logger.warning(
                        "Task run %s never reached Prefect's API: its worker died before sending it",
                        run_id,
                    )
                except (httpx.HTTPError, OSError):  # the flow's future ends Crashed all the same
                    self.logger.exception("Could not mark task run %s Crashed in the API", run_id)
                settle(future, crashed)
                self.logger.error("Task run %s crashed: %s", run.name if run else run_id, message)

    def time_out(self, hung: HungTask) -> None:
        """Mark a task run stuck past its deadline ``TimedOut`` and recycle its worker.

        The flow's future ends ``TimedOut`` as soon as the worker takes no new work
        (``settle_timed_out``); the restart that frees the thread follows in the background.
        The run will not run again: should something else still want its key, the next
        worker finds the task run final and returns that state.
        """
        from prefect.client.orchestration import get_client
        from prefect.states import Failed

        if hung.stalled:
            message = (
                f"Task run stalled: in one call, with no CPU and no GPU work, for {hung.running_s:g} s "
                f"(stall_s={hung.timeout_s:g}, on_stall='fail') on worker {hung.worker}; "
                "the worker is recycled"
            )
            self._emit_stalled(hung)
        else:
            message = (
                f"Task run exceeded timeout of {hung.timeout_s:g} second(s) and was still running "
                f"{hung.running_s:g} s after its start, blocked outside Python on worker {hung.worker}; "
                "the worker is recycled"
            )
        self.logger.error("Task run %r: %s", hung.task_run_name, message)
        state: State[Any] = Failed(name="TimedOut", message=message)
        try:
            with get_client(sync_client=True) as api:
                state = api.set_task_run_state(uuid.UUID(hung.task_run_id), state, force=True).state or state
        except API_ERRORS:
            self.logger.exception("Could not mark task run %r TimedOut", hung.task_run_name)
        finally:  # the hung worker is recycled and the flow gets the state, whatever the API said
            self._timed_out[hung.key] = state
            why = (
                f"stalled for {hung.running_s:g} s"
                if hung.stalled
                else f"past its {hung.timeout_s:g} s timeout"
            )
            self.request(
                hung.worker,
                f"hung: {hung.task_run_name} {why}",
                stuck=(hung.key,),
                worker_name=hung.worker_name,
            )

    def settle_timed_out(self, keys: Iterable[str]) -> None:
        """End the flow's futures of hung task runs with their ``TimedOut`` states: the
        flow goes on while their worker restarts."""
        for key in keys:
            state = self._timed_out.pop(key, None)
            if state is not None and (future := self._futures.get(key)) is not None and not is_moved(future):
                move_into_flow(future, state)

    # -- another flow run's restart --------------------------------------------------
    def _on_results_off(self, event: tuple[float, dict[str, Any]]) -> None:
        ask = ResultsOff.from_event(event[1])
        if ask.requester == self.client.id:
            return
        # Off Dask's event loop: moving results gathers them.
        run = self._context.copy().run
        moving = threading.Thread(target=run, args=(self.take_results_off, ask), name="gpu-results-off")
        moving.daemon = True
        moving.start()

    def take_results_off(self, ask: ResultsOff) -> int:
        """Move this flow run's results held on ``ask.workers`` into the flow, so another
        flow run's restart of them loses nothing of this one; the number moved. One move
        at a time: the requester asks again while results stay."""
        if self._closing.is_set() or not self._taking_off.acquire(blocking=False):
            return 0
        try:
            on_them = set(self.client.run_on_scheduler(keys_on, list(ask.workers)))
            mine = [key for key in list(self._futures.keys()) if key in on_them]
            # Gathered outside the submissions lock: this flow run keeps submitting meanwhile.
            states = self._gather_states(mine)
            with self._lock:
                moved = self._move_gathered(states)
        except TAKE_OFF_ERRORS:
            if self.client.status == "running" and not self._closing.is_set():
                self.logger.exception("Could not take this flow run's results off %s", ", ".join(ask.workers))
            return 0
        finally:
            self._taking_off.release()
        if moved:
            self.logger.info(
                "Took %d result(s) of this flow run off %s into the flow: another flow run restarts it (%s)",
                moved,
                ", ".join(ask.workers),
                ask.reason,
            )
        return moved

    # -- the background thread ----------------------------------------------------
    def _run(self) -> None:
        while (request := self._requests.get()) is not None:
            try:
                self._recycle(request)
            except Exception as exc:
                if self._closing.is_set():  # close() said what it skipped
                    self.logger.debug("Recycling %s stopped by the cluster closing: %r", request.worker, exc)
                elif self.client.status != "running":
                    self.logger.info("Not recycling %s: the cluster closed", request.worker)
                else:
                    self.logger.exception("Restarting worker %s failed", request.worker)
            finally:
                self._pending.discard(request.worker)

    def _workers(self) -> dict[str, Any]:
        return scheduler_identity(self.client).get("workers", {})

    def _recycle(self, request: _Request) -> None:
        requested, requested_wall = time.perf_counter(), time.time()
        self._safe_at: float | None = None
        self._serving_logged = False
        self._results_off_asked_at = float("-inf")
        if request.worker not in self._workers():
            self._gone(request, requested, requested_wall)
            return
        # A worker with hung tasks is recycled alone, whatever the policy: only the end of
        # its process frees their threads.
        whole_cluster = self.policy == "cluster" and not self._stuck.get(request.worker)
        if whole_cluster and (others := self.client.run_on_scheduler(other_clients, self.client.id)):
            # Scheduler.restart forgets every client's tasks: only this flow's may go.
            whole_cluster = False
            self.logger.warning(
                "restart='cluster' recycles only %s: %d other client(s) use this cluster (%s), "
                "whose work a cluster restart would lose",
                request.worker,
                len(others),
                ", ".join(sorted(others)[:3]),
            )
        targets = list(self._workers()) if whole_cluster else [request.worker]
        self.logger.warning("Recycling %s at the next safe point: %s", ", ".join(targets), request.reason)
        attempt = self._try_cluster if whole_cluster else self._try_workers
        deadline = time.monotonic() + GIVE_UP_S
        self.client.run_on_scheduler(suspend_no_workers_timeout)
        try:
            while (answer := attempt(targets))["status"] != "restarted":
                if answer["status"] == "gone":
                    self._gone(request, requested, requested_wall)
                    return
                if self._closing.is_set():
                    return  # close() said what it skipped
                if time.monotonic() > deadline:
                    self.logger.error("Gave up recycling %s: no safe point", targets)
                    return
                time.sleep(POLL_S)
        finally:
            if self.client.status == "running":
                self.client.run_on_scheduler(restore_no_workers_timeout)
        for address in targets:
            self._stuck.pop(address, None)
        restart_s = time.perf_counter() - requested
        outcomes: dict[str, dict[str, Any]] = answer.get("result", {})
        outcome = outcomes.get(request.worker, lost("the scheduler did not restart it"))
        for address, other in outcomes.items():
            if other["outcome"] == LOST and address != request.worker:
                self.logger.error("Restarting %s lost it: %s", address, other["why"])
        if outcome.get("reopened"):
            self.logger.info(
                "The cluster of %s closed its nanny mid-restart; started it again", request.worker
            )
        safe_point_s = None if self._safe_at is None else self._safe_at - requested
        record = self._record(request, outcome, restart_s, requested, requested_wall, safe_point_s)
        self._restarts.append(record)
        if not record.lost:
            try:  # the scheduler's /metrics counts it (scheduler.metrics)
                self.client.run_on_scheduler(count_restart, record.reason)
            except PACKAGE_ERRORS as exc:  # e.g. an older prefect-gpu-dask on the scheduler
                self.logger.debug("Could not count the restart on the scheduler: %r", exc)
        if record.lost:
            self.logger.error(
                "Restarted %s (%s) -> lost: %s. Its work goes to the other workers; gpu task runs "
                "nobody can serve wait for a GPU worker as on_missing_gpu says",
                record.worker,
                record.reason,
                record.lost_reason,
            )
        else:
            free_s = record.memory_free_s
            memory_free = "" if free_s is None else f"memory free after {free_s:.2f} s, "
            self.logger.warning(
                "Restarted %s (%s) -> %s: %sreplacement serving after %.2f s, GPU memory now %s",
                record.worker,
                record.reason,
                record.new_worker,
                memory_free,
                record.serving_s,
                "unknown" if record.memory_after is None else format_bytes(record.memory_after),
            )
        self.on_restart(record)

    def _gone(self, request: _Request, requested: float, requested_wall: float) -> None:
        """The worker left before this restart. Where a worker of its name serves now, it
        was replaced meanwhile (another flow run's restart, its nanny after a death): the
        process that held the memory is gone, which the record says. Where none comes
        (a worker without a nanny died, the cluster scaled it away), it is lost as a
        restart that cannot bring it back is: what waited for it may have nowhere left
        to run. Not counted on the scheduler: nothing here restarted it."""
        name = request.worker_name
        replacement, started = None, time.monotonic()
        while name and replacement is None and time.monotonic() < started + REPLACEMENT_WAIT_S:
            if self._ending.is_set():
                return  # the flow run ends: what waited for the worker waits no more
            serving = [a for a, w in self._workers().items() if str(w.get("name")) == str(name)]
            replacement = next((a for a in serving if a != request.worker), None)
            if replacement is None:
                time.sleep(RESUMED_S)
        if replacement is None:
            why = "it left the cluster before it could be recycled" + (
                f", and no worker named {name!r} joined within {time.monotonic() - started:.0f} s"
                if name
                else " (its name unknown, no worker could be taken for its replacement)"
            )
            outcome = lost(why)
            self.logger.error("%s (%s) -> lost: %s", request.worker, request.reason, why)
        else:
            outcome = {"outcome": REPLACED, "address": replacement}
            self.logger.warning(
                "%s (%s) was replaced before it could be recycled, by another restart or its nanny -> %s",
                request.worker,
                request.reason,
                replacement,
            )
        restart_s = time.perf_counter() - requested
        record = self._record(request, outcome, restart_s, requested, requested_wall, safe_point_s=None)
        self._restarts.append(record)
        self.on_restart(record)

    def _try_workers(self, targets: list[str]) -> dict[str, Any]:
        stuck = tuple(key for address in targets for key in self._stuck.get(address, ()))
        if not any(address in self._workers() for address in targets):
            self.settle_timed_out(stuck)
            return {"status": "gone"}  # died or removed meanwhile: nothing left to recycle
        reports = self.client.run(drain, workers=targets, on_error="return")
        self.settle_timed_out(stuck)  # the flow goes on: nothing new starts on these workers
        if any(not isinstance(r, dict) or r["running"] > len(stuck) for r in reports.values()):
            return {"status": "busy"}
        not_started = {address: r["not_started"] for address, r in reports.items()}
        stimulus = f"prefect-gpu-dask-drain-{time.time()}"
        with self._lock:  # no submission may come to depend on these workers meanwhile
            handed = self.client.run_on_scheduler(hand_back_queued, not_started, stimulus, list(stuck))
            if handed["status"] != "ok":
                return {"status": "busy"}
            found = self.client.run_on_scheduler(blockers, targets, False, list(stuck))
            held_for_others = False
            if not found["reasons"]:
                answer = self._restart_now(targets, whole_cluster=False, stuck=stuck)
                if not answer.get("serve_meanwhile"):
                    return answer
                held_for_others = True
        if held_for_others and stuck:
            self._ask_for_results_off(targets, stuck)
        elif held_for_others and not self._serving_logged:
            self._serving_logged = True
            self.logger.info(
                "%s holds results another flow run has not taken yet, and no other worker can "
                "take them or its work: it serves until that flow run has them, then restarts",
                ", ".join(targets),
            )
        if found["stuck"] or held_for_others:
            self.client.run(resume, workers=targets, on_error="return")
            time.sleep(RESUMED_S)
        return {"status": "busy"}

    def _ask_for_results_off(self, targets: list[str], stuck: tuple[str, ...]) -> None:
        """Serving cannot end the wait: a hung task holds its thread, and maybe the GPU
        slot the other flow runs' work needs, until the restart. So every flow run is asked
        to take its results there into its flow; again while some stay (new ones land)."""
        now = time.monotonic()
        if now - self._results_off_asked_at < RESULTS_OFF_EVERY_S:
            return
        first = self._results_off_asked_at == float("-inf")
        self._results_off_asked_at = now
        ask = ResultsOff(tuple(targets), self.client.id, f"{len(stuck)} hung task(s) there")
        self.client.log_event(RESULTS_OFF_TOPIC, ask.to_event())
        if first:
            self.logger.info(
                "%s holds results other flow runs have not taken yet, and a hung task there keeps it "
                "from serving their work: they are asked to take them into their flows",
                ", ".join(targets),
            )

    def _try_cluster(self, targets: list[str]) -> dict[str, Any]:
        with self._lock:  # nothing new enters the cluster until it is idle and restarted
            until = time.monotonic() + HOLD_S
            while time.monotonic() < until and not self._closing.is_set():
                if not self._unfinished() and not self._blocked(targets):
                    return self._restart_now(targets, whole_cluster=True)
                time.sleep(POLL_S)
        return {"status": "busy"}

    def _blocked(self, targets: list[str]) -> list[str]:
        return self.client.run_on_scheduler(blockers, targets, True)["reasons"]

    def _restart_now(
        self, targets: list[str], whole_cluster: bool, stuck: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        self._safe_at = time.perf_counter()
        self._move_results(self.client.run_on_scheduler(keys_on, targets))
        if stuck:
            self.client.run_on_scheduler(mark_interrupted, list(stuck), targets[0])
        timeout = STUCK_RESTART_S if stuck else self.timeout
        return self.client.run_on_scheduler(
            restart_if_safe, targets, timeout, whole_cluster, list(stuck), self.client.id
        )

    # -- results ------------------------------------------------------------------
    def _unfinished(self) -> int:
        """The flow's futures whose results the client has not seen yet: the scheduler
        cannot see submissions still on their way."""
        return len(self.unfinished_keys())

    def unfinished_keys(self) -> list[str]:
        return [
            key for key, f in list(self._futures.items()) if not is_moved(f) and not f.wrapped_future.done()
        ]

    def _move_results(self, keys: Iterable[str]) -> int:
        """Pull the Prefect states held under ``keys`` into the flow, then let Dask forget
        them; the number moved."""
        return self._move_gathered(self._gather_states(keys))

    def _gather_states(self, keys: Iterable[str]) -> dict[str, tuple[RecyclableFuture, State[Any]]]:
        """The Prefect states held under ``keys`` (of finished futures), with their futures."""
        futures = {key: f for key in keys if (f := self._futures.get(key)) is not None and not is_moved(f)}
        if not futures:
            return {}
        states = self.client.gather({k: f.wrapped_future for k, f in futures.items()}, errors="skip")
        return {key: (futures[key], state) for key, state in states.items()}

    @staticmethod
    def _move_gathered(states: dict[str, tuple[RecyclableFuture, State[Any]]]) -> int:
        moved = 0
        for future, state in states.values():
            if not is_moved(future):
                move_into_flow(future, state)
                moved += 1
        return moved

    def _record(
        self,
        request: _Request,
        outcome: dict[str, Any],
        restart_s: float,
        requested: float,
        requested_wall: float,
        safe_point_s: float | None,
    ) -> RestartRecord:
        """Read the replacement's GPU memory (its guard waited for release), or say why there is none."""
        source = request.record
        replacement: dict[str, Any] = {"outcome": LOST, "lost_reason": outcome.get("why")}
        if outcome["outcome"] == REPLACED:
            address = outcome["address"]
            replacement = {"outcome": REPLACED, "new_worker": address}
            states = self.client.run(replacement_state, workers=[address], on_error="return")
            if isinstance(state := states.get(address), dict):
                released = state.get("released_at")
                replacement.update(
                    new_pid=state["pid"],
                    memory_after=state["now"],
                    baseline=state["baseline"],
                    memory_free_s=None if released is None else round(released - requested_wall, 3),
                )
        return RestartRecord(
            worker=request.worker,
            worker_name=request.worker_name or request.worker,
            reason=request.reason,
            policy=self.policy,
            gpu_index=source.gpu_index if source else None,
            gpu_uuid=source.gpu_uuid if source else None,
            flow_run_id=source.flow_run_id if source else None,
            task_run_id=source.task_run_id if source else None,
            task_run_name=source.task_run_name if source else None,
            old_pid=source.pid if source else None,
            memory_before=source.after if source else None,
            safe_point_s=None if safe_point_s is None else round(safe_point_s, 3),
            restart_s=round(restart_s, 3),
            serving_s=round(time.perf_counter() - requested, 3),
            requested_at=requested_wall,
            **replacement,
        )


def unsubscribe(client: distributed.Client, *topics: str) -> None:
    """Take ``client``'s subscriptions to ``topics`` off the scheduler. A scheduler keeps
    a client's subscriptions after the client leaves: on a long-lived cluster every flow
    run would leave its own behind, each one more address every event is sent to."""
    if client.status != "running":
        return
    for topic in topics:
        with contextlib.suppress(ValueError):  # never subscribed
            client.unsubscribe_topic(topic)


class RecyclableFuture(PrefectDaskFuture):
    """The runner's ``PrefectDaskFuture``: its result may move into the flow while a
    thread waits on it. The move lets Dask forget the key, which cancels that wait;
    the waiter gets the moved state instead of ``CancelledError``. A state the flow
    settles while a thread waits (``settle``) is what that thread gets, not the error
    Dask then fails the key with."""

    def wait(self, timeout: float | None = None) -> None:
        if _compat.future_final_state(self) is not None:
            return
        try:
            super().wait(timeout)
        except CancelledError:
            if not is_moved(self):
                raise

    def result(self, timeout: float | None = None, raise_on_failure: bool = True) -> Any:
        try:
            if _compat.future_final_state(self) is None and not self.wrapped_future.done():
                # Waited for without Dask's error: a state the flow settles meanwhile wins
                # (a run its dead worker left Crashed, one no worker took Failed). A done
                # future needs no wait: the flow settles a state before Dask ends the key.
                self.wrapped_future.exception(timeout=timeout)
        except (TimeoutError, asyncio.TimeoutError) as exc:  # one from Python 3.11 on
            message = f"Task run {self.task_run_id} did not complete within {timeout} seconds"
            raise TimeoutError(message) from exc  # as prefect-dask says it
        except CancelledError:
            if not is_moved(self):
                raise
        try:
            return super().result(timeout, raise_on_failure)
        except CancelledError:
            if not is_moved(self):
                raise
            return super().result(timeout, raise_on_failure)  # now read from the moved state


def move_into_flow(future: PrefectDaskFuture[Any], state: State[Any]) -> None:
    """``future``'s final state is ``state`` from now on; Dask may forget its key (in
    that order: a thread waiting on the key then finds the state)."""
    with final_states_lock:
        _compat.set_future_final_state(future, state)
    moved.add(future)
    future.wrapped_future.release()


def resolved(future: PrefectDaskFuture[Any]) -> Any:
    """What a task that depends on ``future`` is given: the moved state, or the Dask future."""
    return _compat.future_final_state(future) if future in moved else future.wrapped_future
