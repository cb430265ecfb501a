"""A flow run's first task run on each worker: trivial tasks, one at a time, on a local
cluster of two worker processes, each task's submit-to-result time and the worker that
ran it. The first on the first worker includes the cluster's start; the first on the
second worker is what a worker's first task run of a flow run costs. ``--profile``
also prints Dask's statistical profile of the second worker's first task run (2 ms
samples, which slow it down). Run it in a fresh process; for an A/B, put another tree's
package first with PYTHONPATH.

    PREFECT_HOME=$(mktemp -d) python benchmarks/probes/first_task_per_worker.py [--profile]
"""

import argparse
import time

import dask
import distributed
from prefect import flow, task
from prefect.context import FlowRunContext

from prefect_gpu_dask import GPUDaskTaskRunner

TASKS = 10


@task
def where() -> str:
    return str(distributed.get_worker().name)


def profile_lines(node: dict, total: int, depth: int = 0, share_at_least: float = 0.04) -> list[str]:
    lines = []
    for child in node.get("children", {}).values():
        share = child["count"] / total
        if share >= share_at_least:
            frame = child["description"]
            place = frame["filename"].split("site-packages/")[-1].split("/prefect_gpu_dask/")[-1]
            lines.append(f"{'  ' * depth}{share:5.0%} {place}:{frame['line_number']} {frame['name']}")
            lines += profile_lines(child, total, depth + 1, share_at_least)
    return lines


@flow(task_runner=GPUDaskTaskRunner(cluster_kwargs={"n_workers": 2, "threads_per_worker": 4}))
def first_tasks(profile: bool) -> tuple[list[tuple[str, float]], list[str]]:
    client = FlowRunContext.get().task_runner.client
    runs, window = [], None
    seen: set[str] = set()
    for _ in range(TASKS):
        start, wall = time.perf_counter(), time.time()
        name = where.submit().result()
        runs.append((name, time.perf_counter() - start))
        if name not in seen and len(seen) == 1:
            window = (wall, time.time(), name)
        seen.add(name)
    lines: list[str] = []
    if profile and window is not None:
        time.sleep(1.0)  # the profile's last cycle reaches the scheduler
        [address] = [a for a, w in client.scheduler_info()["workers"].items() if str(w["name"]) == window[2]]
        tree = client.profile(start=window[0], stop=window[1], workers=[address])
        lines = profile_lines(tree, max(tree["count"], 1))
    return runs, lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    settings = {"distributed.worker.profile.interval": "2ms", "distributed.worker.profile.cycle": "50ms"}
    with dask.config.set(settings if args.profile else {}):
        runs, lines = first_tasks(args.profile)
    print("worker, seconds from submit to result:", ", ".join(f"{n} {s:.3f}" for n, s in runs))
    print("\n".join(lines))
