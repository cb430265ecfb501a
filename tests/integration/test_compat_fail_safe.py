"""Every private name ``_compat`` reaches for, removed one at a time: a flow with a
``gpu`` task, a plain task, a Dask collection computed inside a task and a map still
runs to ``Completed`` on an in-process cluster (so the removal holds on its worker
too), and a feature that found its name gone says so once at WARNING.

The cluster is in-process and on CPU: a ``gpu`` task falls back to CPU after its
wait, so the paths that label workers, hand work back and run it elsewhere run too.
"""

from __future__ import annotations

import importlib
import logging

import pytest
from prefect import flow, task

from prefect_gpu_dask import GPUDaskTaskRunner, _compat

# (module, attribute path) of the private upstream names whose removal upstream itself
# survives. The others are names Prefect's or Dask's own code uses too (removing them
# breaks the library, whatever this package does), and a rename upstream reaches them as
# a missing or reshaped name: their entries are called directly on objects without it
# (``test_each_entry_answers_its_fallback_where_its_name_is_gone``).
PRIVATE_NAMES = [
    ("prefect.concurrency.services", "_no_limits_cache"),
    ("prefect.server.api.server", "SubprocessASGIServer"),
    ("prefect.events.worker", "EventsWorker._client_override"),
    ("distributed.diagnostics.nvml", "_pynvml_handles"),
    ("distributed.core", "clean_exception"),
    ("multiprocessing.forkserver", "_forkserver"),
]


@task(tags=["gpu"])
def on_gpu(x: int) -> int:
    return x + 1


@task
def computes() -> int:
    import dask.array as da

    return int(da.arange(10, chunks=5).sum().compute())


@task
def plain(x: int) -> int:
    return x * 2


def run_flow() -> tuple[str, int]:
    runner = GPUDaskTaskRunner(
        cluster_kwargs={
            "processes": False,
            "n_workers": 1,
            "threads_per_worker": 2,
            "dashboard_address": None,
        },
        gpu_wait_s=1,
        host_cluster=False,
    )

    @flow(task_runner=runner)
    def nightly() -> int:
        a = on_gpu.submit(1)
        b = computes.submit()
        c = plain.map([1, 2, 3])
        return a.result() + b.result() + sum(f.result() for f in c)

    state = nightly(return_state=True)
    return state.type.value, state.result(raise_on_failure=False)


def _remove(monkeypatch: pytest.MonkeyPatch, module: str, path: str) -> None:
    owner = importlib.import_module(module)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    if name not in vars(owner):
        pytest.skip(f"{module}.{path} is not in this version: nothing to remove")
    monkeypatch.delattr(owner, name)


@pytest.mark.parametrize(("module", "path"), PRIVATE_NAMES, ids=[f"{m}.{p}" for m, p in PRIVATE_NAMES])
def test_a_flow_completes_with_the_private_name_gone(module, path, monkeypatch, caplog):
    monkeypatch.setattr(_compat, "_switched_off", set())
    _remove(monkeypatch, module, path)
    with caplog.at_level(logging.WARNING, logger="prefect_gpu_dask"):
        state, value = run_flow()
    assert (state, value) == ("COMPLETED", 2 + 45 + 12)
    warnings = [r.getMessage() for r in caplog.records if " is off: " in r.getMessage()]
    assert len(warnings) == len(set(warnings)), warnings  # each feature says so once
    assert len(warnings) == len(_compat.switched_off())


def test_with_every_name_in_place_no_feature_switches_off(monkeypatch):
    monkeypatch.setattr(_compat, "_switched_off", set())
    assert run_flow() == ("COMPLETED", 2 + 45 + 12)
    assert _compat.switched_off() == frozenset()


def test_the_tag_gate_steps_aside_where_the_engine_has_no_such_names(monkeypatch):
    import prefect.task_engine as engine

    monkeypatch.setattr(_compat, "_switched_off", set())
    monkeypatch.delattr(engine, "_concurrency")
    with _compat.tag_slot_requests_where(lambda names: False):
        assert not hasattr(engine, "_concurrency")  # nothing installed in its place
    assert _compat.switched_off() == {"skipping tag-slot requests for tags without a limit"}


class _Nothing:
    """An upstream object whose private names have all gone."""


def test_each_entry_answers_its_fallback_where_its_name_is_gone(monkeypatch):
    from distributed.deploy.spec import SpecCluster
    from prefect.context import SettingsContext, get_settings_context

    monkeypatch.setattr(_compat, "_switched_off", set())
    nothing = _Nothing()
    assert _compat.reschedule(nothing, "key", "tcp://w", "s") is None
    assert _compat.drop_resource_restrictions(nothing, ["key"], "s") == []
    assert _compat.worker_resources(nothing) == {}
    assert _compat.set_future_final_state(7, "state") is None  # an int takes no attribute
    assert _compat.as_on_worker(nothing, lambda x: x + 1, 1) == 2
    assert _compat.current_task_restrictions() is None
    monkeypatch.delattr(SpecCluster, "_instances")
    assert _compat.spec_cluster_of(nothing) is None

    # A Prefect whose context classes keep their ContextVar under another name.
    settings = get_settings_context()
    monkeypatch.delattr(SettingsContext, "__var__")
    monkeypatch.setattr("prefect.context.ContextModel.__enter__", _enter_renamed)
    monkeypatch.setattr("prefect.context.ContextModel.__exit__", _exit_renamed)
    with _compat.use(settings) as entered:
        assert entered is not settings and entered.settings == settings.settings
    assert "sharing one Prefect context object between threads" in _compat.switched_off()
    assert len(_compat.switched_off()) == 6, _compat.switched_off()


_RENAMED = __import__("contextvars").ContextVar("renamed")


def _enter_renamed(self):
    self._token = _RENAMED.set(self)
    return self


def _exit_renamed(self, *_):
    _RENAMED.reset(self._token)
    self._token = None
