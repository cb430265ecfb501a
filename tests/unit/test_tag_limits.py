"""``TagLimits`` against a scripted API client whose reads are slow, as a busy server's
are: runs asking while a read is due never wait for it, and an answer is never older
than ``max_age_s``. (Against a real API: ``tests/integration/test_tag_limits.py``.)"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from prefect_gpu_dask.worker.tag_limits import TagLimits

READ_S = 0.3
MAX_AGE_S = 1.0


class SlowLimits:
    """``read_global_concurrency_limits`` as Prefect's client has it, taking ``READ_S``."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.reads = 0
        self.lock = threading.Lock()

    def read_global_concurrency_limits(self, limit: int, offset: int) -> list[SimpleNamespace]:
        time.sleep(READ_S)
        with self.lock:
            self.reads += 1
            return [SimpleNamespace(name=n) for n in self.names[offset : offset + limit]]


def test_runs_asking_while_they_keep_coming_never_wait_for_a_read():
    api = SlowLimits()
    limits = TagLimits(api, max_age_s=MAX_AGE_S)
    assert not limits.exists(["tag:gpu"])  # the first answer is waited for
    slowest, started = 0.0, time.monotonic()
    while time.monotonic() - started < 3 * MAX_AGE_S:
        asked = time.monotonic()
        limits.exists(["tag:gpu"])
        slowest = max(slowest, time.monotonic() - asked)
        time.sleep(0.01)
    assert slowest < READ_S / 3, f"a run waited {slowest:.2f} s for the limits"
    assert api.reads >= 3  # read again in the background, about every half max_age_s


def limit_made_after_the_first_answer() -> TagLimits:
    """``TagLimits`` that answered "no limit" for ``tag:gpu``, whose API has one since."""
    api = SlowLimits()
    limits = TagLimits(api, max_age_s=MAX_AGE_S)
    assert not limits.exists(["tag:gpu"])
    with api.lock:
        api.names.append("tag:gpu")
    return limits


def test_a_limit_made_is_seen_within_max_age():
    limits = limit_made_after_the_first_answer()
    made = time.monotonic()
    while True:
        seen = limits.exists(["tag:gpu"])
        assert seen or time.monotonic() - made <= MAX_AGE_S + READ_S, "the new limit was not seen in time"
        if seen:
            break
        time.sleep(0.01)


def test_an_answer_older_than_max_age_is_read_again_before_it_is_given():
    limits = limit_made_after_the_first_answer()
    time.sleep(MAX_AGE_S)  # nobody asked meanwhile: no read ahead
    assert limits.exists(["tag:gpu"])


def test_an_api_that_cannot_be_read_counts_as_a_limit():
    class Broken:
        def read_global_concurrency_limits(self, limit: int, offset: int) -> list[SimpleNamespace]:
            raise ConnectionError("no API")

    assert TagLimits(Broken(), max_age_s=MAX_AGE_S).exists(["tag:gpu"])
