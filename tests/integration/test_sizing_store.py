"""The right-sizing history in its Prefect Variable, against the real API server."""

from __future__ import annotations

import uuid

from prefect.client.orchestration import get_client

from prefect_gpu_dask.flow import sizing
from prefect_gpu_dask.flow.sizing import HISTORY_RUNS, PeakHistory


def _updated(name: str) -> object:
    with get_client(sync_client=True) as client:
        variable = client.read_variable_by_name(name)
    assert variable is not None
    return variable.updated


def test_a_run_that_changes_nothing_in_the_history_writes_nothing() -> None:
    flow_name = f"sizing-{uuid.uuid4().hex[:8]}"
    name = sizing.variable_name(flow_name)
    same = {"noop": PeakHistory(1000, (0,))}
    for _ in range(HISTORY_RUNS):  # fills the history with one peak
        sizing.remember(flow_name, same)
    full = _updated(name)
    history = sizing.remember(flow_name, same)  # the oldest 0 out, a new 0 in: the same value
    assert history["noop"].peaks == (0,) * HISTORY_RUNS
    assert _updated(name) == full
    sizing.remember(flow_name, {"noop": PeakHistory(1000, (5,))})  # a new peak is written
    assert _updated(name) != full
    assert sizing.remember(flow_name, {})["noop"].peaks[-1] == 5
