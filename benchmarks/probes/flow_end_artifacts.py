"""How long a flow run of many task runs takes to end after its last result, untagged
against ``gpu``-tagged (each guarded ``gpu`` run gets its one-row ``gpu-memory``
artifact, which the flow writes in the background and waits for at its end), on the
README's default (embedded SQLite server, fresh PREFECT_HOME). On CPU one worker
offering ``GPU=1`` with 8 threads stands in for the GPU worker.

    python benchmarks/probes/flow_end_artifacts.py [tasks] [rounds]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import one_gpu_slot_runner, use_readme_default  # noqa: E402

use_readme_default("flow-end-artifacts")

import statistics  # noqa: E402
import time  # noqa: E402

from prefect import flow, task  # noqa: E402

TASKS = int(sys.argv[1]) if len(sys.argv) > 1 else 300
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 2


@task
def noop(i: int) -> int:
    return i


@flow(task_runner=one_gpu_slot_runner())
def batch(tags: list[str]) -> tuple[float, float]:
    job = noop.with_options(tags=tags)
    start = time.perf_counter()
    assert [f.result() for f in job.map(range(TASKS))] == list(range(TASKS))
    return time.perf_counter() - start, time.perf_counter()


if __name__ == "__main__":
    batch([])  # the first flow run of the process starts the server
    ends: dict[str, list[float]] = {"untagged": [], "gpu": []}
    for _ in range(ROUNDS):
        for kind, tags in (("untagged", []), ("gpu", ["gpu"])):
            elapsed, body_end = batch(tags)
            ends[kind].append(time.perf_counter() - body_end)
            print(
                f"{kind:9s} {TASKS} task runs: {elapsed:6.2f} s, last result -> the call returns "
                f"{ends[kind][-1]:6.2f} s",
                flush=True,
            )
    for kind, values in ends.items():
        print(f"{kind}: last result -> the call returns, median {statistics.median(values):.2f} s")
