"""How a task runs: Prefect task tags + Dask annotations + what workers offer -> ``Route``.

``gpu`` asks for one ``GPU`` slot, ``gpu:N`` for N slots (``gpu:0.5`` lets two tasks
share a GPU), ``gpu:<model>``/``gpu-model:<name>`` and ``gpu-mem:<size>`` for a kind of
GPU, and a user map turns any tag into any resources. Everything is validated up front
so a typo fails at construction or submission, never as a task that waits forever for
a resource nobody has. ``TagRouter.route`` is the one decision about a task run: where
it runs, what it waits for, and what runs around it on its worker. The runner hands the
``Route`` to ``submission``, which applies it and decides nothing itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from prefect_gpu_dask.resources import (
    GPU_RESOURCE,
    GPU_TAG,
    MEMORY_RESOURCE,
    MEMORY_TAG,
    MODEL_TAG,
    Resources,
    model_resource,
    resources_of,
    satisfiable,
    scheduler_identity,
    uses_gpu,
)
from prefect_gpu_dask.settings import GuardScope, OnMissingGPU, validate_tag_resources

# Models ``gpu:<model>`` accepts; any other name goes through ``gpu-model:<name>``, so a
# typo such as ``gpu:0.5x`` still fails instead of asking for a model nobody has.
KNOWN_MODELS = frozenset(
    "b200 b100 gb200 h200 h100 h800 gh200 a100 a800 a40 a30 a10 a10g a16 a2 l40s l40 l4 "
    "v100 t4 p100 p40 p4 k80".split()
)


def _model_of(tag: str) -> str | None:
    if tag.startswith(MODEL_TAG + ":"):
        model = tag[len(MODEL_TAG) + 1 :].strip().lower()
        if not model or not all(c.isalnum() or c == "-" for c in model):
            raise ValueError(f"malformed GPU model tag {tag!r}: use e.g. 'gpu-model:h200'")
        return model
    if tag.startswith(GPU_TAG + ":") and tag[len(GPU_TAG) + 1 :].lower() in KNOWN_MODELS:
        return tag[len(GPU_TAG) + 1 :].lower()
    return None


def _memory_of(tag: str) -> float | None:
    from dask.utils import parse_bytes

    if not tag.startswith(MEMORY_TAG + ":"):
        return None
    text = tag[len(MEMORY_TAG) + 1 :]
    try:
        amount = float(parse_bytes(text))
    except (ValueError, TypeError):
        raise ValueError(
            f"malformed GPU memory tag {tag!r}: {text!r} is not a size (e.g. 'gpu-mem:40GiB')"
        ) from None
    if amount <= 0:
        raise ValueError(f"malformed GPU memory tag {tag!r}: the size must be positive")
    return amount


def parse_gpu_tag(tag: str) -> float | None:
    """``"gpu"`` -> 1.0, ``"gpu:0.5"`` -> 0.5, other tags -> None; malformed -> ValueError."""
    if tag == GPU_TAG:
        return 1.0
    if not tag.startswith(GPU_TAG + ":") or _model_of(tag) is not None:
        return None
    text = tag[len(GPU_TAG) + 1 :]
    try:
        amount = float(text)
    except ValueError:
        raise ValueError(f"malformed GPU tag {tag!r}: {text!r} is not a number") from None
    if not math.isfinite(amount) or amount <= 0:
        raise ValueError(f"malformed GPU tag {tag!r}: the amount must be a positive number")
    return amount


Fallback = OnMissingGPU


@dataclass(frozen=True)
class Route:
    """Everything about how one task run runs: what to ask Dask for, what to do because
    nobody offers it, and what runs around the task's function on its worker.

    ``fallback`` is None when some worker offers ``resources``. Otherwise ``message``
    says why the task runs on CPU with that warning (``"cpu"``) or fails with it
    (``"error"``): at once (``resources`` empty: it runs unrestricted) or, with
    ``wait_s``, if no worker offering ``resources`` joins within that many seconds.

    Around the function: the fallback's warning or failure (``fallback``), the GPU
    memory guard (``guard``), a watchdog for a ``timeout_seconds`` the task may be stuck
    past outside Python (``deadline``), and ``oom_retries`` retries for CUDA
    out-of-memory failures on top of the task's own, each on the GPU worker with the
    most free memory that offers ``resources``; and a host-wide claim on its GPU
    (``claim``), so clusters sharing a GPU take turns.
    """

    resources: Resources
    gpu: bool  # asks for a GPU
    fallback: Fallback | None = None
    message: str | None = None
    wait_s: float = 0.0
    guard: bool = False
    deadline: bool = False
    oom_retries: int = 0
    claim: bool = False  # holds its GPU against other clusters on the host while it runs

    @property
    def waited_for(self) -> Resources | None:
        """The resources a worker that runs it after all offers (it waited for them)."""
        return self.resources if self.wait_s else None


class TagRouter:
    """Turns a task's tags into the Dask resources it must hold while it runs."""

    def __init__(self, tag_resources: Mapping[str, Mapping[str, float]] | None = None):
        self.tag_resources = validate_tag_resources(tag_resources)
        # Tag sets repeat across thousands of submits; resolve each distinct set once.
        self.resources_for = lru_cache(maxsize=1024)(self._resources_for)

    def __reduce__(self):
        # The per-instance cache is not picklable; rebuild it on the other side.
        return (type(self), (self.tag_resources,))

    def _resources_for(self, tags: frozenset[str]) -> Resources:
        resources: Resources = {}
        models: set[str] = set()
        for tag in sorted(tags):
            gpu = parse_gpu_tag(tag)
            model, memory = _model_of(tag), _memory_of(tag)
            if model is not None:
                models.add(model)
                wanted: Mapping[str, float] = {}
            elif memory is not None:
                wanted = {MEMORY_RESOURCE: memory}
            elif gpu is not None:
                wanted = {GPU_RESOURCE: gpu}
            else:
                wanted = self.tag_resources.get(tag, {})
            for name, amount in wanted.items():
                # Two tags asking for the same resource: the larger request wins.
                resources[name] = max(resources.get(name, 0.0), amount)
        if len(models) > 1:
            raise ValueError(f"tags ask for GPU models {sorted(models)}: a task runs on one GPU")
        if models or MEMORY_RESOURCE in resources:
            resources.setdefault(GPU_RESOURCE, 1.0)  # a model or memory tag implies a GPU
        for model in models:  # a model's resource mirrors the share of that GPU
            resources[model_resource(model)] = resources[GPU_RESOURCE]
        return resources

    def resources_for_tags(self, tags: Iterable[str]) -> Resources:
        return self.resources_for(frozenset(tags))

    def route(
        self,
        name: str,
        tags: Iterable[str],
        annotations: Mapping[str, float] | None,
        offers: WorkerOffers | None,
        on_missing: Fallback,
        wait_s: float = 0.0,
        *,
        guard: GuardScope = "off",
        timeout_s: float | None = None,
        oom_retries: int = 0,
        host_gpu_lock: bool = False,
    ) -> Route:
        """Decide how task ``name`` runs.

        ``annotations`` (a ``dask.annotate(resources=...)`` around the submit) override
        what the tags ask for, resource by resource. ``offers``: what the cluster's
        workers advertise (None: not known, route by the request alone). ``wait_s``:
        how long a cluster that can still grow gets to offer what nobody offers yet.
        ``guard``: which tasks the memory guard measures (``"off"``: none, the guard is
        not running). ``timeout_s``: the task's ``timeout_seconds``. ``oom_retries``:
        out-of-memory retries a task asking for a GPU gets. ``host_gpu_lock``: a task
        that runs on a GPU holds it against other clusters on its host.
        """
        resources = self.resources_for_tags(tags)
        if annotations:
            resources = {**resources, **annotations}
        where = self._where(name, resources, offers, on_missing, wait_s)
        # It may still run on what it asked for: at once, or once a worker offering it joins.
        as_asked = where.fallback is None or where.wait_s > 0
        return dataclasses.replace(
            where,
            guard=as_asked and (guard == "all" or (guard == "gpu" and where.gpu)),
            deadline=bool(timeout_s),
            oom_retries=oom_retries if where.gpu else 0,
            claim=host_gpu_lock and as_asked and where.gpu,
        )

    @staticmethod
    def _where(
        name: str,
        resources: Resources,
        offers: WorkerOffers | None,
        on_missing: Fallback,
        wait_s: float,
    ) -> Route:
        if not resources or offers is None or offers.can_serve(resources):
            return Route(resources, uses_gpu(resources))
        if wait_s > 0:
            why = f"no worker offering them joined within {wait_s:g} s"
        else:
            why = f"no worker offers them (workers offer {offers.latest() or 'nothing'})"
        message = f"Task {name!r} asked for resources {resources} but {why}"
        if on_missing == "cpu":
            message += ": running on CPU instead (on_missing_gpu='cpu')"
        else:
            message += " (on_missing_gpu='error')"
        if wait_s > 0:
            return Route(resources, uses_gpu(resources), on_missing, message, wait_s)
        return Route({}, False, on_missing, message)


