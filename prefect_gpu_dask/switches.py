"""The package's environment switches (``PREFECT_GPU_DASK_…=false``): read in every
process, the API server's included, so this module imports nothing."""

from __future__ import annotations

import os

OFF = ("0", "false", "no", "off")


def switched_on(variable: str) -> bool:
    """Whether the switch ``variable`` is on: it is unless set to 0, false, no or off."""
    return os.environ.get(variable, "true").strip().lower() not in OFF
