"""Per-task time of the runner as the flow fetches its task runs' states: reading
ahead (the default: a fetch takes the finished, small states submitted after it) and
one fetch per result (a read-ahead window of 0), beside Prefect's thread pool. One
worker (one GPU on a GPU host), guard off; rounds alternate.

    python benchmarks/probes/read_ahead.py [tasks] [rounds] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import against_thread_pool, use_readme_default  # noqa: E402
from prefect_gpu_dask.flow.cluster import GPU_WORKER_THREADS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tasks", type=int, nargs="?", default=200)
    parser.add_argument("rounds", type=int, nargs="?", default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    use_readme_default("read-ahead")

    from prefect.task_runners import ThreadPoolTaskRunner

    from benchmarks.sections.tasks import timed_trivial_batch
    from prefect_gpu_dask import GPUDaskTaskRunner
    from prefect_gpu_dask.flow import results

    window = results.READ_AHEAD
    cluster = {"n_workers": 1, "threads_per_worker": GPU_WORKER_THREADS}
    variants = {f"runner, read-ahead {window}": window, "runner, one fetch per result": 0}
    runs: dict[str, list[float]] = {"thread pool": [], **{name: [] for name in variants}}
    for _ in range(args.rounds):
        runs["thread pool"].append(timed_trivial_batch(ThreadPoolTaskRunner(max_workers=16), args.tasks))
        for name, size in variants.items():
            results.READ_AHEAD = size
            runner = GPUDaskTaskRunner(cluster_kwargs=cluster, guard="off")
            try:
                runs[name].append(timed_trivial_batch(runner, args.tasks))
            finally:
                results.READ_AHEAD = window
        print({name: [round(t, 3) for t in times] for name, times in runs.items()}, file=sys.stderr)
    against_thread_pool(runs, f"{args.tasks} trivial tasks, {args.rounds} rounds, warm", args.out, args.tasks)


if __name__ == "__main__":
    main()
