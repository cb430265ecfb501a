"""Where a trivial ``gpu`` task run's time goes when the tasks queue on one GPU slot,
against the same tasks untagged, through the default runner on the README's default
(embedded SQLite server, fresh PREFECT_HOME).

From Dask's task stream: each task's compute time on the worker and the gap between
one task's end and the next one's start on the same slot; from the workers' own
statistical profiler (``Client.profile``), the functions the task threads spent their
samples in, cumulative and self. On CPU a worker offering ``GPU=1`` with 8 threads
stands in for the GPU worker; its guard reads the scripted memory probe.

    python benchmarks/probes/tagged_path.py [tasks] [top]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import one_gpu_slot_runner, p95, use_readme_default  # noqa: E402

use_readme_default("tagged-path")

import collections  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from prefect import flow, task  # noqa: E402
from prefect.context import FlowRunContext  # noqa: E402

TASKS = int(sys.argv[1]) if len(sys.argv) > 1 else 500
TOP = int(sys.argv[2]) if len(sys.argv) > 2 else 25


@task
def noop(i: int) -> int:
    return i


def profile_lines(tree: dict[str, Any], top: int) -> list[str]:
    """The ``top`` functions by cumulative samples, with their self samples."""
    cumulative: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()

    def walk(node: dict[str, Any], seen: frozenset[str]) -> None:
        d = node.get("description") or {}
        name = f"{os.path.basename(d.get('filename', '?'))}:{d.get('name', '?')}"
        if name not in seen:  # recursion counts once
            cumulative[name] += node["count"]
        own[name] += node["count"] - sum(c["count"] for c in node["children"].values())
        for child in node["children"].values():
            walk(child, seen | {name})

    for child in tree.get("children", {}).values():
        walk(child, frozenset())
    total = tree.get("count", 0) or 1
    return [
        f"  {cumulative[n] / total:6.1%} cum {own[n] / total:6.1%} self  {n}"
        for n, _ in cumulative.most_common(top)
    ]


@flow(task_runner=one_gpu_slot_runner())
def batches() -> dict[str, Any]:
    client = FlowRunContext.get().task_runner.client
    out: dict[str, Any] = {}
    for kind, job in (("untagged", noop), ("tagged", noop.with_options(tags=["gpu"]))):
        assert all(f.result() < 0 for f in job.map(range(-64, 0)))
        client.get_task_stream(start=time.time())  # clears nothing: just the window's start
        start_wall = time.time()
        start = time.perf_counter()
        assert [f.result() for f in job.map(range(TASKS))] == list(range(TASKS))
        elapsed = time.perf_counter() - start
        stop_wall = time.time()
        stream = client.get_task_stream(start=start_wall, stop=stop_wall + 1)
        computes = sorted(
            (ss["start"], ss["stop"], s.get("thread"))
            for s in stream
            for ss in s["startstops"]
            if ss["action"] == "compute"
        )
        durations = [b - a for a, b, _ in computes]
        gaps = [max(0.0, computes[i + 1][0] - computes[i][1]) for i in range(len(computes) - 1)]
        out[kind] = {
            "elapsed_s": elapsed,
            "tasks_seen": len(computes),
            "compute_median_ms": 1e3 * statistics.median(durations),
            "compute_p95_ms": 1e3 * p95(durations),
            "gap_median_ms": 1e3 * statistics.median(gaps),
            "gap_p95_ms": 1e3 * p95(gaps),
            "threads": len({t for *_, t in computes}),
            "profile": profile_lines(client.profile(start=start_wall, stop=stop_wall), TOP),
            "loop_profile": profile_lines(client.profile(start=start_wall, stop=stop_wall, server=True), TOP),
        }
    return out


if __name__ == "__main__":
    result = batches()
    for kind, r in result.items():
        print(
            f"{kind}: {TASKS} tasks {r['elapsed_s']:.2f} s ({1e3 * r['elapsed_s'] / TASKS:.1f} ms each); "
            f"{r['tasks_seen']} in the stream on {r['threads']} threads; compute median "
            f"{r['compute_median_ms']:.1f} ms p95 {r['compute_p95_ms']:.1f}; gap between starts on the "
            f"timeline median {r['gap_median_ms']:.2f} ms p95 {r['gap_p95_ms']:.2f}"
        )
        print("  task threads, by the workers' profiler:")
        print("\n".join(r["profile"]))
        print("  the workers' event loops:")
        print("\n".join(r["loop_profile"]))
