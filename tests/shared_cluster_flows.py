"""Flow runs on a shared cluster for the shared-cluster tests, each task body noted in a
ledger:

- ``python -m tests.shared_cluster_flows ADDRESS LEDGER N``: many short ``gpu`` tasks;
- ``python -m tests.shared_cluster_flows ADDRESS LEDGER --across-a-hang STARTED``: one
  ``gpu`` task whose result it holds, then, 3 s after another flow run's task has hung
  (the file ``STARTED`` says when), one more; prints when it ended.
"""

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


def across_a_hang(address: str, ledger: str, started: str) -> list[int]:
    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE))
    def holds_a_result_across_a_hang() -> list[int]:
        first = noted.submit(ledger, 0)
        # Done, not read (a state read into the flow lets Dask forget it): its worker holds it.
        first.wrapped_future.result(timeout=60)
        while not os.path.exists(started) or not open(started).read():
            time.sleep(0.05)
        time.sleep(3)  # past the hung task's deadline: its worker is being recycled
        later = noted.submit(ledger, 1)
        after = later.result()  # first: reading the first result would let its worker restart at once
        return [first.result(), after]

    return holds_a_result_across_a_hang()


if __name__ == "__main__":
    if sys.argv[3] == "--across-a-hang":
        assert across_a_hang(sys.argv[1], sys.argv[2], sys.argv[4]) == [0, 1]
        print(f"ended at {time.time()}", flush=True)
    else:
        assert many(sys.argv[1], sys.argv[2], int(sys.argv[3])) == list(range(int(sys.argv[3])))
