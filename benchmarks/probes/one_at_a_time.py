"""Sequential submit -> result of a 0.3 s task, as the speed-cube benchmark does, on one
worker labelled GPU=1 (CPU is enough): untagged against ``gpu``-tagged, on the embedded
SQLite server and on ``prefect server start`` backed by Debian's PostgreSQL (where
installed). Prints median, p95 and max of the time around the task's own 0.3 s.

    python benchmarks/probes/one_at_a_time.py [runs]
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from prefect import flow, task
from prefect.testing.utilities import prefect_test_harness

from prefect_gpu_dask import GPUDaskTaskRunner

RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
WORK_S = 0.3


@task
def work() -> float:
    start = time.perf_counter()
    time.sleep(WORK_S)
    return time.perf_counter() - start


def around(job) -> list[float]:
    @flow(
        task_runner=GPUDaskTaskRunner(cluster_kwargs={"n_workers": 1, "resources": {"GPU": 1}}, guard="off")
    )
    def sequential() -> list[float]:
        job.submit().result()  # warm
        out = []
        for _ in range(RUNS):
            start = time.perf_counter()
            inside = job.submit().result()
            out.append(time.perf_counter() - start - inside)
        return out

    return sequential()


def show(name: str, values: list[float]) -> None:
    ordered = sorted(values)
    p95 = ordered[round(0.95 * (len(ordered) - 1))]
    print(
        f"{name:<10} around the task: median {statistics.median(values) * 1e3:7.1f} ms  "
        f"p95 {p95 * 1e3:7.1f} ms  max {max(values) * 1e3:7.1f} ms  (n={len(values)})"
    )


def both(database: str) -> None:
    untagged = around(work)
    tagged = around(work.with_options(tags=["gpu"]))
    show(f"{database} untagged", untagged)
    show(f"{database} gpu", tagged)


if __name__ == "__main__":
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tests.servers import postgres_missing, postgres_server, prefect_server

    with prefect_test_harness(server_startup_timeout=120):
        both("sqlite")
    if (why := postgres_missing()) is not None:
        print(f"postgres: skipped ({why})")
    else:
        with postgres_server() as url, prefect_server(url) as api, temporary_settings({PREFECT_API_URL: api}):
            both("postgres")
