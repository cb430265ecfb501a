"""Where an out-of-memory retry runs: a pure choice over free GPU memory."""

from __future__ import annotations

from prefect_gpu_dask.worker.oom_retry import choose

GiB = 2**30


def test_the_retry_stays_where_no_serving_worker_has_more_free_memory():
    assert choose("here", True, {"here": 8 * GiB, "b": 4 * GiB}) is None
    assert choose("here", True, {"here": 8 * GiB, "b": 8 * GiB}) is None  # a tie stays
    assert choose("here", True, {"here": 8 * GiB}) is None


def test_the_retry_moves_to_the_worker_with_most_free_memory():
    assert choose("here", True, {"here": 2 * GiB, "b": 4 * GiB, "c": 9 * GiB}) == "c"


def test_a_worker_drained_for_a_restart_is_left_while_another_can_serve():
    assert choose("here", False, {"b": 1 * GiB}) == "b"
    assert choose("here", False, {}) is None  # the only GPU: in place, restarted after


def test_workers_that_cannot_say_are_not_chosen():
    assert choose("here", True, {"here": 1 * GiB, "b": None}) is None
    assert choose("here", False, {"b": None}) is None


def test_a_moved_attempt_waits_for_its_workers_preparation_for_the_flow_run():
    """Prefect's ``hydrated_context`` sets up logging and rebuilds its run-context models
    unlocked; an attempt moved to a worker still preparing for the flow run (under the
    worker lock) enters it only once that preparation is done."""
    import threading
    import time

    from prefect_gpu_dask.worker import taskrun
    from prefect_gpu_dask.worker.oom_retry import _attempt

    holding, released_at, ran_at = threading.Event(), [], []

    def preparing() -> None:
        with taskrun._worker_lock:
            holding.set()
            time.sleep(0.3)
            released_at.append(time.monotonic())

    holder = threading.Thread(target=preparing)
    holder.start()
    assert holding.wait(5)
    assert _attempt(lambda: ran_at.append(time.monotonic()) or 7, (), {}, {}) == 7
    holder.join()
    assert ran_at[0] >= released_at[0]
