"""A flow run of many short ``gpu`` tasks on a shared cluster, each body noted in a
ledger, for the shared-cluster tests: ``python -m tests.shared_cluster_flows ADDRESS LEDGER N``."""

from __future__ import annotations

import os
import sys
import time

from prefect import flow, task

from prefect_gpu_dask import GPUDaskTaskRunner
from tests.scripted_probe import FAKE_PROBE


@task(tags=["gpu"])
def noted(ledger: str, i: int) -> int:
    from prefect.runtime import task_run

    time.sleep(0.05)
    with open(ledger, "a") as fh:
        fh.write(f"{task_run.id} {i} {os.getpid()}\n")
    return i


def many(address: str, ledger: str, n: int) -> list[int]:
    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE))
    def many_gpu_tasks() -> list[int]:
        return [f.result() for f in [noted.submit(ledger, i) for i in range(n)]]

    return many_gpu_tasks()


if __name__ == "__main__":
    assert many(sys.argv[1], sys.argv[2], int(sys.argv[3])) == list(range(int(sys.argv[3])))
