"""Where the extra time of ``gpu``-tagged task runs on one GPU slot goes, by process CPU
time: the worker's, the flow process's (which holds a local cluster's scheduler) and the
embedded API server's, per task run, for trivial task runs untagged, ``gpu``-tagged,
and ``gpu``-tagged with the guard off, through the default runner on the README's
default (embedded SQLite server, fresh PREFECT_HOME).

CPU time above wall time means work in parallel; a variant slower by wall time but not
by CPU time waits (for a GIL, an answer, the slot) rather than works.

    python benchmarks/probes/tagged_cpu.py [tasks] [rounds] [variant|variant...]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import WARM_TASKS, one_gpu_slot_runner, use_readme_default  # noqa: E402

use_readme_default("tagged-cpu")

import statistics  # noqa: E402
import time  # noqa: E402

import psutil  # noqa: E402
from prefect import flow, task  # noqa: E402
from prefect.context import FlowRunContext  # noqa: E402

TASKS = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 2


@task
def noop(i: int) -> int:
    return i


def process_cpu_s() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


def api_server() -> psutil.Process | None:
    """The embedded server: this process's child running uvicorn."""
    for child in psutil.Process().children(recursive=True):
        try:
            if "uvicorn" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


def measured(tags: list[str]) -> dict[str, float]:
    client = FlowRunContext.get().task_runner.client
    job = noop.with_options(tags=tags)
    assert all(f.result() < 0 for f in job.map(range(-WARM_TASKS, 0)))
    server = api_server()

    def cpu() -> tuple[float, float, float]:
        workers = sum(client.run(process_cpu_s).values())
        server_s = 0.0
        if server is not None:
            t = server.cpu_times()
            server_s = t.user + t.system
        return workers, process_cpu_s(), server_s

    before = cpu()
    start = time.perf_counter()
    assert [f.result() for f in job.map(range(TASKS))] == list(range(TASKS))
    wall = time.perf_counter() - start
    after = cpu()
    ms = 1e3 / TASKS
    return {
        "wall_ms": wall * ms,
        "worker_cpu_ms": (after[0] - before[0]) * ms,
        "flow_process_cpu_ms": (after[1] - before[1]) * ms,
        "api_server_cpu_ms": (after[2] - before[2]) * ms,
    }


VARIANTS = {"untagged": ([], "gpu"), "gpu": (["gpu"], "gpu"), "gpu, guard off": (["gpu"], "off")}
if len(sys.argv) > 3:
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in sys.argv[3].split("|")}


def variant_flow(tags: list[str], guard: str):
    @flow(task_runner=one_gpu_slot_runner(guard=guard))
    def batch() -> dict[str, float]:
        return measured(tags)

    return batch


if __name__ == "__main__":
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for _ in range(ROUNDS):
        for name, (tags, guard) in VARIANTS.items():
            runs[name].append(variant_flow(tags, guard)())
            print(name, {k: round(v, 2) for k, v in runs[name][-1].items()}, flush=True)
    print(f"\n# {TASKS} trivial task runs, {ROUNDS} rounds, medians per task run (ms)")
    keys = list(next(iter(runs.values()))[0])
    print(f"{'':16s}" + "".join(f"{k:>22s}" for k in keys))
    for name, values in runs.items():
        print(f"{name:16s}" + "".join(f"{statistics.median(v[k] for v in values):22.2f}" for k in keys))
