"""``InterruptedTasks`` against a stand-in scheduler: which task runs a dead worker's
replacement must not run again."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prefect_gpu_dask.records import (
    ENDED_TOPIC,
    INTERRUPTED,
    RESULT_LOST,
    STARTED_THERE,
    STARTED_TOPIC,
    TASK_RUN,
)
from prefect_gpu_dask.scheduler.recycling import InterruptedTasks

A, B = "tcp://10.0.0.1:1", "tcp://10.0.0.2:1"


def scheduler(*workers: str) -> SimpleNamespace:
    return SimpleNamespace(tasks={}, workers={w: SimpleNamespace(address=w, name=w) for w in workers})


def task(sched: SimpleNamespace, key: str) -> SimpleNamespace:
    ts = SimpleNamespace(
        key=key,
        state="released",
        processing_on=None,
        annotations={TASK_RUN: True},
        suspicious=0,
        who_wants=set(),
        waiters=set(),
        who_has=set(),
    )
    sched.tasks[key] = ts
    return ts


def plugin(sched: SimpleNamespace) -> InterruptedTasks:
    interrupted = InterruptedTasks()
    asyncio.run(interrupted.start(sched))
    return interrupted


def processing(interrupted: InterruptedTasks, ts: SimpleNamespace, worker: str) -> None:
    ts.state, ts.processing_on = "processing", interrupted.scheduler.workers[worker]
    interrupted.transition(ts.key, "waiting", "processing")


def dies(interrupted: InterruptedTasks, worker: str, *tasks: SimpleNamespace) -> None:
    """What ``Scheduler.remove_worker`` does to the tasks processing on a dead worker (on
    a scheduler of no ``SpecCluster``: nothing to start again)."""
    del interrupted.scheduler.workers[worker]
    for ts in tasks:
        ts.suspicious += 1
        ts.state, ts.processing_on = "released", None
        interrupted.transition(ts.key, "processing", "released")
    interrupted.remove_worker(interrupted.scheduler, worker)


def test_a_task_started_on_a_dead_worker_is_marked_started_there():
    sched = scheduler(A, B)
    interrupted = plugin(sched)
    ts = task(sched, "t")
    processing(interrupted, ts, A)
    interrupted.log_event(STARTED_TOPIC, {"keys": ["t"], "worker": A})
    dies(interrupted, A, ts)
    assert ts.annotations[INTERRUPTED] == A and ts.annotations[STARTED_THERE]


def test_a_task_only_queued_on_a_dead_worker_is_not_marked_started():
    sched = scheduler(A, B)
    interrupted = plugin(sched)
    ts = task(sched, "t")
    processing(interrupted, ts, A)
    dies(interrupted, A, ts)
    assert ts.annotations[INTERRUPTED] == A and STARTED_THERE not in ts.annotations


def test_a_task_moved_to_another_worker_before_it_started_is_marked_where_it_started():
    """Work stealing moves a queued task to another worker without a transition: the
    worker that starts it is the one that says so, and its death is the one that counts."""
    sched = scheduler(A, B)
    interrupted = plugin(sched)
    ts = task(sched, "t")
    processing(interrupted, ts, A)
    ts.processing_on = sched.workers[B]  # stolen: no transition
    interrupted.log_event(STARTED_TOPIC, {"keys": ["t"], "worker": B})
    dies(interrupted, B, ts)
    assert ts.annotations[INTERRUPTED] == B and ts.annotations[STARTED_THERE]


def test_a_late_start_of_an_earlier_attempt_is_ignored():
    sched = scheduler(A, B)
    interrupted = plugin(sched)
    ts = task(sched, "t")
    processing(interrupted, ts, B)
    interrupted.log_event(STARTED_TOPIC, {"keys": ["t"], "worker": A})  # not where it runs now
    dies(interrupted, B, ts)
    assert STARTED_THERE not in ts.annotations


def test_a_result_lost_with_its_worker_while_still_wanted_is_marked():
    sched = scheduler(A)
    interrupted = plugin(sched)
    wanted, unwanted = task(sched, "wanted"), task(sched, "unwanted")
    wanted.who_wants = {"client"}
    for ts in (wanted, unwanted):
        interrupted.transition(ts.key, "memory", "released")
    assert wanted.annotations.get(RESULT_LOST) and RESULT_LOST not in unwanted.annotations


ENDED = {"type": "COMPLETED", "name": "Completed", "message": None}


def test_a_lost_result_carries_how_its_run_ended():
    sched = scheduler(A)
    interrupted = plugin(sched)
    ts = task(sched, "t")
    processing(interrupted, ts, A)
    interrupted.log_event(STARTED_TOPIC, {"keys": ["t"], "worker": A})
    interrupted.log_event(ENDED_TOPIC, {"key": "t", "worker": A, **ENDED})
    ts.state, ts.processing_on = "memory", None
    interrupted.transition("t", "processing", "memory")
    ts.who_wants = {"client"}
    interrupted.transition("t", "memory", "released")  # its only copy died with A
    assert ts.annotations[RESULT_LOST] == ENDED
    assert "t" not in interrupted.ended


def ended_then_died(told_by: str) -> SimpleNamespace:
    """A task run on B, which says it started; ``told_by`` says it ended; B dies."""
    sched = scheduler(A, B)
    interrupted = plugin(sched)
    ts = task(sched, "t")
    processing(interrupted, ts, B)
    interrupted.log_event(STARTED_TOPIC, {"keys": ["t"], "worker": B})
    interrupted.log_event(ENDED_TOPIC, {"key": "t", "worker": told_by, **ENDED})
    dies(interrupted, B, ts)
    return ts


def test_a_run_that_ended_on_a_worker_that_died_before_its_result_arrived_is_not_refused():
    ts = ended_then_died(told_by=B)
    assert ts.annotations[RESULT_LOST] == ENDED and INTERRUPTED not in ts.annotations


def test_an_end_told_by_another_worker_than_the_one_running_it_is_ignored():
    ts = ended_then_died(told_by=A)
    assert RESULT_LOST not in ts.annotations and ts.annotations[INTERRUPTED] == B
