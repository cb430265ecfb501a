"""Every private Prefect, Dask and NVML API this package uses, in one place, and the
one way it asks distributed which worker it runs on.

Each entry says why it is needed and which public API would replace it. Nothing else
in the package reaches into another library's private names; when an upstream release
moves one of these, this is the only file to change.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

logger = logging.getLogger("prefect_gpu_dask")
_switched_off: set[str] = set()


def switch_off(feature: str, exc: BaseException) -> None:
    """An upstream name this package reaches for has moved: ``feature`` runs as upstream's
    own code would from now on in this process, said once at WARNING."""
    if feature not in _switched_off:
        _switched_off.add(feature)
        logger.warning(
            "prefect-gpu-dask: %s is off: the installed Prefect/Dask moved a private API it uses (%r)",
            feature,
            exc,
        )


def switched_off() -> frozenset[str]:
    """The features switched off in this process (``switch_off``)."""
    return frozenset(_switched_off)


MOVED = (AttributeError, ImportError, KeyError, TypeError)  # what a moved private name raises


def fail_safe(
    feature: str, fallback: Callable[..., Any]
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """An entry of this module: where the upstream name it reaches for has moved, its
    ``feature`` switches off (``switch_off``) and ``fallback`` answers, now and from then on."""

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def entry(*args: Any, **kwargs: Any) -> Any:
            if feature in _switched_off:
                return fallback(*args, **kwargs)
            try:
                return function(*args, **kwargs)
            except MOVED as exc:
                switch_off(feature, exc)
                return fallback(*args, **kwargs)

        entry.feature = feature  # type: ignore[attr-defined]
        return entry

    return wrap


def _none(*_: Any, **__: Any) -> None:
    return None


# -- Prefect ---------------------------------------------------------------------


@contextlib.contextmanager
def use(context: Any, context_type: Any = None) -> Iterator[Any]:
    """``context`` (a Prefect ``ContextModel``: settings, client, flow run) as this
    thread's, where one object serves every worker thread at once.

    ``ContextModel.__enter__`` keeps its reset token on the object, so one object cannot
    be entered by several threads: this sets the ``ContextVar`` behind its class
    (``__var__``) directly. Where that name moved, a shallow copy is entered the public
    way instead (``ContextModel.__enter__``, not a subclass's, which may open clients).
    ``context_type`` names the class whose variable takes it where ``context`` stands in
    for one (the flow's cached serialisations); with the name moved, a stand-in is not
    entered and the context in force is serialised as Prefect would.
    Public replacement: a thread-safe ``ContextModel.use()`` returning a token.
    """
    var = getattr(context_type or type(context), "__var__", None)
    if isinstance(var, contextvars.ContextVar) and "sharing one Prefect context object" not in _switched_off:
        token = var.set(context)
        try:
            yield context
        finally:
            var.reset(token)
        return
    switch_off("sharing one Prefect context object between threads", AttributeError("__var__"))
    from prefect.context import ContextModel

    if not isinstance(context, ContextModel):
        yield context
        return
    copy = context.model_copy()
    ContextModel.__enter__(copy)
    try:
        yield copy
    finally:
        ContextModel.__exit__(copy)


@fail_safe("results kept for futures of a recycled worker", _none)
def set_future_final_state(future: Any, state: Any) -> None:
    """Give a ``PrefectDaskFuture`` its final state, so it never asks Dask again.

    Used when a recycled worker's results move into the flow before the restart.
    Public replacement: a ``PrefectWrappedFuture`` constructor argument for a known
    final state.
    """
    future._final_state = state


def future_final_state(future: Any) -> Any:
    """The state set by ``set_future_final_state`` (or Prefect's own), else None."""
    return getattr(future, "_final_state", None)


_TAG_SLOTS_NEEDED: contextvars.ContextVar[Callable[[list[str]], bool] | None] = contextvars.ContextVar(
    "prefect_gpu_dask_tag_slots_needed", default=None
)
_tag_gate_lock = threading.Lock()


@contextlib.contextmanager
def tag_slot_requests_where(needed: Callable[[list[str]], bool]) -> Iterator[None]:
    """In this context, Prefect's task engine asks the API for slots of its tags'
    concurrency limits (``tag:<tag>``) only where ``needed(names)`` says so.

    The engine sends that request for every tagged task run, a database write even where
    no limit of those names exists (the server then updates no row). ``needed`` reads
    whether a limit exists; where one does, the engine's own request runs unchanged. The
    tags stay on the task run. Public replacement: an engine option to skip the request
    for tags without a limit (the engine calls its module-level
    ``_concurrency``/``_aconcurrency`` for every task run).
    """
    installed = _install_tag_slot_gate()
    token = _TAG_SLOTS_NEEDED.set(needed)
    try:
        yield
    finally:
        _TAG_SLOTS_NEEDED.reset(token)
        if installed:
            _uninstall_tag_slot_gate()


def tag_limit_memory_s() -> float:
    """How long Prefect's client remembers that a set of tag limits does not exist.

    Public replacement: a client setting for it (it is ``prefect.concurrency.services``'
    module-level ``TTLCache``).
    """
    from prefect.concurrency import services

    cache = getattr(services, "_no_limits_cache", None)
    return float(getattr(cache, "ttl", 5.0))


_tag_gate_users = 0
_engine_concurrency: tuple[Any, Any] | None = None


def _install_tag_slot_gate() -> bool:
    """Gate the engine's tag-slot requests while any task run of this process is inside
    ``tag_slot_requests_where``; the engine's own functions come back as the last leaves.
    False (and the engine left as it is) where they moved."""
    global _tag_gate_users, _engine_concurrency
    import prefect.task_engine as engine

    with _tag_gate_lock:
        if _tag_gate_users == 0:
            try:
                originals = (engine._concurrency, engine._aconcurrency)
            except AttributeError as exc:
                switch_off("skipping tag-slot requests for tags without a limit", exc)
                return False
            _engine_concurrency = originals
            engine._concurrency, engine._aconcurrency = _gated(*originals)
        _tag_gate_users += 1
        return True


def _uninstall_tag_slot_gate() -> None:
    global _tag_gate_users, _engine_concurrency
    import prefect.task_engine as engine

    with _tag_gate_lock:
        _tag_gate_users -= 1
        if _tag_gate_users == 0 and _engine_concurrency is not None:
            engine._concurrency, engine._aconcurrency = _engine_concurrency
            _engine_concurrency = None


def _gated(engine_concurrency: Any, engine_aconcurrency: Any) -> tuple[Any, Any]:
    def skip(names: Any) -> bool:
        needed = _TAG_SLOTS_NEEDED.get()
        return needed is not None and not needed(list(names))

    @contextlib.contextmanager
    def concurrency(names: Any, *args: Any, **kwargs: Any) -> Iterator[None]:
        if names and skip(names):
            yield
            return
        with engine_concurrency(names, *args, **kwargs):
            yield

    @contextlib.asynccontextmanager
    async def aconcurrency(names: Any, *args: Any, **kwargs: Any) -> AsyncIterator[None]:
        if names and skip(names):
            yield
            return
        async with engine_aconcurrency(names, *args, **kwargs):
            yield

    return concurrency, aconcurrency


class _EventsClientOfTheCurrentAPI:
    """``EventsWorker._client_override`` read at each ``EventsWorker.instance()``: a
    Prefect server's events client for the API URL of the caller's settings, so the
    events worker's key holds that URL. ``None`` (Prefect's own choice) for Prefect
    Cloud, whose client Prefect keys on its URL already, and where no URL is set."""

    def __get__(self, instance: Any, owner: Any) -> Any:
        from prefect.events.clients import PrefectEventsClient
        from prefect.events.worker import emit_events_to_cloud
        from prefect.settings import PREFECT_API_URL

        url = PREFECT_API_URL.value()
        if not url or not isinstance(url, str) or emit_events_to_cloud():
            return None
        return (PrefectEventsClient, (("api_url", url),))


_events_lock = threading.Lock()
_events_users = 0


@contextlib.contextmanager
def events_per_api_url() -> Iterator[None]:
    """While any thread of this process is inside, Prefect's ``EventsWorker.instance()``
    gives one events worker per API URL, as ``APILogWorker.instance()`` does; Prefect's
    own choice comes back as the last one leaves. Left as it is where another override
    is set (Prefect's process pool sets one in its processes).

    Prefect keys the events worker of a Prefect server on nothing of the server's. In a
    Dask worker process serving flow runs that report to different APIs (each its own
    temporary server, on a shared cluster), the first flow run's events worker would
    send every later flow run's task-run events to the first one's API, and the later
    flow runs' own servers would record none of their task runs. Public replacement:
    ``EventsWorker.instance()`` keying a server's events client on its API URL.
    """
    global _events_users
    from prefect.events.worker import EventsWorker

    counted = False
    with _events_lock:
        current = EventsWorker.__dict__.get("_client_override", KeyError)
        if current is KeyError:
            switch_off("one events worker per API URL", KeyError("EventsWorker._client_override"))
        elif current is None or current is _EVENTS_OVERRIDE:
            EventsWorker._client_override = _EVENTS_OVERRIDE  # type: ignore[assignment]
            _events_users += 1
            counted = True
    try:
        yield
    finally:
        if counted:
            with _events_lock:
                _events_users -= 1
                if _events_users == 0 and EventsWorker.__dict__.get("_client_override") is _EVENTS_OVERRIDE:
                    EventsWorker._client_override = None


_EVENTS_OVERRIDE = _EventsClientOfTheCurrentAPI()


# -- distributed -----------------------------------------------------------------


def imported_module(name: str) -> Any:
    """``sys.modules[name]`` once its import has finished, else None.

    A module another thread is still importing is already in ``sys.modules``, with only
    part of its attributes. Public replacement: none in ``importlib``; this reads the
    flag the import system keeps on the module's spec while it runs
    (``ModuleSpec._initializing``).
    """
    import sys

    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


@fail_safe("workers sharing the flow run's temporary Prefect server", _none)
def started_ephemeral_api_server() -> Any:
    """Prefect's ephemeral API server for this process, started (at once where it runs).

    Prefect stops it from an ``atexit`` hook it registers when it first starts it, so a
    hook registered after this call runs before the server stops. Public replacement:
    an ephemeral server that drains its event consumers before it stops.
    """
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()  # already running for this process: returns at once
    return server


def _metadata_through_a_client(keys: list[str]) -> Any:
    from distributed import get_client

    return get_client().get_metadata(list(keys), default=None)


@fail_safe("reading a flow run's shared objects over the worker's own connection", _metadata_through_a_client)
def scheduler_metadata(keys: list[str]) -> Any:
    """``Client.get_metadata(keys, default=None)`` from a task's thread on a worker, over
    the worker's own connection to its scheduler: a worker client would be one more
    connection and event-loop client per worker process. Public replacement: a
    ``Worker.get_metadata``."""
    from distributed import get_worker
    from distributed.utils import sync

    worker = get_worker()
    return sync(worker.loop, worker.scheduler.get_metadata, keys=list(keys), default=None)


def current_worker() -> Any:
    """The Dask worker this code runs in (a task's thread or the worker's event loop),
    or None outside any worker. Public replacement: a ``distributed.get_worker()`` that
    returns None instead of raising ``ValueError``.
    """
    import distributed

    try:
        return distributed.get_worker()
    except ValueError:
        return None


@fail_safe("a recycling worker kept from new tasks", _none)
def pause_worker(dask_scheduler: Any, address: str, stimulus_id: str) -> None:
    """Give a worker no new tasks from now on (as its own ``paused`` status would).
    Public replacement: a ``Scheduler`` method to pause a worker from outside it."""
    dask_scheduler.handle_worker_status_change("paused", address, stimulus_id)


@fail_safe("a task run whose worker died ending Crashed, run once", _none)
def annotate(ts: Any, marks: dict[str, Any]) -> None:
    """Add ``marks`` to a scheduler task's annotations, which travel with it to the
    worker that runs it next. Public replacement: annotations set on a task after
    submission (only ``dask.annotate`` at graph time exists)."""
    ts.annotations = {**(ts.annotations or {}), **marks}


@fail_safe("handing queued work back before a recycle", _none)
def reschedule(dask_scheduler: Any, key: str, worker: str, stimulus_id: str) -> None:
    """Send a task a worker holds but never started back to the scheduler.

    Public replacement: ``Scheduler.reschedule`` as a public method (it is the handler
    behind the worker's ``reschedule`` message, only reachable from that worker).
    """
    dask_scheduler._reschedule(key, worker, stimulus_id=stimulus_id)


@fail_safe("keeping a local cluster's restarting worker", _none)
def spec_cluster_of(dask_scheduler: Any) -> Any:
    """The ``SpecCluster`` (``LocalCluster``, ``LocalCUDACluster``) whose scheduler this
    is, when it lives in the scheduler's process; else None.

    Needed because such a cluster may close a restarting worker's nanny (see
    ``scheduler.recycling.replacements``). Public replacement: a scheduler-side hook to
    reach the cluster that owns it, or a ``SpecCluster`` that cancels the lost-worker
    timer of a name once a worker of that name registers again.
    """
    from distributed.deploy.spec import SpecCluster

    for cluster in list(SpecCluster._instances):
        if getattr(cluster, "scheduler", None) is dask_scheduler:
            return cluster
    return None


@fail_safe("running a task whose resources no worker offers elsewhere", lambda *a, **k: [])
def drop_resource_restrictions(dask_scheduler: Any, keys: list[str], stimulus_id: str) -> list[str]:
    """Let tasks not started yet run without their resource restrictions.

    Used when no worker offering a task's resources joined in time (``scheduler.fallback``).
    Public replacement: a ``Scheduler.set_restrictions`` for resources (it takes worker
    restrictions only).
    """
    released, recommendations = [], {}
    for key in keys:
        ts = dask_scheduler.tasks.get(key)
        if ts is None or not ts.resource_restrictions:
            continue
        if ts.state not in ("released", "waiting", "no-worker"):
            continue  # already running, or done
        ts.resource_restrictions = None
        released.append(key)
        if ts.state == "no-worker":
            recommendations[key] = "processing"
    if recommendations:
        dask_scheduler.transitions(recommendations, stimulus_id)
    return released


@fail_safe("reading what a worker offers", lambda worker: {})
def worker_resources(worker: Any) -> dict[str, float]:
    """The resources a worker offers. Public replacement: a ``Worker.total_resources``
    property (the figure lives on its state machine)."""
    return dict(worker.state.total_resources)


async def add_worker_resources(dask_worker: Any, resources: dict[str, float]) -> None:
    """Offer ``resources`` on ``dask_worker`` from now on, on the worker and on the
    scheduler, keeping the counts of what its running tasks use.

    Public replacement: ``Worker.set_resources``, whose scheduler half
    (``Scheduler.add_resources``) zeroes those counts: a worker labelled while a ``gpu``
    task runs there would end with ``GPU`` used at -1, and take two ``gpu`` tasks at once.
    """
    try:
        state = dask_worker.state
        available, total = state.available_resources, state.total_resources
    except AttributeError as exc:
        switch_off("keeping resource counts while labelling a worker", exc)
        await dask_worker.set_resources(**resources)
        return
    for name, amount in resources.items():
        available[name] = available.get(name, 0) + amount - total.get(name, 0)
        total[name] = amount
    await run_on_scheduler_from_worker(
        dask_worker, set_worker_resources, worker=dask_worker.contact_address, resources=dict(resources)
    )


@fail_safe(
    "keeping resource counts on the scheduler",
    lambda dask_scheduler, worker, resources: dask_scheduler.add_resources(
        worker=worker, resources=resources
    ),
)
def set_worker_resources(dask_scheduler: Any, worker: str, resources: dict[str, float]) -> None:
    """Change what a worker offers, on the scheduler only, keeping its running tasks'
    resources counted (its own state still runs what it holds).

    Public replacement: ``Scheduler.add_resources``, which also zeroes the counts of
    resources its running tasks use.
    """
    ws = dask_scheduler.workers[worker]
    for name, amount in resources.items():
        ws.resources[name] = amount
        ws.used_resources.setdefault(name, 0)
        dask_scheduler.resources.setdefault(name, {})[worker] = amount


async def run_on_scheduler_from_worker(dask_worker: Any, function: Any, **kwargs: Any) -> Any:
    """``Client.run_on_scheduler`` from a worker's event loop, over its scheduler RPC.

    Public replacement: ``distributed.get_client().run_on_scheduler`` (a client of its
    own per worker, and blocking where this awaits).
    """
    from distributed.core import clean_exception
    from distributed.protocol.pickle import dumps

    response = await dask_worker.scheduler.run_function(
        function=dumps(function), args=dumps(()), kwargs=dumps(kwargs), wait=True
    )
    if response["status"] == "error":
        _, exc, tb = clean_exception(**response)
        assert exc is not None  # an error reply carries its exception
        raise exc.with_traceback(tb)
    return response["result"]


def current_task_restrictions() -> dict[str, float] | None:
    """In a Dask task: the resources it asked for. Public replacement: a task-level
    ``get_task_resources()`` (the worker keeps them on its state machine's task)."""
    worker = current_worker()
    try:
        ts = worker.state.tasks.get(worker.get_current_task())
    except (AttributeError, KeyError):  # not in a task (or outside any worker)
        return None
    return ts.resource_restrictions if ts is not None else None


PROMPT_S = 0.0  # a prompt stream writes as soon as its last write is done


def send_promptly(stream: Any, interval_s: float = PROMPT_S) -> bool:
    """Let a ``BatchedSend`` hold a message back at most ``interval_s`` after its last
    write began, instead of Dask's fixed interval (10 ms on a client's stream to the
    scheduler, 2 ms on a worker's); messages that come while a write is under way still
    leave together. Whether it could. Why: ``worker.stream``.

    Public replacement: a Dask setting for the batched streams' interval (none exists).
    """
    if stream is None or not hasattr(stream, "interval"):
        return False
    stream.interval = min(stream.interval, interval_s)
    return True


def _first_visible_handle() -> Any:
    """The same handle through pynvml's public calls (no MIG parent lookup)."""
    import os

    import pynvml

    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    if first.startswith(("GPU-", "MIG-")):
        return pynvml.nvmlDeviceGetHandleByUUID(first)
    return pynvml.nvmlDeviceGetHandleByIndex(int(first))


@fail_safe("NVML handle of the worker's own GPU through distributed", _first_visible_handle)
def nvml_worker_handle() -> Any:
    """NVML handle of this process's GPU (first ``CUDA_VISIBLE_DEVICES`` entry, an
    index or a ``GPU-``/``MIG-`` UUID), resolved as distributed's dashboard does.

    Public replacement: ``dask_cuda.utils.get_gpu_handle`` (needs dask-cuda, which is
    not importable without CUDA bindings) or a public resolver in distributed.
    """
    from distributed.diagnostics import nvml

    return nvml._pynvml_handles()


@fail_safe("get_worker() in a worker's set-up thread", lambda worker, function, *args: function(*args))
def as_on_worker(worker: Any, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` in this thread as a task's code runs on ``worker``: with
    ``get_worker()`` (and so ``get_client()``, ``Event``, ``Lock``) answering for it.
    Public replacement: none (``distributed.worker._worker_cvar`` is what a task gets)."""
    from distributed.worker import _worker_cvar

    token = _worker_cvar.set(worker)
    try:
        return function(*args)
    finally:
        _worker_cvar.reset(token)


# -- nvidia-ml-py ----------------------------------------------------------------


# -- Python's multiprocessing ----------------------------------------------------


@fail_safe("a fork server started again in a changed environment", _none)
def stop_fork_server() -> None:
    """Stop this process's ``multiprocessing`` fork server; the next fork request starts
    a new one.

    Used where the server was started ahead of the first local cluster and the flow's
    environment changed before that cluster started: a new server, in the environment
    the workers must see, keeps their start a fork. Public replacement: a public
    ``multiprocessing.forkserver`` call that stops the server (only ``ForkServer._stop``,
    there for CPython's own tests, exists in 3.10–3.13).
    """
    import multiprocessing.forkserver

    multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]  # private, untyped


def is_main_process() -> bool:
    """Whether this process is a program's own, not a ``multiprocessing`` child: one
    started, or one still running its parent's main module before its target (where a
    flow script's module level makes a runner again).

    Used to start the fork server as a flow script makes its runner, never in a worker
    process re-running that script. Public replacement: ``multiprocessing.parent_process()``
    alone, were it set before a child runs its parent's main module (it is set after);
    ``_inheriting`` is what ``multiprocessing.spawn`` itself checks there.
    """
    import multiprocessing

    inheriting = getattr(multiprocessing.current_process(), "_inheriting", False)
    return multiprocessing.parent_process() is None and not inheriting
