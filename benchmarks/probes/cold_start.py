"""A flow process's first cluster: its imports, the runner's cluster start
(``runner.client``: scheduler, workers, plugins) and its first ``gpu`` task, in one
fresh process on the README's default (run it with a fresh ``PREFECT_HOME``), and how
long before the flow's body the flow run entered the runner (where the runner starts
its workers' fork server). Run it a few times, each a new process:

    for i in 1 2 3; do PREFECT_HOME=$(mktemp -d) python benchmarks/probes/cold_start.py; done
"""

import time

t0 = time.perf_counter()
import os  # noqa: E402
import sys  # noqa: E402

from prefect import flow, task  # noqa: E402
from prefect.context import FlowRunContext  # noqa: E402

from prefect_gpu_dask import GPUDaskTaskRunner  # noqa: E402

t1 = time.perf_counter()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import cluster_start_and_first_task  # noqa: E402

entered: list[float] = []  # when the flow run entered the runner
_enter = GPUDaskTaskRunner.__enter__


def _entered(runner: GPUDaskTaskRunner) -> GPUDaskTaskRunner:
    entered.append(time.perf_counter())
    return _enter(runner)


GPUDaskTaskRunner.__enter__ = _entered


@task(tags=["gpu"])
def one() -> int:
    return 1


@flow(task_runner=GPUDaskTaskRunner())
def first_cluster() -> tuple[float, float, float]:
    body = time.perf_counter()
    started, first_task = cluster_start_and_first_task(FlowRunContext.get().task_runner, one)
    return body - entered[0], started, first_task


if __name__ == "__main__":
    before_body, started, first_task = first_cluster()
    print(
        f"imports {t1 - t0:.3f} s; cluster start (runner.client) {started:.3f} s;"
        f" first gpu task {first_task:.3f} s; the runner entered {before_body:.3f} s before the flow's body"
    )
