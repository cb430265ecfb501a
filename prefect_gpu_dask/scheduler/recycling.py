"""The restart path on the scheduler: is it safe to restart these workers now, hand
their queued tasks back, restart them; and the lost-worker plugin.

Functions here run on the scheduler through ``client.run_on_scheduler`` (which passes
``dask_scheduler``); ``InterruptedTasks`` is a ``SchedulerPlugin``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import dask
from dask.utils import parse_timedelta
from distributed.diagnostics.plugin import SchedulerPlugin

from prefect_gpu_dask import _compat

if TYPE_CHECKING:
    from distributed import Scheduler
from prefect_gpu_dask.records import (
    ENDED_TOPIC,
    INTERRUPTED,
    LOST,
    REPLACED,
    RESULT_LOST,
    STARTED_THERE,
    STARTED_TOPIC,
    TASK_RUN,
)

DONE_STATES = {"memory", "erred", "forgotten", "released"}
# How long after a SpecCluster's lost-worker timer of a removed worker the plugin looks
# whether that timer closed the nanny restarting it.
REOPEN_GRACE_S = 1.0
# How long a worker the cluster starts again from a new nanny has to register: a fresh
# process, where a restart's replacement comes from a nanny already running. A hung
# worker's restart gives its nanny a short timeout, too short for that on a busy host.
REOPENED_REGISTER_S = 60.0

logger = logging.getLogger(__name__)
STASHED_TIMEOUT = "_prefect_gpu_dask_no_workers_timeout"


def _moving(ts: Any, drained: set[str], others_running: bool) -> bool:
    """Whether a worker outside ``drained`` is carrying ``ts`` (or what it waits for) forward."""
    seen, stack = set(), [ts]
    while stack:
        task = stack.pop()
        if task.key in seen:
            continue
        seen.add(task.key)
        if task.state == "processing" and task.processing_on.address not in drained:
            return True
        if task.state == "queued" and others_running:
            return True
        if task.state == "waiting":
            stack.extend(dep for dep in task.dependencies if dep.state not in DONE_STATES)
    return False


def blockers(
    addresses: list[str],
    whole_cluster: bool,
    stuck: Collection[str] = (),
    dask_scheduler: Scheduler | None = None,
) -> dict[str, Any]:
    """Why restarting these workers now could lose or repeat work.

    ``stuck`` (argument): hung tasks that die with the worker; what they wait for does not
    count. ``stuck`` (answer): a pending task needs a result held by a draining worker
    and nothing outside the draining workers is moving it forward: only they can run it.
    """
    assert dask_scheduler is not None  # run_on_scheduler passes it
    hung = set(stuck)
    reasons: list[str] = []
    stuck_here = False
    drained = set(addresses)
    if whole_cluster:
        busy = [ws.address for ws in dask_scheduler.workers.values() if ws.processing]
        if busy:
            reasons.append(f"{', '.join(busy)} still running tasks")
        if dask_scheduler.queued or dask_scheduler.unrunnable:
            reasons.append("tasks waiting for a free worker")
    others_running = any(ws.address not in drained for ws in dask_scheduler.running)
    for address in addresses:
        ws = dask_scheduler.workers.get(address)
        if ws is None:
            continue
        for ts in ws.has_what:
            pending = [dep for dep in ts.dependents if dep.state not in DONE_STATES and dep.key not in hung]
            if pending:
                reasons.append(f"{ts.key} on {address} is needed by a pending task")
                stuck_here = stuck_here or not all(_moving(dep, drained, others_running) for dep in pending)
    return {"reasons": reasons, "stuck": stuck_here}


def hand_back_queued(
    not_started: dict[str, list[Any]], stimulus: str, stuck: Collection[str] = (), dask_scheduler: Any = None
) -> dict[str, Any]:
    """Send what drained workers hold but never started back to the scheduler.

    ``not_started``: per worker, the tasks it reported waiting (``worker.recycling.drain``). A task
    the scheduler still counts as processing there but that is not on that list has
    finished (its message is on the way) or is running: then nothing is moved yet.
    ``stuck``: tasks hung past their deadline, which stay where they are.
    """
    for address, keys in not_started.items():
        ws = dask_scheduler.workers.get(address)
        if ws is None:
            continue
        waiting, left = set(keys), set(stuck)
        if any(ts.key not in waiting and ts.key not in left for ts in ws.processing):
            return {"status": "busy", "blockers": [f"{address} has tasks in flight"]}
        for ts in list(ws.processing):
            if ts.key not in left:
                _compat.reschedule(dask_scheduler, ts.key, address, stimulus)
    return {"status": "ok"}


def suspend_no_workers_timeout(dask_scheduler: Any = None) -> None:
    """A drain may outlast the no-workers timeout of on_missing_gpu="error" clusters:
    a gpu task waiting for the replacement is not a task nobody can run."""
    if dask_scheduler.no_workers_timeout is not None and not hasattr(dask_scheduler, STASHED_TIMEOUT):
        setattr(dask_scheduler, STASHED_TIMEOUT, dask_scheduler.no_workers_timeout)
        dask_scheduler.no_workers_timeout = None


def restore_no_workers_timeout(dask_scheduler: Any = None) -> None:
    if hasattr(dask_scheduler, STASHED_TIMEOUT):
        dask_scheduler.no_workers_timeout = getattr(dask_scheduler, STASHED_TIMEOUT)
        delattr(dask_scheduler, STASHED_TIMEOUT)


def other_clients(client_id: str, dask_scheduler: Any = None) -> list[str]:
    """Clients of this scheduler other than ``client_id`` (and the scheduler's own)."""
    return [c for c in dask_scheduler.clients if c not in (client_id, "fire-and-forget")]


def keys_on(addresses: list[str], dask_scheduler: Any = None) -> list[str]:
    return [
        ts.key for a in addresses if a in dask_scheduler.workers for ts in dask_scheduler.workers[a].has_what
    ]


async def restart_if_safe(
    addresses: list[str],
    timeout: float,
    whole_cluster: bool,
    stuck: Collection[str] = (),
    requester: str | None = None,
    dask_scheduler: Any = None,
) -> dict[str, Any]:
    """Restart ``addresses`` now if nothing would be lost; ``stuck``: hung tasks that
    may still run there (they die with the process, and are not run again);
    ``requester``: the client that asked.

    Answers, per worker, ``{"outcome": REPLACED, "address": ...}`` once a worker of
    the same name serves again, or ``{"outcome": "lost", "why": ...}``.
    """
    if (found := blockers(addresses, whole_cluster, stuck, dask_scheduler))["reasons"]:
        return {"status": "busy", "blockers": found["reasons"]}
    addresses = [a for a in addresses if a in dask_scheduler.workers]
    left = set(stuck)
    if not whole_cluster and any(
        ts.key not in left for a in addresses for ts in dask_scheduler.workers[a].processing
    ):
        return {"status": "busy", "blockers": ["a task was assigned meanwhile"]}
    stimulus = f"prefect-gpu-dask-restart-{time.time()}"
    if not whole_cluster and (held := wanted_only_on(addresses, dask_scheduler)):
        # A task run's result a client still holds would be computed again after the
        # restart: a task run twice. Copy them to other workers first; where none can take them,
        # wait (the flow's own, just moved into it, are being released).
        others = [ws.address for ws in dask_scheduler.running if ws.address not in addresses]
        if others:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    dask_scheduler.retire_workers(
                        workers=addresses, close_workers=False, remove=False, stimulus_id=stimulus
                    ),
                    timeout,
                )
            held = wanted_only_on(addresses, dask_scheduler)
        if held:
            blocker = f"{len(held)} result(s) a client holds are only there"
            # Another client's, with no other worker: its work can run only here, and must,
            # for that client to end and let them go.
            theirs = any(
                cs.client_key != requester for key in held for cs in dask_scheduler.tasks[key].who_wants
            )
            return {"status": "busy", "blockers": [blocker], "serve_meanwhile": theirs and not others}
    old = {address: dask_scheduler.workers[address] for address in addresses}
    for address in addresses:
        # Paused workers get no new tasks between this check and the restart.
        _compat.pause_worker(dask_scheduler, address, stimulus)
    if whole_cluster:
        # What client.restart() does: forget every task, restart every worker.
        await dask_scheduler.restart(timeout=timeout, stimulus_id=stimulus, wait_for_workers=False)
        answers = {address: "OK" for address in addresses}
    else:
        answers = await dask_scheduler.restart_workers(
            addresses, timeout=timeout, stimulus_id=stimulus, on_error="return", wait_for_workers=False
        )
    return {"status": "restarted", "result": await replacements(old, answers, timeout, dask_scheduler)}