class WorkerOffers:
    """What the cluster's workers advertise, as last heard from the scheduler.

    ``can_serve`` answers from the last answer, refreshing a stale one in the
    background (a blocking round trip on every GPU submit a second after the last one
    was the cost); a request the last answer cannot serve asks again at once, since a
    worker may just have joined.
    """

    def __init__(
        self,
        identity: Callable[[], Mapping[str, Any]],
        identity_async: Callable[[], Any] | None = None,
        spawn: Callable[[Callable[[], Any]], None] | None = None,
        max_age_s: float = 1.0,
        miss_max_age_s: float = 0.1,
    ):
        self._identity = identity
        self._identity_async = identity_async
        self._spawn = spawn
        self.max_age_s = max_age_s
        self.miss_max_age_s = miss_max_age_s
        self._offered: list[Resources] = []
        self.asked_at = float("-inf")
        self.refreshing = False
        self._lock = threading.Lock()

    @classmethod
    def of_client(cls, client: Any) -> WorkerOffers:
        return cls(
            identity=lambda: scheduler_identity(client),
            identity_async=lambda: client.scheduler.identity(n_workers=-1),
            spawn=client.loop.add_callback,
        )

    def latest(self, max_age_s: float | None = None) -> list[Resources]:
        """The offers, at most ``max_age_s`` old (asking the scheduler now if older)."""
        now = time.monotonic()
        if max_age_s is not None and now - self.asked_at > max_age_s:
            self._offered = resources_of(self._identity())
            self.asked_at = now
        return self._offered

    def refresh(self) -> list[Resources]:
        return self.latest(max_age_s=0)

    def refresh_soon(self) -> None:
        """Ask the scheduler again in the background (safe on the client's event loop)."""
        self.asked_at = float("-inf")
        self._soon()

    def can_serve(self, resources: Mapping[str, float]) -> bool:
        if satisfiable(resources, self._soon()):
            return True
        return satisfiable(resources, self.latest(self.miss_max_age_s))

    def _soon(self) -> list[Resources]:
        stale = time.monotonic() - self.asked_at > self.max_age_s
        if stale and self._spawn is not None and self._identity_async is not None:
            with self._lock:
                start, self.refreshing = not self.refreshing, True
            if start:
                self._spawn(self._refresh_async)
        return self._offered

    async def _refresh_async(self) -> None:
        assert self._identity_async is not None  # spawned only with it
        try:
            asked_at = time.monotonic()  # an answer is as old as its question
            self._offered = resources_of(await self._identity_async())
            self.asked_at = asked_at
        except (OSError, asyncio.TimeoutError):  # a connection lost: the next submit that needs it asks again
            pass
        finally:
            self.refreshing = False
