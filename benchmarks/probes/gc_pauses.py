"""Whether Python's garbage collections line up with the speed-cube's slow runs: the
cube through the default runner on the README's default (as ``sqlite_default.py``'s
cube section runs it), with every collection in the flow process and in the workers
timed (``gc.callbacks``) and set against each run's window.

    python benchmarks/probes/gc_pauses.py [runs] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import device_name, p95, use_readme_default  # noqa: E402


class Collections:
    """Every collection in this process: (wall-clock start, seconds, generation)."""

    def __init__(self) -> None:
        self.done: list[tuple[float, float, int]] = []
        self._started: dict[int, float] = {}
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._started[ident] = time.time()
        elif ident in self._started:
            start = self._started.pop(ident)
            self.done.append((start, time.time() - start, info["generation"]))


def watch_worker(dask_worker: Any) -> None:
    dask_worker._gc_pauses_probe = Collections()


def collect_and_freeze(dask_worker: Any = None) -> None:
    gc.collect()
    gc.freeze()


def worker_collections(dask_worker: Any) -> list[tuple[float, float, int]]:
    return dask_worker._gc_pauses_probe.done


def within(pauses: list[tuple[float, float, int]], start: float, end: float) -> tuple[float, float]:
    """Seconds of collections in [start, end]: all generations, and the full ones."""
    inside = [(s, d, g) for s, d, g in pauses if s < end and s + d > start]
    return sum(d for _, d, _ in inside), sum(d for _, d, g in inside if g == 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("runs", type=int, nargs="?", default=30)
    parser.add_argument(
        "--freeze",
        action="store_true",
        help="after the warm run, collect and freeze (gc.freeze) the flow process's and the workers' heaps",
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    use_readme_default("gc-pauses")

    from prefect import flow
    from prefect.context import FlowRunContext

    from flows.speed_cube import EXPECTED_MEAN, TOLERANCE, cube_mean, default_size
    from prefect_gpu_dask import GPUDaskTaskRunner, gpu_available

    gpu = gpu_available()
    n, chunk = default_size(gpu)
    here = Collections()

    @flow(task_runner=GPUDaskTaskRunner())
    def cubes() -> tuple[list[dict[str, float]], dict[str, list[tuple[float, float, int]]]]:
        client = FlowRunContext.get().task_runner.client
        client.run(watch_worker)
        cube_mean.submit(n, chunk).result()  # warm
        if args.freeze:
            client.run(collect_and_freeze)
            collect_and_freeze()
        runs = []
        for _ in range(args.runs):
            start, wall = time.perf_counter(), time.time()
            result = cube_mean.submit(n, chunk).result()
            runs.append(
                {"start": wall, "around_s": time.perf_counter() - start, "inside_s": result["seconds"]}
            )
            assert abs(result["mean"] - EXPECTED_MEAN) < TOLERANCE, result
        return runs, client.run(worker_collections)

    runs, workers = cubes()
    worker_pauses = [p for pauses in workers.values() for p in pauses]
    around = [r["around_s"] for r in runs]
    median = statistics.median(around)
    frozen = ", heaps frozen after the warm run" if args.freeze else ""
    print(f"# {device_name()}, {os.cpu_count()} cores; speed-cube {n}² ({chunk}² chunks){frozen}")
    tail = p95(around)
    print(f"{len(runs)} warm runs: median {median:.3f} s, p95 {tail:.3f} s, p95 / median {tail / median:.2f}")
    print("| run | around s | inside s | outside s | flow process GC ms (full) | workers GC ms (full) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(runs, 1):
        end = r["start"] + r["around_s"]
        r["flow_gc_s"], r["flow_full_gc_s"] = within(here.done, r["start"], end)
        r["worker_gc_s"], r["worker_full_gc_s"] = within(worker_pauses, r["start"], end)
        slow = " **slow**" if r["around_s"] > 1.25 * median else ""
        print(
            f"| {i}{slow} | {r['around_s']:.3f} | {r['inside_s']:.3f} | {r['around_s'] - r['inside_s']:.3f} |"
            f" {1e3 * r['flow_gc_s']:.1f} ({1e3 * r['flow_full_gc_s']:.1f}) |"
            f" {1e3 * r['worker_gc_s']:.1f} ({1e3 * r['worker_full_gc_s']:.1f}) |"
        )
    full = [d for _, d, g in here.done if g == 2]
    worker_full = [d for _, d, g in worker_pauses if g == 2]
    print(
        f"full collections: flow process {len(full)}, longest {1e3 * max(full, default=0):.1f} ms;"
        f" workers {len(worker_full)}, longest {1e3 * max(worker_full, default=0):.1f} ms"
    )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(
                {"device": device_name(), "n": n, "chunk": chunk, "freeze": args.freeze, "runs": runs},
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
