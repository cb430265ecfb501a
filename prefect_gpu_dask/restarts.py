"""Flow-side restart policy: recycle a leaking worker at a safe point, lose nothing.

``restart="worker"``: the leaking worker drains at once (its guard does that before
the leaking task returns; ``guard.drain``): it starts nothing new, and once it runs
nothing, the tasks queued on it go back to the scheduler and it restarts. Results it
holds that a pending task still needs are waited for (if only this worker can run
that task, it briefly takes tasks again). Before the restart the runner pulls the
Prefect states held there into the flow (``detach``), so downstream tasks receive the
state itself instead of a Dask key that would vanish and be recomputed (a task run
twice).

``restart="cluster"``: no new task enters the cluster (the runner's submit lock is
held) until every worker is idle; then ``Scheduler.restart``, as ``client.restart()``.
"""

from __future__ import annotations

import contextvars
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

DONE_STATES = {"memory", "erred", "forgotten", "released"}
POLL_S = 0.05
RESUMED_S = 0.2  # how long a resumed worker gets to pick up the task it must run
HOLD_S = 30.0  # the longest "cluster" blocks submissions before letting some through
GIVE_UP_S = 3600.0
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


def _blockers(addresses: list[str], whole_cluster: bool, dask_scheduler: Any = None) -> dict[str, Any]:
    """Why restarting these workers now could lose or repeat work.

    ``stuck``: a pending task needs a result held by a draining worker and nothing
    outside the draining workers is moving it forward: only they can run it.
    """
    reasons, stuck = [], False
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
            pending = [dep for dep in ts.dependents if dep.state not in DONE_STATES]
            if pending:
                reasons.append(f"{ts.key} on {address} is needed by a pending task")
                stuck = stuck or not all(_moving(dep, drained, others_running) for dep in pending)
    return {"reasons": reasons, "stuck": stuck}


def _hand_back_queued(
    not_started: dict[str, list[Any]], stimulus: str, dask_scheduler: Any = None
) -> dict[str, Any]:
    """Send what drained workers hold but never started back to the scheduler.

    ``not_started``: per worker, the tasks it reported waiting (``guard.drain``). A task
    the scheduler still counts as processing there but that is not on that list has
    finished (its message is on the way) or is running: then nothing is moved yet.
    """
    for address, keys in not_started.items():
        ws = dask_scheduler.workers.get(address)
        if ws is None:
            continue
        waiting = set(keys)
        if any(ts.key not in waiting for ts in ws.processing):
            return {"status": "busy", "blockers": [f"{address} has tasks in flight"]}
        for ts in list(ws.processing):
            dask_scheduler._reschedule(ts.key, address, stimulus_id=stimulus)
    return {"status": "ok"}


def _suspend_no_workers_timeout(dask_scheduler: Any = None) -> None:
    """A drain may outlast the no-workers timeout of on_missing_gpu="error" clusters:
    a gpu task waiting for the replacement is not a task nobody can run."""
    if dask_scheduler.no_workers_timeout is not None and not hasattr(dask_scheduler, STASHED_TIMEOUT):
        setattr(dask_scheduler, STASHED_TIMEOUT, dask_scheduler.no_workers_timeout)
        dask_scheduler.no_workers_timeout = None


def _restore_no_workers_timeout(dask_scheduler: Any = None) -> None:
    if hasattr(dask_scheduler, STASHED_TIMEOUT):
        dask_scheduler.no_workers_timeout = getattr(dask_scheduler, STASHED_TIMEOUT)
        delattr(dask_scheduler, STASHED_TIMEOUT)


def _keys_on(addresses: list[str], dask_scheduler: Any = None) -> list[str]:
    return [
        ts.key for a in addresses if a in dask_scheduler.workers for ts in dask_scheduler.workers[a].has_what
    ]


