"""Which threads burn CPU (and so hold the GIL) while the speed-cube runs: each thread's
CPU time (``/proc/self/task/*/stat``, Linux) over ``--runs`` warm speed-cubes, per
cube, in the runner's GPU worker and in the flow process (which hosts the local
cluster's scheduler); and the same over Dask's threads scheduler in a plain process.
Threads of one pool are summed under the pool's name.

``--stacks``: then, over as many cubes again, what the worker's threads other than the
graph's pool were doing when not waiting, sampled every millisecond (the sampling
itself takes the GIL: these runs are for where, not how long).

    python benchmarks/probes/thread_cpu.py --runs 20 [--stacks]
"""

import argparse
import os
import re
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import in_child_process, use_readme_default  # noqa: E402

use_readme_default("thread-cpu")

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[str, float]:
    """This process's threads' CPU seconds so far, by thread (pool) name."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        seconds = (int(fields[11]) + int(fields[12])) * TICK_S
        name = names.get(int(tid), f"[{comm}]")
        name = re.sub(r"[-_]\d+(_\d+)?$", "-*", name)  # a pool's threads under one name
        out[name] = out.get(name, 0.0) + seconds
    return out


IDLE = {  # innermost frames of a thread that waits: not working
    ("selectors.py", "select"),
    ("threading.py", "wait"),
    ("threading.py", "_wait_for_tstate_lock"),
    ("queue.py", "get"),
    ("thread.py", "_worker"),
    ("connection.py", "_recv"),
    ("connection.py", "_poll"),
}
SAMPLED_OUT = ("gpu-graph", "stack-sampler")


def _where(frame, depth: int = 4) -> str | None:
    """``file:function`` of the innermost frames, None where the thread waits."""
    code = frame.f_code
    if (os.path.basename(code.co_filename), code.co_name) in IDLE:
        return None
    parts = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        parts.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
        frame = frame.f_back
    return " < ".join(parts)


def start_stacks(interval_s: float = 0.001) -> None:
    """In a worker: sample its threads' stacks until ``stop_stacks``."""
    from collections import Counter

    counts: Counter = Counter()
    stop = threading.Event()

    def sample() -> None:
        me = threading.get_ident()
        while not stop.wait(interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                name = re.sub(r"[-_]\d+(_\d+)?$", "-*", names.get(ident, "?"))
                if ident == me or name.startswith(SAMPLED_OUT):
                    continue
                counts[(name, _where(frame))] += 1
            counts[("samples", None)] += 1

    thread = threading.Thread(target=sample, name="stack-sampler", daemon=True)
    thread.start()
    threading._probe_stacks = (counts, stop, thread)  # this function travels by value: no globals of its own


def stop_stacks() -> dict:
    counts, stop, thread = threading._probe_stacks
    stop.set()
    thread.join()
    return dict(counts)


def per_run(before: dict[str, float], after: dict[str, float], runs: int) -> dict[str, float]:
    return {n: 1000 * (after[n] - before.get(n, 0.0)) / runs for n in after}


def raw_threads(runs: int) -> tuple[float, dict[str, float]]:
    import dask

    from benchmarks.common import check_cube, speed_cube_expr
    from flows.speed_cube import default_size
    from prefect_gpu_dask import gpu_available

    gpu = gpu_available()
    n, chunk = default_size(gpu)
    check_cube(dask.compute(speed_cube_expr(n, chunk, gpu), scheduler="threads")[0])
    before, start = thread_cpu(), time.perf_counter()
    for _ in range(runs):
        check_cube(dask.compute(speed_cube_expr(n, chunk, gpu), scheduler="threads")[0])
    wall = (time.perf_counter() - start) / runs
    return wall, per_run(before, thread_cpu(), runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--stacks", action="store_true")
    args = parser.parse_args()

    from prefect import flow
    from prefect.context import FlowRunContext

    from benchmarks.common import warm_every_worker
    from flows.speed_cube import cube_mean
    from prefect_gpu_dask import GPUDaskTaskRunner

    @flow(task_runner=GPUDaskTaskRunner())
    def cubes(runs: int, stacks: bool):
        client = FlowRunContext.get().task_runner.client
        warm_every_worker(cube_mean)
        cube_mean.submit().result()
        workers, flow_before = client.run(thread_cpu), thread_cpu()
        start = time.perf_counter()
        for _ in range(runs):
            cube_mean.submit().result()
        wall = (time.perf_counter() - start) / runs
        flow_after, workers_after = thread_cpu(), client.run(thread_cpu)
        sampled = {}
        if stacks:
            client.run(start_stacks)
            for _ in range(runs):
                cube_mean.submit().result()
            sampled = client.run(stop_stacks)
        return (
            wall,
            per_run(flow_before, flow_after, runs),
            {w: per_run(workers[w], workers_after[w], runs) for w in workers},
            sampled,
        )

    wall, flow_side, workers, sampled = cubes(args.runs, args.stacks)
    raw_wall, raw = in_child_process(raw_threads, args.runs)

    def show(title: str, wall_s: float, table: dict[str, float]) -> None:
        total = sum(table.values())
        print(f"## {title}: {1000 * wall_s:.1f} ms a cube; CPU ms a cube by thread, total {total:.1f}")
        for name, ms in sorted(table.items(), key=lambda item: -item[1]):
            if ms >= 0.05:
                print(f"  {name:44s} {ms:8.2f}")

    print(f"# {args.runs} warm speed-cubes, one after another")
    for address, table in workers.items():
        show(f"worker {address}", wall, table)
    show("flow process (scheduler included)", wall, flow_side)
    show("raw Dask threads, plain process", raw_wall, raw)
    for address, counts in sampled.items():
        samples = counts.pop(("samples", None))
        print(f"## {address}: of {samples} samples over {args.runs} cubes, working (share of samples)")
        by_thread: dict[str, int] = {}
        for (name, where), count in counts.items():
            if where is not None:
                by_thread[name] = by_thread.get(name, 0) + count
        for name, total in sorted(by_thread.items(), key=lambda item: -item[1]):
            print(f"  {name:40s} {100 * total / samples:6.2f} %")
            rows = [(w, c) for (n, w), c in counts.items() if n == name and w is not None]
            for where, count in sorted(rows, key=lambda item: -item[1])[:8]:
                print(f"      {100 * count / samples:6.2f} %  {where}")


if __name__ == "__main__":
    main()
