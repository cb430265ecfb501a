"""A fresh worker process finishes Prefect's lazy set-up before any task run starts.

Run in a new interpreter each time: the set-up is per process, and this test process
has long since done it.
"""

import subprocess
import sys

FRESH_WORKER = """
import prefect.logging.configuration as logging_configuration
from prefect.context import FlowRunContext, TaskRunContext

from prefect_gpu_dask.worker.taskrun import prepare_process

def state():
    return (
        FlowRunContext.__pydantic_complete__,
        TaskRunContext.__pydantic_complete__,
        bool(logging_configuration.PROCESS_LOGGING_CONFIG),
    )

print(state())
prepare_process()
print(state())
"""


def test_a_fresh_worker_process_is_prepared_before_its_first_task_run():
    out = subprocess.run(
        [sys.executable, "-c", FRESH_WORKER], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    # With Prefect 3.8/3.9 importing the package leaves the run-context models
    # incomplete (out[0]); the engine would complete them in every task run's thread at once.
    assert out[1] == "(True, True, True)", out