async def _restart_if_safe(
    addresses: list[str], timeout: float, whole_cluster: bool, dask_scheduler: Any = None
) -> dict[str, Any]:
    if (blockers := _blockers(addresses, whole_cluster, dask_scheduler))["reasons"]:
        return {"status": "busy", "blockers": blockers["reasons"]}
    addresses = [a for a in addresses if a in dask_scheduler.workers]
    if not whole_cluster and any(dask_scheduler.workers[a].processing for a in addresses):
        return {"status": "busy", "blockers": ["a task was assigned meanwhile"]}
    stimulus = f"prefect-gpu-dask-restart-{time.time()}"
    for address in addresses:
        # Paused workers get no new tasks between this check and the restart.
        dask_scheduler.handle_worker_status_change("paused", address, stimulus)
    if whole_cluster:
        # What client.restart() does: forget every task, restart every worker.
        await dask_scheduler.restart(timeout=timeout, stimulus_id=stimulus)
        return {"status": "restarted", "result": {a: "OK" for a in addresses}}
    result = await dask_scheduler.restart_workers(
        addresses, timeout=timeout, stimulus_id=stimulus, on_error="return"
    )
    return {"status": "restarted", "result": {k: str(v) for k, v in result.items()}}


def _guard_state(dask_worker: Any) -> dict[str, Any]:
    from prefect_gpu_dask.guard import PLUGIN_NAME

    guard = dask_worker.plugins.get(PLUGIN_NAME)
    baseline = getattr(guard, "baseline", None)
    sample = guard.probe.sample() if getattr(guard, "probe", None) is not None else None
    return {
        "pid": os.getpid(),
        "name": str(dask_worker.name),
        "baseline": baseline.judged if baseline else None,
        "now": sample.judged if sample else None,
    }


