"""A CUDA context made beside a worker's start: what waits for it, and what runs after it."""

from __future__ import annotations

import ctypes
import threading
import time

from prefect_gpu_dask.worker import cuda_context


def test_with_no_context_in_the_making_nothing_waits():
    ran: list[str] = []
    cuda_context.then(lambda: ran.append(threading.current_thread().name))
    assert ran == [threading.current_thread().name]
    assert cuda_context.wait(0)


def test_what_waits_for_the_context_goes_on_once_it_is_made_or_failed():
    for outcome in ("made", "failed"):
        release = threading.Event()
        order: list[str] = []

        def make(outcome: str = outcome, release: threading.Event = release, order: list = order) -> None:
            release.wait(5)
            order.append("context")
            if outcome == "failed":
                raise RuntimeError("no CUDA-capable device is detected")

        cuda_context.make_beside(make)
        cuda_context.then(lambda order=order: order.append(f"after, in {threading.current_thread().name}"))
        assert not cuda_context.wait(0.05) and order == []
        release.set()
        assert cuda_context.wait(5)
        assert order == ["context", "after, in cuda-context"], outcome
        assert cuda_context.made_in_s() is not None


def test_a_timeout_raised_into_a_waiting_task_thread_ends_its_wait():
    never = threading.Event()
    cuda_context.make_beside(lambda: never.wait(30))  # a driver that does not return
    ended: list[BaseException] = []

    def task_thread() -> None:
        try:
            cuda_context.wait()
        except TimeoutError as exc:
            ended.append(exc)

    thread = threading.Thread(target=task_thread)
    thread.start()
    time.sleep(0.3)
    # What Prefect's timeout of a task run in a worker thread does
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(TimeoutError))
    thread.join(2)
    try:
        assert not thread.is_alive() and len(ended) == 1
    finally:
        never.set()
        assert cuda_context.wait(5)


def test_the_thread_that_made_the_context_lives_on_with_its_reference():
    makers: list[threading.Thread] = []
    cuda_context.make_beside(lambda: makers.append(threading.current_thread()))
    assert cuda_context.wait(5)
    [maker] = makers
    maker.join(0.5)
    assert maker.is_alive() and maker.daemon
