"""Integration tests run against one real Prefect API server per test process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def prefect_api() -> Iterator[str]:
    """One real Prefect API server (SQLite in a temp dir) for the whole session."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()