class RestartCoordinator:
    """Queue restart requests from worker events; carry them out in one background thread."""

    def __init__(
        self,
        client: Any,
        policy: str,
        detach: Callable[[set[str]], None],
        lock: threading.RLock,
        on_restart: Callable[[dict[str, Any]], None],
        logger: logging.Logger,
        timeout: float = 60.0,
        unfinished: Callable[[], int] = lambda: 0,
    ):
        self.client = client
        self.policy = policy
        self.detach = detach
        self.lock = lock
        self.on_restart = on_restart
        self.logger = logger
        self.timeout = timeout
        # The flow's own submissions still on their way: the scheduler cannot see them yet.
        self.unfinished = unfinished
        self.restarts: list[dict[str, Any]] = []
        self._requests: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._pending: set[str] = set()
        self._closing = threading.Event()
        # Run in the flow's context: events must reach the flow's API, not the process default.
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._run,), name="gpu-restarts", daemon=True
        )
        self._thread.start()

    def request(self, record: dict[str, Any]) -> None:
        """Called from the Dask client's event loop: never blocks."""
        if self.policy == "never" or record["worker"] in self._pending:
            return
        self._pending.add(record["worker"])
        self._requests.put(record)

    def close(self, wait: bool) -> None:
        """Stop after carrying out pending requests (``wait``) or dropping them."""
        if not wait:
            self._closing.set()
            while not self._requests.empty():
                self._requests.get_nowait()
        self._requests.put(None)
        self._thread.join(timeout=self.timeout if wait else 5)
        self._closing.set()  # a restart still waiting for its safe point stops here

    def _run(self) -> None:
        while (record := self._requests.get()) is not None:
            try:
                self._restart(record)
            except Exception:
                self.logger.exception("Restarting worker %s failed", record["worker"])
            finally:
                self._pending.discard(record["worker"])

    def _targets(self, record: dict[str, Any]) -> list[str]:
        if self.policy == "cluster":
            return list(self.client.scheduler_info(n_workers=-1)["workers"])
        return [record["worker"]]

    def _restart(self, record: dict[str, Any]) -> None:
        requested = time.perf_counter()
        reason = record["restart_reason"]
        if record["worker"] not in self.client.scheduler_info(n_workers=-1)["workers"]:
            self.logger.debug("%s is gone already: not restarting it (%s)", record["worker"], reason)
            return
        targets = self._targets(record)
        self.logger.warning("Recycling %s at the next safe point: %s", ", ".join(targets), reason)
        attempt = self._try_cluster if self.policy == "cluster" else self._try_workers
        deadline = time.monotonic() + GIVE_UP_S
        self.client.run_on_scheduler(_suspend_no_workers_timeout)
        try:
            while (status := attempt(targets)["status"]) != "restarted":
                if status == "gone":
                    self.logger.warning("%s left the cluster before it could be recycled", targets)
                    return
                if self._closing.is_set() or time.monotonic() > deadline:
                    self.logger.error("Gave up recycling %s: no safe point", targets)
                    return
                time.sleep(POLL_S)
        finally:
            if self.client.status == "running":
                self.client.run_on_scheduler(_restore_no_workers_timeout)
        restarted = time.perf_counter()
        info = self._after_restart(record, targets)
        info.update(
            reason=reason,
            restart_s=round(restarted - requested, 3),
            recovery_s=round(time.perf_counter() - requested, 3),
            policy=self.policy,
        )
        self.restarts.append(info)
        self.logger.warning(
            "Restarted %s (%s) -> %s in %.2f s; GPU memory back to %s",
            info["worker"],
            reason,
            info.get("new_worker"),
            info["recovery_s"],
            info.get("memory_after"),
        )
        self.on_restart(info)

    def _try_workers(self, targets: list[str]) -> dict[str, Any]:
        from prefect_gpu_dask.guard import drain, resume

        present = self.client.scheduler_info(n_workers=-1).get("workers", {})
        if not any(address in present for address in targets):
            return {"status": "gone"}  # died or removed meanwhile: nothing left to recycle
        reports = self.client.run(drain, workers=targets, on_error="return")
        if any(not isinstance(r, dict) or r["running"] for r in reports.values()):
            return {"status": "busy"}
        not_started = {address: r["not_started"] for address, r in reports.items()}
        stimulus = f"prefect-gpu-dask-drain-{time.time()}"
        with self.lock:  # no submission may come to depend on these workers meanwhile
            if self.client.run_on_scheduler(_hand_back_queued, not_started, stimulus)["status"] != "ok":
                return {"status": "busy"}
            blockers = self.client.run_on_scheduler(_blockers, targets, False)
            if not blockers["reasons"]:
                return self._restart_now(targets, whole_cluster=False)
        if blockers["stuck"]:
            self.client.run(resume, workers=targets, on_error="return")
            time.sleep(RESUMED_S)
        return {"status": "busy"}

    def _try_cluster(self, targets: list[str]) -> dict[str, Any]:
        with self.lock:  # nothing new enters the cluster until it is idle and restarted
            until = time.monotonic() + HOLD_S
            while time.monotonic() < until and not self._closing.is_set():
                if not self.unfinished() and not self._blocked(targets, whole_cluster=True):
                    return self._restart_now(targets, whole_cluster=True)
                time.sleep(POLL_S)
        return {"status": "busy"}

    def _blocked(self, targets: list[str], whole_cluster: bool) -> list[str]:
        return self.client.run_on_scheduler(_blockers, targets, whole_cluster)["reasons"]

    def _restart_now(self, targets: list[str], whole_cluster: bool) -> dict[str, Any]:
        self.detach(set(self.client.run_on_scheduler(_keys_on, targets)))
        return self.client.run_on_scheduler(_restart_if_safe, targets, self.timeout, whole_cluster)

    def _after_restart(self, record: dict[str, Any], targets: list[str]) -> dict[str, Any]:
        """Find the replacement worker and read its GPU memory (its guard waited for release)."""
        info = {
            k: record.get(k)
            for k in (
                "worker",
                "worker_name",
                "gpu_index",
                "gpu_uuid",
                "flow_run_id",
                "task_run_id",
                "task_run_name",
                "pid",
            )
        }
        info["memory_before"] = record.get("after")
        states = self.client.run(_guard_state, on_error="return")
        for address, state in states.items():
            if isinstance(state, dict) and state["name"] == str(record.get("worker_name")):
                info.update(
                    new_worker=address,
                    new_pid=state["pid"],
                    memory_after=state["now"],
                    baseline=state["baseline"],
                )
        return info
