"""How long a flow run of many task runs takes to end after its last result, untagged
against ``gpu``-tagged (each guarded ``gpu`` run's record goes out as a table artifact,
one per task run or several together when they wait, which the flow writes in the
background and waits for at its end), on the README's default (embedded SQLite server,
fresh PREFECT_HOME). On CPU one worker offering ``GPU=1`` with 8 threads stands in for
the GPU worker. It also counts the live tables each ``gpu`` flow run got.

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
from prefect.client.orchestration import get_client  # noqa: E402
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId  # noqa: E402
from prefect.context import FlowRunContext  # noqa: E402

TASKS = int(sys.argv[1]) if len(sys.argv) > 1 else 300
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 2


@task
def noop(i: int) -> int:
    return i


@flow(task_runner=one_gpu_slot_runner())
def batch(tags: list[str]) -> tuple[float, float, str]:
    job = noop.with_options(tags=tags)
    start = time.perf_counter()
    assert [f.result() for f in job.map(range(TASKS))] == list(range(TASKS))
    return time.perf_counter() - start, time.perf_counter(), str(FlowRunContext.get().flow_run.id)


def live_tables(flow_run_id: str) -> str:
    """The flow run's unkeyed table artifacts: one per task run, or several records each."""
    with get_client(sync_client=True) as client:
        of_the_run = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        found = client.read_artifacts(artifact_filter=of_the_run, limit=200)  # the most a page holds
    live = [a for a in found if a.key is None and a.type == "table"]
    alone = sum(a.task_run_id is not None for a in live)
    return f"{len(live)} live tables ({alone} on task runs, {len(live) - alone} on the flow run)"


if __name__ == "__main__":
    batch([])  # the first flow run of the process starts the server
    ends: dict[str, list[float]] = {"untagged": [], "gpu": []}
    for _ in range(ROUNDS):
        for kind, tags in (("untagged", []), ("gpu", ["gpu"])):
            elapsed, body_end, flow_run_id = batch(tags)
            ends[kind].append(time.perf_counter() - body_end)
            print(
                f"{kind:9s} {TASKS} task runs: {elapsed:6.2f} s, last result -> the call returns "
                f"{ends[kind][-1]:6.2f} s" + (f", {live_tables(flow_run_id)}" if tags else ""),
                flush=True,
            )
    for kind, values in ends.items():
        print(f"{kind}: last result -> the call returns, median {statistics.median(values):.2f} s")
