"""A flow run on a shared cluster, each run a process of its own with its own Prefect API
(its own ``PREFECT_HOME``, so its own temporary server, or a ``PREFECT_API_URL``):
``python -m tests.shared_api_flows ADDRESS LEDGER N [LABEL]``.

Maps a ``gpu`` task over ``N`` items; every execution of its body is a line of the
ledger (``task run id, item, label``), so a test can tell a task run lost from one run
twice. Prints ``flow-run-id <id>`` and the flow run's final state.
``EPHEMERAL_PORT``: the temporary server takes that port (Prefect picks one of 1,000 at
random), so flow runs one after another get a server at the same URL.
"""

from __future__ import annotations

import os
import sys
import time

from prefect import flow, task

from prefect_gpu_dask import GPUDaskTaskRunner
from tests.scripted_probe import FAKE_PROBE


@task(tags=["gpu"])
def counted(ledger: str, label: str, i: int) -> int:
    from prefect.runtime import task_run

    time.sleep(0.02)
    with open(ledger, "a") as fh:
        fh.write(f"{task_run.id} {i} {label}\n")
    return i


def run(address: str, ledger: str, n: int, label: str) -> None:
    @flow(task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE))
    def shares_a_cluster() -> list[int]:
        return counted.map(ledger, label, range(n)).result()

    state = shares_a_cluster(return_state=True)
    print(f"flow-run-id {state.state_details.flow_run_id}", flush=True)
    print(f"final-state {state.type.value}", flush=True)
    assert state.is_completed(), state
    assert state.result() == list(range(n))


if __name__ == "__main__":
    if port := os.environ.get("EPHEMERAL_PORT"):
        from prefect.server.api.server import SubprocessASGIServer

        SubprocessASGIServer._port_range = range(int(port), int(port) + 1)
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "-")