def wanted_only_on(addresses: list[str], dask_scheduler: Any) -> list[str]:
    """Task runs' results on ``addresses`` that a client still holds and no other worker
    has: lost with the worker, Dask would run those task runs again."""
    drained = set(addresses)
    return [
        ts.key
        for address in addresses
        if (ws := dask_scheduler.workers.get(address)) is not None
        for ts in ws.has_what
        if ts.who_wants
        and (ts.annotations or {}).get(TASK_RUN)
        and all(holder.address in drained for holder in ts.who_has)
    ]


async def replacements(
    old: dict[str, Any], answers: dict[str, str], timeout: float, dask_scheduler: Any
) -> dict[str, dict[str, Any]]:
    """Wait for a worker of each restarted worker's name to register again.

    Counting workers, as ``restart_workers`` does, would take an unrelated worker that
    joins for the replacement and miss one that never comes back. A ``SpecCluster``
    (``LocalCluster``, ``LocalCUDACluster``) closes the nanny of a worker that is
    absent when the lost-worker timer of an earlier removal of the same name fires
    (``distributed.deploy.lost-worker-timeout`` after it): a restart in that window
    would lose the worker for good. The cluster still lists it in ``worker_spec``, so
    it is started again through ``scale``, and only a worker of the cluster's current
    nanny counts as the replacement.
    """
    outcome: dict[str, dict[str, Any]] = {}
    waiting: dict[str, Any] = {}
    for address, ws in old.items():
        answer = str(answers.get(address, "removed"))
        if answer == "OK":
            waiting[address] = ws
        elif answer == "removed":
            outcome[address] = lost("it has no nanny: it was shut down, not restarted")
        else:
            outcome[address] = lost(f"its nanny did not restart it ({answer})")
    cluster = _compat.spec_cluster_of(dask_scheduler)
    reopened: set[str] = set()
    started = time.monotonic()
    deadline = started + timeout
    while waiting:
        for address, ws in list(waiting.items()):
            if cluster is not None and _closed_by_cluster(cluster, ws.name):
                if address not in reopened:
                    deadline = max(deadline, time.monotonic() + REOPENED_REGISTER_S)
                reopened.add(address)
                cluster.scale(len(cluster.worker_spec))  # starts every listed worker that is missing
                continue
            new = next((w for w in dask_scheduler.workers.values() if _replaces(w, ws, cluster)), None)
            if new is not None:
                reopened_now = address in reopened
                outcome[address] = {"outcome": REPLACED, "address": new.address, "reopened": reopened_now}
                del waiting[address]
        if not waiting or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    for address, ws in waiting.items():
        closed = " (its cluster had closed its nanny)" if address in reopened else ""
        waited = time.monotonic() - started
        outcome[address] = lost(f"no worker named {ws.name!r} registered within {waited:.0f} s{closed}")
    return outcome


