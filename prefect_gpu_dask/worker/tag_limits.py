"""Which of a task run's tags have a concurrency limit, read from Prefect's API.

Before each tagged task run, Prefect's engine asks the API for slots of every
``tag:<tag>`` limit, and its client then remembers for a few seconds that no such limit
exists. The request is a database write even where no limit exists (the server updates
no row); on a SQLite server it fails at once when another connection wrote since it
began reading, the server answers 503, and the client waits 2 s or more before asking
again, while every other tagged run of that worker process waits behind it.

``TagLimits`` asks the same question with a read of the limits that exist, remembered
just as long, so a run whose tags have no limit never writes: the tags stay on the run,
a limit holds as soon as Prefect's own client would see it, and where one exists the
engine's request runs unchanged.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Iterable
from typing import Any

import httpx

from prefect_gpu_dask import _compat

PAGE = 200  # limits read per request


class TagLimits:
    """``exists(names)``: whether a concurrency limit of any of these names exists, from
    the names of every limit, never older than ``max_age_s`` (Prefect's own client
    remembers "none" as long). Unknown (the API could not be read) counts as existing.

    While task runs keep asking, the names are read again in the background once half
    that age has passed: a read waits on a busy server, and a run asking meanwhile, the
    next one on a GPU's only slot among them, would wait with it. Only an answer older
    than ``max_age_s`` is waited for.
    """

    def __init__(self, client: Any, max_age_s: float | None = None) -> None:
        self._client = client
        self.max_age_s = _compat.tag_limit_memory_s() if max_age_s is None else max_age_s
        self._names: frozenset[str] | None = None
        self._read_at = float("-inf")  # when the read behind ``_names`` began
        self._lock = threading.Lock()  # one reader at a time; the others wait for its answer
        self._refreshing = False

    def exists(self, names: Iterable[str]) -> bool:
        with self._lock:
            age = time.monotonic() - self._read_at
            if age >= self.max_age_s:
                started = time.monotonic()
                self._names, self._read_at = self._read(), started
            elif age >= self.max_age_s / 2 and not self._refreshing:
                self._refresh_in_background()
            known = self._names
        return known is None or not known.isdisjoint(names)

    def _refresh_in_background(self) -> None:
        """Called holding the lock. In the caller's context: the settings the task run's
        client reads (retries) are its flow run's."""
        reader = threading.Thread(
            target=contextvars.copy_context().run, args=(self._refresh,), name="tag-limits", daemon=True
        )
        try:
            reader.start()
        except RuntimeError:  # no thread to spare: the next stale answer is read in place
            return
        self._refreshing = True

    def _refresh(self) -> None:
        started = time.monotonic()
        try:
            names = self._read()
            with self._lock:
                if started > self._read_at:  # a waiting reader may have been quicker
                    self._names, self._read_at = names, started
        finally:
            with self._lock:
                self._refreshing = False

    def _read(self) -> frozenset[str] | None:
        names: list[str] = []
        try:
            while True:
                page = self._client.read_global_concurrency_limits(limit=PAGE, offset=len(names))
                names += [limit.name for limit in page]
                if len(page) < PAGE:
                    return frozenset(names)
        except (httpx.HTTPError, OSError):  # the API unreachable or refusing
            return None  # the engine's request decides
