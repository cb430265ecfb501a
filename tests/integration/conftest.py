"""Integration tests run against one real Prefect API server per test process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.servers import using_prefect_server


@pytest.fixture(scope="session", autouse=True)
def prefect_api() -> Iterator[str]:
    """One real Prefect API server (``prefect server start``, SQLite in a temp dir) for
    the whole session; this process reaches it through its settings context only."""
    with using_prefect_server() as api:
        yield api
