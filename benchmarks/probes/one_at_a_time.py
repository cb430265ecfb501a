"""Sequential submit -> result of a 0.3 s task, as the speed-cube benchmark does, on one
worker labelled GPU=1 (CPU is enough): untagged against ``gpu``-tagged, on the embedded
SQLite server and on ``prefect server start`` backed by Debian's PostgreSQL (where
installed). Prints median, p95 and max of the time around the task's own 0.3 s, the
runs that took over a second longer than the median, and the requests the server
answered with 503 meanwhile (it logs each: ``PREFECT_API_LOG_RETRYABLE_ERRORS``), by
the table their failed SQL statement wrote to. Prefect's client waits 2 s before
retrying a 503.

    python benchmarks/probes/one_at_a_time.py [runs]
"""

import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from prefect import flow, task
from prefect.testing.utilities import prefect_test_harness

from prefect_gpu_dask import GPUDaskTaskRunner

RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
WORK_S = 0.3
os.environ["PREFECT_API_LOG_RETRYABLE_ERRORS"] = "true"  # the servers below log every 503
RETRYABLE = "Encountered retryable exception in request"


class ServerOutput:
    """This process's stderr, which the servers and workers it starts inherit, copied
    to a file as well, so the 503s logged during each sequence can be counted."""

    def __init__(self) -> None:
        self.file = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self._tee = os.popen(f"tee -a {self.file.name} >&2", "w")  # noqa: S605
        os.dup2(self._tee.fileno(), 2)

    def mark(self) -> int:
        sys.stderr.flush()
        time.sleep(0.5)
        return os.path.getsize(self.file.name)

    def retryable_since(self, offset: int) -> Counter:
        """The 503s logged after ``offset``, by the table of the statement that failed."""
        with open(self.file.name, errors="replace") as log:
            log.seek(offset)
            text = log.read()
        tables: Counter = Counter()
        for block in text.split(RETRYABLE)[1:]:
            statement = re.search(r"\[SQL: (\w+) (?:INTO |FROM )?(\w+)", block)
            tables[" ".join(statement.groups()) if statement else "?"] += 1
        return tables


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


def both(database: str, output: ServerOutput) -> None:
    for name, job in (("untagged", work), ("gpu", work.with_options(tags=["gpu"]))):
        offset = output.mark()
        values = around(job)
        output.mark()
        retryable = output.retryable_since(offset)
        show(f"{database} {name}", values)
        slow = [round(v, 2) for v in values if v > statistics.median(values) + 1.0]
        print(f"{'':<10} runs over 1 s slower: {slow}; 503s answered meanwhile: {dict(retryable) or 0}")


if __name__ == "__main__":
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from benchmarks.servers import postgres_missing, postgres_server, prefect_server

    output = ServerOutput()
    with prefect_test_harness(server_startup_timeout=120):
        both("sqlite", output)
    if (why := postgres_missing()) is not None:
        print(f"postgres: skipped ({why})")
    else:
        with postgres_server() as url, prefect_server(url) as api, temporary_settings({PREFECT_API_URL: api}):
            both("postgres", output)
