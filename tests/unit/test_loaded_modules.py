"""A library another thread is still importing: the guard reads nothing from it (the
half-made module lacks its functions), and a guard that cannot measure lets the task run."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

from prefect_gpu_dask import _compat
from prefect_gpu_dask.settings import RunnerSettings
from prefect_gpu_dask.worker import guard as guard_module
from prefect_gpu_dask.worker.probe import AllocatorBytes, loaded_allocator_bytes

SLOW_LIBRARY = textwrap.dedent(
    """
    import os, time
    # A big library's import, like CuPy's: it ends when the test lets it (a fixed sleep
    # could end before a loaded machine reads it).
    while not os.path.exists(os.path.join(os.path.dirname(__file__), "import-may-end")):
        time.sleep(0.01)

    def get_default_memory_pool():
        raise AssertionError("read before its import ended")
    """
)


@contextlib.contextmanager
def half_imported(name: str, tmp_path, monkeypatch) -> Iterator[threading.Thread]:
    """``name``, a module whose import takes a second, being imported by another thread:
    inside the block it is in ``sys.modules``, half-made; it is gone after the block."""
    if name in sys.modules:
        pytest.skip(f"{name} is imported in this process: the stand-in cannot take its place")
    (tmp_path / f"{name}.py").write_text(SLOW_LIBRARY)
    monkeypatch.syspath_prepend(str(tmp_path))
    importer = threading.Thread(target=__import__, args=(name,))
    importer.start()
    deadline = time.monotonic() + 10
    while name not in sys.modules and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield importer
    finally:
        (tmp_path / "import-may-end").touch()
        importer.join()
        sys.modules.pop(name, None)  # the stand-in must not outlive the test


def test_a_module_is_none_until_its_import_ends(tmp_path, monkeypatch):
    with half_imported("slow_library", tmp_path, monkeypatch) as importer:
        assert "slow_library" in sys.modules  # half-made, yet there
        assert _compat.imported_module("slow_library") is None
        (tmp_path / "import-may-end").touch()
        importer.join()
        assert _compat.imported_module("slow_library") is sys.modules["slow_library"]


def test_allocators_being_imported_hold_nothing_yet(tmp_path, monkeypatch):
    """CuPy half-imported by another task's thread: no AttributeError from the reading,
    nothing counted; the cache release skips it too."""
    with half_imported("cupy", tmp_path, monkeypatch):
        assert loaded_allocator_bytes() == AllocatorBytes(0, None)
        guard_module.release_allocator_caches()


def test_a_guard_that_cannot_measure_lets_the_task_run(monkeypatch, caplog):
    from tests.scripted_probe import FakeDeviceProbe

    class Worker:
        address = name = "tcp://127.0.0.1:1"

        def log_event(self, topic, msg):
            pass

    guard = guard_module.GPUMemoryGuard(RunnerSettings(memory_probe=FakeDeviceProbe, health_check_s=None))
    asyncio.run(guard.setup(Worker()))

    def cannot_read():
        raise AttributeError("partially initialized module 'cupy' has no attribute 'get_default_memory_pool'")

    monkeypatch.setattr(guard, "begin", cannot_read)
    monkeypatch.setattr(guard_module, "current_guard", lambda: guard)
    ran = []
    with guard_module.guarding():
        ran.append(True)
    assert ran == [True]
    assert "could not measure a task" in caplog.text
    with pytest.raises(ValueError, match="the task's own"), guard_module.guarding():
        raise ValueError("the task's own")


class CountingFinder:
    """A ``sys.meta_path`` entry that counts the imports asked for, and finds nothing."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self.asked: list[str] = []

    def find_spec(self, name, path=None, target=None):
        if name in self.names:
            self.asked.append(name)
        return None


def test_a_worker_without_cuda_libraries_looks_for_them_once(monkeypatch):
    """Each failed import searches the whole ``sys.path``; a CPU worker's guard finds no
    CUDA context before every task, and must not search again each time."""
    import importlib.util

    if importlib.util.find_spec("cupy") or importlib.util.find_spec("numba"):
        pytest.skip("CuPy or Numba is installed here")
    finder = CountingFinder(("cupy", "numba"))
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    monkeypatch.setattr(guard_module, "_no_cuda_library", False)

    assert guard_module._create_cuda_context() is False
    assert guard_module._create_cuda_context() is False

    assert finder.asked == ["cupy", "numba"]
