"""Flow runs that each start their own cluster on one (scripted) GPU, for the
shared-host tests: run as ``python -m tests.shared_host_flows LEDGER HOLD_S``."""

from __future__ import annotations

import os
import sys
import time

from prefect import flow, task

from prefect_gpu_dask import GPUDaskTaskRunner
from tests.scripted_probe import FAKE_PROBE


@task(tags=["gpu"])
def hold_the_gpu(ledger: str, hold_s: float) -> float:
    """Stands for a task that needs most of its GPU's memory: the ledger shows when it had it."""
    started = time.time()
    time.sleep(hold_s)
    with open(ledger, "a") as fh:
        fh.write(f"{os.getpid()} {started} {time.time()}\n")
    return hold_s


@flow(
    task_runner=GPUDaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={"n_workers": 1, "threads_per_worker": 1, "resources": {"GPU": 1}},
        memory_probe=FAKE_PROBE,
    )
)
def nightly_on_one_gpu(ledger: str, hold_s: float) -> float:
    return hold_the_gpu.submit(ledger, hold_s).result()


if __name__ == "__main__":
    nightly_on_one_gpu(sys.argv[1], float(sys.argv[2]))