def _closed_by_cluster(cluster: Any, name: Any) -> bool:
    return name in cluster.worker_spec and name not in cluster.workers and cluster.status.name == "running"


def _replaces(candidate: Any, old: Any, cluster: Any) -> bool:
    if candidate is old or candidate.name != old.name:
        return False
    if cluster is None:
        return True
    current = cluster.workers.get(old.name)  # the nanny (or in-process worker) it now runs
    if current is None:
        return False
    # A batch job (dask-jobqueue's SLURMCluster...) has no address: its nanny restarts the
    # worker inside the job, under the same name.
    address = getattr(current, "address", None)
    return address is None or address in (candidate.nanny, candidate.address)


def lost(why: str) -> dict[str, Any]:
    return {"outcome": LOST, "why": why}


def mark_interrupted(keys: list[str], worker: str, dask_scheduler: Any = None) -> None:
    """Mark tasks that die with ``worker`` as ``InterruptedTasks`` would, however the
    worker leaves: a hung task must not run again on the next worker."""
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        if ts is not None:
            _compat.annotate(ts, {INTERRUPTED: worker, STARTED_THERE: True})


class InterruptedTasks(SchedulerPlugin):
    """A task whose worker died while running it fails instead of running a second time.

    When a worker dies, Dask quietly reschedules the tasks it was running (up to
    ``distributed.scheduler.allowed-failures`` times). For a Prefect task run that means
    the same task run executing twice, its side effects repeated, and the first attempt
    never reported. This plugin marks such a task in its annotations (which travel to
    the next worker with the task); there ``worker.recycling.announce_start`` sees the mark and the task
    run is refused with a message naming the dead worker.

    Which tasks had started there comes from the workers' ``STARTED_TOPIC`` events, which
    the scheduler has handled before a task run's function starts; Prefect's API may not
    know yet, as task run states reach it as events, later on a busy server, or never from
    a killed process. A started task is marked by the worker that said it started it,
    where the scheduler had it processing then: Dask's work stealing moves a queued task
    to another worker without a transition.

    A task run that had finished on the dead worker is computed again too, when its result
    was only there and a client (the flow's future) or a pending task still wants it.
    Such a task is marked ``RESULT_LOST``, with the final state its worker told of on
    ``ENDED_TOPIC`` just before its result: the next worker returns that state instead of
    running it a second time (``worker.recycling.admit``). So is a run whose worker died
    after it ended but before its result reached the scheduler.

    And a dead worker comes back: a ``SpecCluster`` living in the scheduler's process
    closes the nanny of a worker none of whose name is registered
    ``distributed.deploy.lost-worker-timeout`` after a removal of that name, even while
    the nanny is starting a new worker process (``replacements`` says more). Once that
    time has passed after a removal, a worker closed so is started again through the
    cluster's ``scale``, as a recycle's restart does.
    """

    name = "prefect-gpu-dask-interrupted"
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None
        self.running_on: dict[Any, str] = {}  # where each task went processing
        self.started: dict[Any, str] = {}  # the worker each task started on
        self.ended: dict[Any, dict[str, Any]] = {}  # how each task run whose result is held ended
        self.names: dict[str, Any] = {}  # worker address -> its name

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.names = {address: ws.name for address, ws in scheduler.workers.items()}

    def add_worker(self, scheduler: Any, worker: str) -> None:
        if (ws := scheduler.workers.get(worker)) is not None:
            self.names[worker] = ws.name

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        name = self.names.pop(worker, None)
        cluster = _compat.spec_cluster_of(scheduler)
        if name is None or cluster is None:
            return
        delay = parse_timedelta(dask.config.get("distributed.deploy.lost-worker-timeout")) + REOPEN_GRACE_S
        asyncio.get_running_loop().call_later(delay, self._reopen, cluster, name)

    @staticmethod
    def _reopen(cluster: Any, name: Any) -> None:
        if _closed_by_cluster(cluster, name):
            logger.warning(
                "The cluster closed the nanny of worker %r while it started a new worker process: "
                "starting the worker again",
                name,
            )
            cluster.scale(len(cluster.worker_spec))  # starts every listed worker that is missing

    def restart(self, scheduler: Any) -> None:
        self.running_on.clear()  # every task is forgotten
        self.started.clear()
        self.ended.clear()

    def log_event(self, topic: str, msg: Any) -> None:
        if topic == STARTED_TOPIC and isinstance(msg, dict) and self.scheduler is not None:
            worker = msg.get("worker")
            for key in msg.get("keys", ()):
                ts = self.scheduler.tasks.get(key) if isinstance(key, str) else None
                # Only from the worker running it now: not a late event of an earlier attempt.
                if ts is not None and ts.processing_on is not None and ts.processing_on.address == worker:
                    self.started[key] = worker
        elif topic == ENDED_TOPIC and isinstance(msg, dict) and self.scheduler is not None:
            key, worker = msg.get("key"), msg.get("worker")
            ts = self.scheduler.tasks.get(key) if isinstance(key, str) else None
            if ts is not None and ts.processing_on is not None and ts.processing_on.address == worker:
                self.ended[key] = {k: msg.get(k) for k in ("type", "name", "message")}

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if self.scheduler is None:
            return
        if finish == "processing":
            ts = self.scheduler.tasks.get(key)
            if ts is not None and ts.processing_on is not None:
                self.running_on[key] = ts.processing_on.address
        elif start == "memory" and finish in ("released", "forgotten"):
            ended = self.ended.pop(key, None)
            ts = self.scheduler.tasks.get(key)
            # Only a lost copy releases a result that is still wanted: Dask computes it again.
            if (
                ts is not None
                and (ts.who_wants or ts.waiters)
                and not ts.who_has
                and (ts.annotations or {}).get(TASK_RUN)
            ):
                _compat.annotate(ts, {RESULT_LOST: ended or True})
        elif start == "processing":
            queued_on = self.running_on.pop(key, None)
            started_on = self.started.pop(key, None)
            ended = self.ended.get(key) if finish == "memory" else self.ended.pop(key, None)
            ts = self.scheduler.tasks.get(key)
            if finish != "released" or ts is None:
                return
            marks: dict[str, Any]
            if ended is not None:  # its worker died after the run ended, before its result arrived
                marks = {RESULT_LOST: ended}
            elif started_on is not None and started_on not in self.scheduler.workers:
                marks = {INTERRUPTED: started_on, STARTED_THERE: True}
            # remove_worker counts an unexpected death in ts.suspicious before releasing.
            elif ts.suspicious and queued_on is not None and queued_on not in self.scheduler.workers:
                marks = {INTERRUPTED: queued_on}
            else:
                return
            _compat.annotate(ts, marks)
