"""Worker preload, ``dask worker --preload tests.slow_replacement``: every worker
process after the first of its nanny holds back its registration for a few seconds, so
a test can act while a recycled worker is away however fast the machine starts one."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

DELAY_S = 3.0


def dask_setup(worker: Any) -> None:
    first_start = Path(tempfile.gettempdir()) / f"slow-replacement-{os.getppid()}"  # per nanny
    if first_start.exists():
        time.sleep(DELAY_S)  # blocks the worker's start, before it registers
    else:
        first_start.touch()
