"""The flow process hands freed heap back after a flow run (glibc's malloc_trim)."""

from __future__ import annotations

import threading
import time

import pytest

from prefect_gpu_dask.flow import heap

glibc = pytest.mark.skipif(heap._malloc_trim() is None, reason="the C library is not glibc")


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20


def _release_done(timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while any(t.name == "prefect-gpu-dask-heap-release" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the heap release did not end"
        time.sleep(0.01)


@glibc
def test_freed_heap_goes_back_to_the_system():
    _release_done()
    kept: list[bytearray] = []

    def fragment() -> None:  # in a thread of its own, as a flow run is: its own arena
        chunks = [bytearray(2000) for _ in range(60_000)]
        kept.extend(chunks[::8])  # what stays pins few pages; the rest is freed in the middle

    for _ in range(2):
        worker = threading.Thread(target=fragment)
        worker.start()
        worker.join()
    before = _rss_mib()
    assert heap.release_freed_heap_soon()
    _release_done()
    assert before - _rss_mib() > 50, (before, _rss_mib())
    assert len(kept) == 15_000


def test_one_release_at_a_time(monkeypatch):
    entered, go_on = threading.Event(), threading.Event()
    calls = []

    def slow_trim(pad: int) -> int:
        calls.append(pad)
        entered.set()
        go_on.wait(10)
        return 1

    monkeypatch.setattr(heap, "_malloc_trim", lambda: slow_trim)
    _release_done()
    assert heap.release_freed_heap_soon()
    assert entered.wait(10)
    assert not heap.release_freed_heap_soon()  # one under way: this one is skipped
    go_on.set()
    _release_done()
    assert heap.release_freed_heap_soon()  # the next flow run's end starts one again
    _release_done()
    assert calls == [0, 0]


def test_nothing_to_do_without_glibc(monkeypatch):
    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)
    assert not heap.release_freed_heap_soon()


def test_a_runner_that_never_connected_releases_nothing(monkeypatch):
    """Prefect's engine enters a copy of the runner for every task run on a worker: only
    the runner that held the flow run's client ends a flow run."""
    from prefect_gpu_dask import GPUDaskTaskRunner

    calls = []
    monkeypatch.setattr(heap, "_malloc_trim", lambda: calls.append)
    _release_done()
    with GPUDaskTaskRunner().duplicate():
        pass
    _release_done()
    assert calls == []
