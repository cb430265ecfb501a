"""The NVML readers' own switches, without a GPU."""

from __future__ import annotations

import pytest

from prefect_gpu_dask import nvml


@pytest.mark.parametrize(
    ("value", "held"),
    [(None, True), ("true", True), ("1", True), ("false", False), (" Off ", False), ("0", False)],
)
def test_the_process_read_holds_the_gil_unless_turned_off(monkeypatch, value, held):
    if value is None:
        monkeypatch.delenv(nvml.HOLD_GIL_ENV, raising=False)
    else:
        monkeypatch.setenv(nvml.HOLD_GIL_ENV, value)
    assert nvml._hold_gil() is held
