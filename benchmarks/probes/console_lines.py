"""What a worker's console lines cost a task run: Prefect's rich console handler against
the plain ``logging.StreamHandler`` a worker process uses where its output is not a
terminal (``prefect_gpu_dask/worker/console.py``).

1. Per line: one task-run line, formatted as Prefect formats it, written to a file by
   each handler (median and p95 of ``--rounds`` rounds of ``--lines`` lines).
2. Per task run: ``--tasks`` trivial ``gpu``-tagged and as many untagged task runs through
   the default runner on the README's default (embedded SQLite server), the workers'
   console written plainly (as the package does) and through Prefect's handler put back,
   alternating, ``--task-rounds`` rounds each. On CPU one worker offering ``GPU=1`` with 8
   threads stands in for the GPU worker, as in ``tagged_path.py``. The workers' console
   is this process's stderr: redirect it to a file, as a service's would be.

Prints a table; writes ``benchmarks/results/<date>-<device>-console-lines.json``.

    python benchmarks/probes/console_lines.py 2> /tmp/console.log
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import device_name, one_gpu_slot_runner, p95, use_readme_default, versions  # noqa: E402

use_readme_default("console-lines")

import datetime  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from prefect import flow, task  # noqa: E402
from prefect.context import FlowRunContext  # noqa: E402
from prefect.logging.formatters import PrefectFormatter  # noqa: E402
from prefect.logging.handlers import PrefectConsoleHandler  # noqa: E402

from prefect_gpu_dask.worker.console import (  # noqa: E402
    PlainConsoleHandler,
    all_loggers,
    write_plainly_where_unseen,
)

TASK_RUN_FORMAT = "%(asctime)s.%(msecs)03d | %(levelname)-7s | Task run %(task_run_name)r - %(message)s"
LINE = "GPU memory on GPU-0 (#0): before 1.2 GiB, after 1.2 GiB, peak 1.3 GiB, delta 0 B -> clean"


def per_line_us(handler: logging.Handler, lines: int) -> float:
    handler.setFormatter(PrefectFormatter(format=TASK_RUN_FORMAT, datefmt="%H:%M:%S"))
    record = logging.LogRecord("prefect.task_runs", logging.INFO, __file__, 1, LINE, None, None)
    record.task_run_name = "noop-1a2"
    started = time.perf_counter()
    for _ in range(lines):
        handler.handle(record)
    return 1e6 * (time.perf_counter() - started) / lines


def lines_section(lines: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with open(os.devnull, "w") as sink:
        handlers = {
            "prefect console handler": PrefectConsoleHandler(stream=sink),
            "plain": logging.StreamHandler(sink),
        }
        for handler in handlers.values():
            per_line_us(handler, 200)  # warm-up
        runs: dict[str, list[float]] = {name: [] for name in handlers}
        for _ in range(rounds):
            for name, handler in handlers.items():
                runs[name].append(per_line_us(handler, lines))
    for name, values in runs.items():
        out[name] = {"median_us": statistics.median(values), "p95_us": p95(values), "rounds_us": values}
    return out


def console_back_to_prefects() -> int:
    """For ``Client.run``: the worker's plain console handlers back to Prefect's."""
    swapped = 0
    for logger in all_loggers():
        for handler in list(logger.handlers):
            if isinstance(handler, PlainConsoleHandler):
                rich = PrefectConsoleHandler(stream=handler.stream, level=handler.level)
                rich.setFormatter(handler.formatter)
                logger.removeHandler(handler)
                logger.addHandler(rich)
                swapped += 1
    return swapped


@task
def noop(i: int) -> int:
    return i


@flow(task_runner=one_gpu_slot_runner())
def task_runs(tasks: int, rounds: int) -> dict[str, Any]:
    client = FlowRunContext.get().task_runner.client
    jobs = {"untagged": noop, "gpu": noop.with_options(tags=["gpu"])}
    for job in jobs.values():  # warm-up: every worker thread has run the engine
        assert all(f.result() < 0 for f in job.map(range(-64, 0)))
    runs: dict[str, list[float]] = {}
    swaps: dict[str, list[int]] = {"plain": [], "prefect console handler": []}
    for _ in range(rounds):
        for console, swap in (
            ("plain", write_plainly_where_unseen),
            ("prefect console handler", console_back_to_prefects),
        ):
            swaps[console].append(sum(client.run(swap).values()))
            for kind, job in jobs.items():
                started = time.perf_counter()
                assert [f.result() for f in job.map(range(tasks))] == list(range(tasks))
                runs.setdefault(f"{kind}, {console}", []).append(time.perf_counter() - started)
    return {"runs_s": runs, "handlers_swapped": swaps}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--task-rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    lines = lines_section(args.lines, args.rounds)
    runs = task_runs(args.tasks, args.task_rounds)
    code = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "device": device_name(),
        "cores": os.cpu_count(),
        "date": datetime.date.today().isoformat(),
        "code": code,
        "versions": versions(),
        "args": vars(args),
        "per_line": lines,
        "task_runs": runs,
    }
    table = [
        f"# python benchmarks/probes/console_lines.py (code {code}), {result['date']}, {result['device']}"
    ]
    table.append("| one task-run line to a file | median µs | p95 µs |")
    table.append("|---|---:|---:|")
    for name, figures in lines.items():
        table.append(f"| {name} | {figures['median_us']:.1f} | {figures['p95_us']:.1f} |")
    table.append(f"| {args.tasks} trivial task runs, worker console | median s | p95 s | rounds |")
    table.append("|---|---:|---:|---|")
    for name, values in runs["runs_s"].items():
        rounds = ", ".join(f"{v:.2f}" for v in values)
        table.append(f"| {name} | {statistics.median(values):.2f} | {p95(values):.2f} | {rounds} |")
    median = {name: statistics.median(values) for name, values in runs["runs_s"].items()}
    for console in ("plain", "prefect console handler"):
        ratio = median[f"gpu, {console}"] / median[f"untagged, {console}"]
        table.append(f"`gpu` / untagged, worker console {console}: {ratio:.2f}")
        result.setdefault("gpu_over_untagged", {})[console] = ratio
    text = "\n".join(table)
    print(text)
    slug = result["device"].replace(" ", "-").replace("(", "").replace(")", "").lower()
    out = args.out or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "results",
        f"{result['date']}-{slug}-console-lines.json",
    )
    with open(out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
