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


TASK_MODULE_IMPORTED_LATER = """
import logging.config

from prefect_gpu_dask.worker.taskrun import prepare_process

prepare_process()
set_up = []
configure = logging.config.dictConfig
logging.config.dictConfig = lambda config: (set_up.append(config), configure(config))
from prefect import flow, task  # what a task's module does, unpickled in a task run's thread
print(len(set_up))
"""


def test_a_task_module_importing_prefect_does_not_set_logging_up_again():
    """Prefect's API log worker may be starting by then, and a second set-up flushes its
    handler under the logging lock that worker's thread needs."""
    out = subprocess.run(
        [sys.executable, "-c", TASK_MODULE_IMPORTED_LATER],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    assert out[-1] == "0", out
