"""The README's default as a new user meets it: no ``PREFECT_API_URL``, a fresh
``PREFECT_HOME``, so Prefect's embedded SQLite server; the runner's own local cluster.

In one run, with the server logging every request it answers 503
(``PREFECT_API_LOG_RETRYABLE_ERRORS``) to this process's stderr, copied to a file:

- ``tagged``: ``--tasks`` trivial ``gpu``-tagged task runs against as many untagged ones,
  alternating, ``--rounds`` rounds, after a warm-up; tagged / untagged of the medians.
  On a GPU host the default runner's cluster; on CPU, 2 workers offering ``--slots``
  ``GPU`` slots between them.
- ``cube``: the speed-cube as one ``gpu`` task (``flows/speed_cube.py``'s ``cube_mean``,
  its device's size), ``--cube-runs`` warm runs through the default runner: median, p95,
  p95 / median; on a GPU, against Dask's threads scheduler on the same GPU in a child process.
- ``join``: ``--join-runs`` flow runs, each a new flow run of three trivial ``gpu`` tasks
  joining a running cluster (``prefect-gpu-dask cluster start``, which the default runner
  joins): from the call to the first task's result, from the last result to the call's
  return, and where that time goes, read from the timestamps of Prefect's and the
  runner's own log lines.
- the 503 answers, ``database is locked`` lines and dropped events ("Subscription queue is
  full") the server logged during all of it.

Prints a table and writes ``benchmarks/results/<date>-<device>-sqlite-default.json``.

    python benchmarks/sqlite_default.py
    python benchmarks/sqlite_default.py --tasks 300 --slots 8 --cube-runs 20   # 2 CPU cores
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import (  # noqa: E402
    WARM_TASKS,
    ServerLog,
    device_name,
    in_child_process,
    p95,
    spread,
    threads_cube_runs,
    use_readme_default,
    versions,
    warm_every_worker,
)

use_readme_default("default")  # before Prefect is imported
os.environ["PREFECT_API_LOG_RETRYABLE_ERRORS"] = "true"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

RETRYABLE = "Encountered retryable exception in request"
LOCKED = "database is locked"
DROPPED = "Subscription queue is full"  # an event (a task-run state among them) the server dropped


class LogTimes(logging.Handler):
    """When given log lines were emitted (wall clock), to split a flow run's time."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.marks: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.marks.append((record.created, record.getMessage()))

    def first(self, after: float, containing: str) -> float | None:
        return next((t for t, m in self.marks if t >= after and containing in m), None)


def gpu_host() -> bool:
    from prefect_gpu_dask import gpu_available

    return gpu_available()


