"""Result storage paths resolved with the base path resolved once: the paths Prefect's own
``LocalFileSystem._resolve_path`` gives, on a real file system."""

from __future__ import annotations

import os

import pytest
from prefect.filesystems import LocalFileSystem

from prefect_gpu_dask import _compat


def prefect_paths(basepath, names):
    fs = LocalFileSystem(basepath=str(basepath))
    out = []
    for name in names:
        try:
            out.append(fs._resolve_path(name))
        except ValueError as exc:
            out.append(f"ValueError: {exc}")
    return out


def test_the_paths_are_prefects_own(tmp_path, monkeypatch):
    real = tmp_path / "real-storage"
    real.mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "storage").symlink_to(real)  # the base path itself a symbolic link
    (real / "escape").symlink_to(tmp_path / "outside")  # a key that leaves the base path
    (real / "inside").symlink_to(real / "kept")
    (real / "kept").write_text("x")
    monkeypatch.setenv("HOME", str(tmp_path))
    names = ["", "a1b2c3", "escape", "inside", "kept", "sub/key", "../x", ".", "~/storage/k", "with space"]
    bases = [tmp_path / "storage", "~/storage"]
    expected = {str(base): prefect_paths(base, names) for base in bases}
    monkeypatch.setattr(LocalFileSystem, "_resolve_path", LocalFileSystem._resolve_path)  # undone after
    assert _compat.resolve_local_result_paths_once()
    assert not _compat.resolve_local_result_paths_once()  # once per process
    for base in bases:
        assert prefect_paths(base, names) == expected[str(base)], base
    assert expected[str(bases[0])][1] == real / "a1b2c3"
    assert str(expected[str(bases[0])][2]).startswith("ValueError")


def test_a_relative_base_path_follows_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(LocalFileSystem, "_resolve_path", LocalFileSystem._resolve_path)
    _compat.resolve_local_result_paths_once()
    for directory in ("one", "two"):
        (tmp_path / directory).mkdir()
        monkeypatch.chdir(tmp_path / directory)
        assert LocalFileSystem(basepath="storage")._resolve_path("k") == tmp_path / directory / "storage" / "k"


def test_the_engines_persisted_results_land_where_prefect_puts_them(tmp_path):
    """A persisted result written through Prefect's engine and a real API server, in a
    process whose paths are resolved this way."""
    import subprocess
    import sys

    script = f"""
import os
os.environ["PREFECT_HOME"] = {str(tmp_path / "home")!r}
os.environ["PREFECT_LOCAL_STORAGE_PATH"] = {str(tmp_path / "results")!r}
from prefect import flow, task
from prefect.testing.utilities import prefect_test_harness
from prefect_gpu_dask import _compat
_compat.resolve_local_result_paths_once()

@task(persist_result=True, result_storage_key="answer-{{parameters[x]}}")
def answer(x):
    return x * 2

@flow
def f():
    return answer(21)

with prefect_test_harness(server_startup_timeout=120):
    print(f())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "42"
    assert os.path.exists(tmp_path / "results" / "answer-21")
