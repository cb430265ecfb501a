"""pytest plugin: prefect-dask's own tests, with ``GPUDaskTaskRunner`` in place of ``DaskTaskRunner``.

Loaded with ``-p gpu_runner_in_place`` by ``.ci/prefect-dask-suite``. pytest imports
``-p`` plugins before any conftest or test module, so rebinding the two public names
here is enough for ``from prefect_dask import DaskTaskRunner`` (what prefect-dask's
tests do) and ``from prefect_dask.task_runners import DaskTaskRunner`` to hand the tests
``GPUDaskTaskRunner``. Nothing else is changed: the runner keeps its own ``__eq__`` and
``duplicate()``, its futures are prefect-dask's ``PrefectDaskFuture``, and no test is
skipped or altered.

Honesty checks, so a run cannot pass without the substitution having happened:

* every collected test module that has a global ``DaskTaskRunner`` must see
  ``GPUDaskTaskRunner`` there (a module that kept the original fails the session);
* every runner built in the pytest process is counted by its class (prefect-dask's
  ``__init__`` is wrapped only to count): if any plain ``DaskTaskRunner`` was built, or
  no ``GPUDaskTaskRunner`` at all, the report says so and ``.ci/prefect-dask-suite``
  fails. The counts go to the file named by ``GPU_RUNNER_IN_PLACE_REPORT`` (JSON).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys

import prefect_dask
import prefect_dask.task_runners

# Imported before the names are rebound: GPUDaskTaskRunner subclasses the real class,
# and prefect_gpu_dask.flow.runner keeps its own reference to it (DaskTaskRunner.client).
from prefect_gpu_dask.flow.runner import GPUDaskTaskRunner

ORIGINAL = prefect_dask.task_runners.DaskTaskRunner
if not (isinstance(ORIGINAL, type) and issubclass(GPUDaskTaskRunner, ORIGINAL)):
    raise RuntimeError(f"GPUDaskTaskRunner does not subclass {ORIGINAL!r}")
if GPUDaskTaskRunner is ORIGINAL:
    raise RuntimeError("prefect_dask.DaskTaskRunner is already GPUDaskTaskRunner")

built: collections.Counter[str] = collections.Counter()
_original_init = ORIGINAL.__init__


@functools.wraps(_original_init)
def _counting_init(self, *args, **kwargs):
    built[f"{type(self).__module__}.{type(self).__qualname__}"] += 1
    return _original_init(self, *args, **kwargs)


ORIGINAL.__init__ = _counting_init
prefect_dask.DaskTaskRunner = GPUDaskTaskRunner
prefect_dask.task_runners.DaskTaskRunner = GPUDaskTaskRunner

GPU_NAME = f"{GPUDaskTaskRunner.__module__}.{GPUDaskTaskRunner.__qualname__}"
ORIGINAL_NAME = f"{ORIGINAL.__module__}.{ORIGINAL.__qualname__}"
_kept_original: list[str] = []


def pytest_report_header(config):
    runner = sys.modules[GPUDaskTaskRunner.__module__].__file__
    return [f"gpu_runner_in_place: prefect_dask.DaskTaskRunner -> {GPU_NAME} ({runner})"]


def pytest_collection_modifyitems(session, config, items):
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        value = vars(module).get("DaskTaskRunner")
        if value is not None and value is not GPUDaskTaskRunner:
            _kept_original.append(module.__name__)
    if _kept_original:
        raise RuntimeError(
            "gpu_runner_in_place: these test modules still hold the original DaskTaskRunner: "
            + ", ".join(sorted(_kept_original))
        )


def pytest_sessionfinish(session, exitstatus):
    report = {
        "substitute": GPU_NAME,
        "original": ORIGINAL_NAME,
        "built": dict(built),
        "ok": built[GPU_NAME] > 0 and built[ORIGINAL_NAME] == 0 and not _kept_original,
    }
    path = os.environ.get("GPU_RUNNER_IN_PLACE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def pytest_terminal_summary(terminalreporter):
    counts = ", ".join(f"{name}: {n}" for name, n in sorted(built.items())) or "none"
    terminalreporter.write_line(f"gpu_runner_in_place: task runners built in the test process: {counts}")
