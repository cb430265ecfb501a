"""Which of a task run's tags have a concurrency limit, read from Prefect's API.

Before each tagged task run, Prefect's engine asks the API for slots of every
``tag:<tag>`` limit, and its client then remembers for a few seconds that no such limit
exists. The request is a database write even where no limit exists (the server updates
no row); on a SQLite server it fails at once when another connection wrote since it
began reading, the server answers 503, and the client waits 2 s or more before asking
again, while every other tagged run of that worker process waits behind it.

``TagLimits`` asks the same question with a read, remembered just as long, so a run
whose tags have no limit never writes: the tags stay on the run, a limit holds as soon
as Prefect's own client would see it, and where one exists the engine's request runs
unchanged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from prefect.exceptions import ObjectNotFound

from prefect_gpu_dask import _compat


class TagLimits:
    """``exists(names)``: whether any of these limit names exists, read at most once per
    ``max_age_s`` per set of names (Prefect's own client remembers "none" as long)."""

    def __init__(self, client: Any, max_age_s: float | None = None) -> None:
        self._client = client
        self.max_age_s = _compat.tag_limit_memory_s() if max_age_s is None else max_age_s
        self._known: dict[frozenset[str], tuple[float, bool]] = {}
        self._lock = threading.Lock()

    def exists(self, names: Iterable[str]) -> bool:
        key = frozenset(names)
        with self._lock:
            read_at, answer = self._known.get(key, (float("-inf"), True))
        if time.monotonic() - read_at < self.max_age_s:
            return answer
        read_at, answer = time.monotonic(), self._read(key)
        with self._lock:
            self._known[key] = (read_at, answer)
        return answer

    def _read(self, names: frozenset[str]) -> bool:
        for name in sorted(names):
            try:
                self._client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                continue
            except Exception:
                return True  # the API cannot say: the engine's request decides
            return True  # any limit, active or not: the engine's request runs as ever
        return False
