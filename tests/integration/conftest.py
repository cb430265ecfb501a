"""Integration tests run against one real Prefect API server per test process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.servers import prefect_server


@pytest.fixture(scope="session", autouse=True)
def prefect_api() -> Iterator[str]:
    """One real Prefect API server (``prefect server start``, SQLite in a temp dir) for
    the whole session; this process reaches it through its settings context only."""
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with prefect_server() as api, temporary_settings({PREFECT_API_URL: api}):
        yield api
        EventsWorker.drain_all()
