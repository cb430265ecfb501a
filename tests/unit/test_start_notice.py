"""The wait a task run's function passes before it starts: the scheduler's answer to its
start notice (``worker.recycling.HeardFirst``)."""

from __future__ import annotations

import pickle
import threading

import cloudpickle
from prefect import task

from prefect_gpu_dask.worker.recycling import HeardFirst
from prefect_gpu_dask.worker.taskwrap import with_around


@task
def double(x: int) -> int:
    return 2 * x


def test_the_function_starts_only_once_the_scheduler_answered():
    answered = threading.Event()
    order: list[str] = []

    def heard() -> None:
        assert answered.wait(5)
        order.append("heard")

    clone = with_around(double, HeardFirst(heard))
    result: list[int] = []
    caller = threading.Thread(target=lambda: result.append(clone.fn(21)))
    caller.start()
    caller.join(0.2)
    assert caller.is_alive() and result == []  # still waiting for the answer
    answered.set()
    caller.join(5)
    assert order == ["heard"] and result == [42]


def test_it_travels_with_the_task_runs_context_and_waits_for_nothing_there():
    """An out-of-memory retry sends the task run's context, this task among it, to another
    worker: the wait (a lock) stays here, and the copy there runs at once."""
    never = threading.Event()
    clone = with_around(double, HeardFirst(lambda: never.wait()))
    travelled = pickle.loads(cloudpickle.dumps(clone))
    assert travelled.fn(4) == 8
