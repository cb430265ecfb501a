"""What the guard costs the thread of a task run, all of it: ``guarding()`` around an
empty body, inside a real ``gpu`` task run on a worker (begin, end, the verdict, the
record, its task-run log line and its event to the flow), where ``benchmarks/run.py``'s
guard section times ``begin()`` + ``end()`` alone.

Per call, the thread's CPU time and wall time (medians of ``--rounds`` rounds of
``--calls`` calls); with ``--profile``, the functions the calls spent it in
(``cProfile``, which slows them down). On CPU the worker's guard reads the scripted
probe, as in the tests.

    python benchmarks/probes/guard_in_task.py [--calls 1000] [--rounds 5] [--profile]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import one_gpu_slot_runner, use_readme_default  # noqa: E402

use_readme_default("guard-in-task")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from prefect import flow, task  # noqa: E402


@task(tags=["gpu"])
def guarded_calls(calls: int, rounds: int, profile: bool) -> dict[str, object]:
    import cProfile
    import io
    import pstats

    from prefect.logging.handlers import APILogWorker

    from prefect_gpu_dask.worker.guard import current_guard, guarding

    if current_guard() is None:
        return {"note": "no guard on this worker"}
    for _ in range(50):  # the first calls make the CUDA context and the threads
        with guarding():
            pass
    cpu, wall = [], []
    for _ in range(rounds):
        APILogWorker.drain_all()  # the log lines of the round before are sent
        cpu_start, wall_start = time.thread_time(), time.perf_counter()
        for _ in range(calls):
            with guarding():
                pass
        cpu.append((time.thread_time() - cpu_start) / calls * 1e6)
        wall.append((time.perf_counter() - wall_start) / calls * 1e6)
    out: dict[str, object] = {"cpu_us": cpu, "wall_us": wall}
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            with guarding():
                pass
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
        out["profile"] = text.getvalue()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    @flow(task_runner=one_gpu_slot_runner())
    def measure() -> dict[str, object]:
        return guarded_calls.submit(args.calls, args.rounds, args.profile).result()

    result = measure()
    if "note" in result:
        print(result["note"])
        return
    for name in ("cpu_us", "wall_us"):
        values = result[name]
        print(
            f"guarding() per call, {name[:-3]} time: median {statistics.median(values):.1f} µs "
            f"({', '.join(f'{v:.1f}' for v in values)})"
        )
    if "profile" in result:
        print(result["profile"])


if __name__ == "__main__":
    main()
