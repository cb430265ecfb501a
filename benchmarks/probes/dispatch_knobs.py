"""Per-task time of the runner as the scheduler hands tasks out: Dask's queuing
(``worker-saturation``) and the worker's thread count, beside Prefect's thread pool.
One worker (one GPU on a GPU host), guard off; each variant starts its own cluster.

The scheduler holds back root tasks beyond ``worker-saturation`` x threads and sends
the next one when a task ends: a round trip through both batched streams, during which
a worker thread may have nothing to start.

    python benchmarks/probes/dispatch_knobs.py [tasks] [rounds] [--only TEXT ...] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import against_thread_pool, use_readme_default  # noqa: E402

SATURATION = "distributed.scheduler.worker-saturation"
VARIANTS = {  # name: (threads per worker, worker-saturation)
    "runner, 8 threads, saturation 1.1 (Dask's default)": (8, 1.1),
    "runner, 8 threads, saturation 2.0": (8, 2.0),
    "runner, 8 threads, no queuing (inf)": (8, float("inf")),
    "runner, 16 threads, saturation 1.1": (16, 1.1),
    "runner, 4 threads, saturation 1.1": (4, 1.1),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tasks", type=int, nargs="?", default=200)
    parser.add_argument("rounds", type=int, nargs="?", default=3)
    parser.add_argument("--only", nargs="*", default=(), help="variants whose name holds one of these")
    parser.add_argument("--out")
    args = parser.parse_args()
    variants = {n: v for n, v in VARIANTS.items() if not args.only or any(o in n for o in args.only)}
    use_readme_default("dispatch-knobs")

    import dask
    from prefect.task_runners import ThreadPoolTaskRunner

    from benchmarks.sections.tasks import timed_trivial_batch
    from prefect_gpu_dask import GPUDaskTaskRunner

    def timed(runner: Any) -> float:
        return timed_trivial_batch(runner, args.tasks)

    runs: dict[str, list[float]] = {"thread pool": [], **{name: [] for name in variants}}
    for _ in range(args.rounds):
        runs["thread pool"].append(timed(ThreadPoolTaskRunner(max_workers=16)))
        for name, (threads, saturation) in variants.items():
            with dask.config.set({SATURATION: saturation}):
                cluster = {"n_workers": 1, "threads_per_worker": threads}
                runs[name].append(timed(GPUDaskTaskRunner(cluster_kwargs=cluster, guard="off")))
    against_thread_pool(runs, f"{args.tasks} trivial tasks, {args.rounds} rounds, warm", args.out, args.tasks)


if __name__ == "__main__":
    main()
