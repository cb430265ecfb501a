"""Per-task time of the runner with the Dask scheduler in the flow's process (the local
cluster it starts) and in a process of its own (a ``dask scheduler`` it joins), beside
Prefect's thread pool. Same worker shape in both: one worker, 8 threads. Guard off.

    python benchmarks/probes/runner_scheduler_process.py [tasks] [rounds] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import against_thread_pool, use_readme_default  # noqa: E402

THREADS = 8
IN_FLOW = "runner, scheduler in the flow's process"
OWN = "runner, scheduler in its own process"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tasks", type=int, nargs="?", default=200)
    parser.add_argument("rounds", type=int, nargs="?", default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    use_readme_default("scheduler-process")

    from prefect.task_runners import ThreadPoolTaskRunner

    from benchmarks.probes.start_notice_rtt import own_process_scheduler
    from benchmarks.sections.tasks import timed_trivial_batch
    from prefect_gpu_dask import GPUDaskTaskRunner

    def timed(runner: Any) -> float:
        return timed_trivial_batch(runner, args.tasks)

    runs: dict[str, list[float]] = {"thread pool": [], IN_FLOW: [], OWN: []}
    with own_process_scheduler() as address:
        for _ in range(args.rounds):
            runs["thread pool"].append(timed(ThreadPoolTaskRunner(max_workers=16)))
            runs[IN_FLOW].append(
                timed(
                    GPUDaskTaskRunner(
                        cluster_kwargs={"threads_per_worker": THREADS, "n_workers": 1}, guard="off"
                    )
                )
            )
            runs[OWN].append(timed(GPUDaskTaskRunner(address=address, guard="off")))
    against_thread_pool(runs, f"{args.tasks} trivial tasks, {args.rounds} rounds, warm", args.out, args.tasks)


if __name__ == "__main__":
    main()
