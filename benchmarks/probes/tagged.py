"""gpu-tagged trivial tasks on 8 worker processes (CPU): do they stall?"""

import sys
import time

from prefect import flow, task
from prefect.task_runners import ThreadPoolTaskRunner

from prefect_gpu_dask import GPUDaskTaskRunner

N = int(sys.argv[1]) if len(sys.argv) > 1 else 400
WORKERS = int(sys.argv[2]) if len(sys.argv) > 2 else 8
TAGS = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else []


@task
def noop(i):
    return i


def timed(runner, job):
    @flow(task_runner=runner)
    def many():
        assert all(f.result() < 0 for f in job.map(range(-64, 0)))
        s = time.perf_counter()
        [f.result() for f in job.map(range(N))]
        return time.perf_counter() - s

    return many()


if __name__ == "__main__":
    from prefect.testing.utilities import prefect_test_harness

    job = noop.with_options(tags=TAGS)
    cluster = {"n_workers": WORKERS, "threads_per_worker": 8, "resources": {"GPU": 1}}
    with prefect_test_harness(server_startup_timeout=120):
        print("threadpool", TAGS, timed(ThreadPoolTaskRunner(max_workers=16), job), flush=True)
        print(
            "runner",
            TAGS,
            timed(
                GPUDaskTaskRunner(cluster_kwargs=cluster, guard=sys.argv[4] if len(sys.argv) > 4 else "gpu"),
                job,
            ),
            flush=True,
        )