def cpu_runner_kwargs(slots: int) -> dict[str, Any]:
    """Two CPU workers offering ``slots`` GPU slots between them (a GPU host: none)."""
    return {
        "host_cluster": False,
        "cluster_kwargs": {
            "n_workers": 2,
            "threads_per_worker": max(1, slots // 2),
            "resources": {"GPU": slots // 2},
        },
    }


def tagged(tasks: int, rounds: int, runner_kwargs: dict[str, Any]) -> dict[str, Any]:
    from prefect import flow, task

    from prefect_gpu_dask import GPUDaskTaskRunner

    @task
    def noop(i: int) -> int:
        return i

    kinds = {"untagged": noop, "tagged": noop.with_options(tags=["gpu"])}

    @flow(task_runner=GPUDaskTaskRunner(**runner_kwargs))
    def batch(kind: str) -> float:
        job = kinds[kind]
        assert all(f.result() < 0 for f in job.map(range(-WARM_TASKS, 0)))
        start = time.perf_counter()
        assert [f.result() for f in job.map(range(tasks))] == list(range(tasks))
        return time.perf_counter() - start

    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(rounds):
        for kind in kinds:
            times[kind].append(batch(kind))
            print(f"  tagged: {kind:9s} {times[kind][-1]:7.2f} s", flush=True)
    out: dict[str, Any] = {"tasks": tasks, "rounds": rounds}
    for kind, values in times.items():
        out[kind] = {"median_s": statistics.median(values), "p95_s": p95(values), "runs_s": values}
    out["tagged_over_untagged"] = out["tagged"]["median_s"] / out["untagged"]["median_s"]
    return out


def cube(runs: int, gpu: bool, runner_kwargs: dict[str, Any]) -> dict[str, Any]:
    from prefect import flow

    from flows.speed_cube import EXPECTED_MEAN, TOLERANCE, cube_mean, default_size
    from prefect_gpu_dask import GPUDaskTaskRunner

    n, chunk = default_size(gpu)

    @flow(task_runner=GPUDaskTaskRunner(**runner_kwargs))
    def cubes() -> tuple[list[float], list[float]]:
        warm_every_worker(cube_mean, n, chunk)
        around, inside = [], []
        for _ in range(runs):
            start = time.perf_counter()
            result = cube_mean.submit(n, chunk).result()
            around.append(time.perf_counter() - start)
            inside.append(result["seconds"])
            assert abs(result["mean"] - EXPECTED_MEAN) < TOLERANCE, result
        return around, inside

    around, inside = cubes()
    out: dict[str, Any] = {"n": n, "chunk": chunk, "runner": spread(around), "inside_task": spread(inside)}
    if gpu:  # in a process of its own: this one holds no CUDA context beside the workers
        raw = in_child_process(threads_cube_runs, n, chunk, runs)
        out["raw_threads"] = spread(raw)
        out["runner_over_raw_threads"] = out["runner"]["median_s"] / out["raw_threads"]["median_s"]
    return out


def join(runs: int, gpu: bool, slots: int, marks: LogTimes) -> dict[str, Any]:
    from prefect import flow, task

    from prefect_gpu_dask import GPUDaskTaskRunner

    @task(tags=["gpu"])
    def noop(i: int) -> int:
        return i

    @flow(task_runner=GPUDaskTaskRunner())
    def joined() -> dict[str, float]:
        body = time.time()
        futures = [noop.submit(i) for i in range(3)]
        first = futures[0].result()
        first_at = time.time()
        assert [first] + [f.result() for f in futures[1:]] == [0, 1, 2]
        return {"body": body, "first_result": first_at, "last_result": time.time()}

    cli = [sys.executable, "-m", "prefect_gpu_dask", "cluster"]
    extra = (
        []
        if gpu
        else [
            "--workers",
            "2",
            "--threads-per-worker",
            str(max(1, slots // 2)),
            "--resources",
            f"GPU={slots // 2}",
        ]
    )
    subprocess.run([*cli, "start", *extra], check=True)
    phases: dict[str, list[float]] = {
        k: []
        for k in (
            "call_to_first_result_s",
            "last_result_to_return_s",
            "call_to_flow_run_begun_s",
            "begun_to_body_s",
            "body_to_first_result_s",
            "last_result_to_finished_log_s",
            "finished_log_to_return_s",
        )
    }
    try:
        joined()  # the first flow run of this process imports and connects what the others reuse
        for _ in range(runs):
            call = time.time()
            times = joined()
            returned = time.time()
            begun = marks.first(call, "Beginning flow run") or call
            finished = marks.first(times["last_result"], "Finished in state") or returned
            phases["call_to_first_result_s"].append(times["first_result"] - call)
            phases["last_result_to_return_s"].append(returned - times["last_result"])
            phases["call_to_flow_run_begun_s"].append(begun - call)
            phases["begun_to_body_s"].append(times["body"] - begun)
            phases["body_to_first_result_s"].append(times["first_result"] - times["body"])
            phases["last_result_to_finished_log_s"].append(finished - times["last_result"])
            phases["finished_log_to_return_s"].append(returned - finished)
    finally:
        subprocess.run([*cli, "stop", "--force"], check=False)
    return {"runs": runs} | {
        k: {"median_s": statistics.median(v), "p95_s": p95(v)} for k, v in phases.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", type=int, default=8, help="GPU slots of the CPU cluster (2 workers)")
    parser.add_argument("--cube-runs", type=int, default=20)
    parser.add_argument("--join-runs", type=int, default=10)
    parser.add_argument("--sections", default="tagged,cube,join")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from prefect.logging.configuration import ensure_logging_setup

    server_log = ServerLog()
    ensure_logging_setup()  # Prefect's logging configuration first: it replaces loggers' handlers
    marks = LogTimes()
    for name in ("prefect.flow_runs", "prefect.task_runner.gpudask"):
        logging.getLogger(name).addHandler(marks)
    gpu = gpu_host()
    runner_kwargs = {} if gpu else cpu_runner_kwargs(args.slots)
    sections = args.sections.split(",")
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": device_name(),
        "cores": os.cpu_count(),
        "versions": versions(),
        "server": "embedded (no PREFECT_API_URL), SQLite, fresh PREFECT_HOME",
        "cluster": "the default runner's" if gpu else f"2 CPU workers, {args.slots} GPU slots",
    }
    if "tagged" in sections:
        result["tagged"] = tagged(args.tasks, args.rounds, runner_kwargs)
    if "cube" in sections:
        result["cube"] = cube(args.cube_runs, gpu, runner_kwargs)
    if "join" in sections:
        result["join"] = join(args.join_runs, gpu, args.slots, marks)
    counts = server_log.count(RETRYABLE, LOCKED, DROPPED)
    result["server_log"] = {
        "503": counts[RETRYABLE],
        "database_is_locked": counts[LOCKED],
        "events_dropped": counts[DROPPED],
    }

    head = f"{result['date']} {result['device']}, {result['cores']} cores"
    print(f"\n# {head}; {result['server']}; {result['cluster']}")
    if "tagged" in result:
        t = result["tagged"]
        print(
            f"{t['tasks']} trivial tasks x {t['rounds']} rounds: untagged {t['untagged']['median_s']:.2f} s, "
            f"gpu-tagged {t['tagged']['median_s']:.2f} s: tagged / untagged {t['tagged_over_untagged']:.2f}"
        )
    if "cube" in result:
        c = result["cube"]
        r = c["runner"]
        line = (
            f"speed-cube {c['n']}² through the runner, {r['runs']} warm runs: median {r['median_s']:.3f} s, "
            f"p95 {r['p95_s']:.3f} s, p95 / median {r['p95_over_median']:.2f} (inside the task "
            f"{c['inside_task']['p95_over_median']:.2f})"
        )
        if "raw_threads" in c:
            raw = c["raw_threads"]["median_s"]
            line += f"; raw threads {raw:.3f} s: runner / raw {c['runner_over_raw_threads']:.3f}"
        print(line)
    if "join" in result:
        print(f"joining a running cluster, {result['join']['runs']} flow runs (median, p95):")
        for key, value in result["join"].items():
            if isinstance(value, dict):
                print(f"  {key:32s} {value['median_s']:.3f} s  {value['p95_s']:.3f} s")
    logged = result["server_log"]
    print(
        f"server: {logged['503']} answers 503, {logged['database_is_locked']} 'database is locked', "
        f"{logged['events_dropped']} 'Subscription queue is full'"
    )
    slug = result["device"].replace(" ", "-").replace("(", "").replace(")", "").lower()
    out = Path(
        args.out or Path(ROOT) / "benchmarks" / "results" / f"{result['date']}-{slug}-sqlite-default.json"
    )
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
