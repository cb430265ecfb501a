"""Per-task time of the runner with its worker's GIL switch interval at Python's 5 ms
and at 1 ms, beside Prefect's thread pool, alternating round by round on one cluster.

A worker process runs each task run's Prefect engine on its task threads and Dask's
own messages (the task's arrival, its start notice, its result) on its event loop; the
event loop waits for a busy task thread to hand over the GIL, up to one switch interval.

    python benchmarks/probes/worker_switch_interval.py [tasks] [rounds] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import WARM_TASKS, against_thread_pool, use_readme_default  # noqa: E402

THREADS = 8
INTERVALS_S = {"runner, worker switch interval 5 ms": 0.005, "runner, worker switch interval 1 ms": 0.001}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tasks", type=int, nargs="?", default=200)
    parser.add_argument("rounds", type=int, nargs="?", default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    use_readme_default("switch-interval")

    from prefect import flow, task
    from prefect.context import FlowRunContext
    from prefect.task_runners import ThreadPoolTaskRunner

    from benchmarks.sections.tasks import api_caught_up
    from prefect_gpu_dask import GPUDaskTaskRunner

    @task
    def noop(i: int) -> int:
        return i

    def batch() -> tuple[float, str]:
        start = time.perf_counter()
        assert [f.result() for f in noop.map(range(args.tasks))] == list(range(args.tasks))
        return time.perf_counter() - start, str(FlowRunContext.get().flow_run.id)

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=16))
    def on_pool() -> tuple[float, str]:
        assert all(f.result() < 0 for f in noop.map(range(-WARM_TASKS, 0)))
        return batch()

    runner = GPUDaskTaskRunner(cluster_kwargs={"threads_per_worker": THREADS, "n_workers": 1}, guard="off")

    @flow(task_runner=runner)
    def on_runner() -> dict[str, list[float]]:
        client = FlowRunContext.get().task_runner.client
        assert all(f.result() < 0 for f in noop.map(range(-WARM_TASKS, 0)))
        runs: dict[str, list[float]] = {name: [] for name in INTERVALS_S}
        for _ in range(args.rounds):
            for name, interval in INTERVALS_S.items():
                client.run(sys.setswitchinterval, interval)
                runs[name].append(batch()[0])
        return runs

    pool_runs = []
    for _ in range(args.rounds):
        elapsed, flow_run_id = on_pool()
        api_caught_up(flow_run_id, args.tasks + WARM_TASKS)
        pool_runs.append(elapsed)
    runs = {"thread pool": pool_runs, **on_runner()}
    against_thread_pool(
        runs,
        (
            f"{args.tasks} trivial tasks, {args.rounds} rounds, warm;"
            f" one worker of {THREADS} threads, guard off; the two runner rows alternate in one flow run"
        ),
        args.out,
        args.tasks,
    )


if __name__ == "__main__":
    main()
