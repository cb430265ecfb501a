"""What a big flow's process keeps per task run: the default runner against Prefect's
``ThreadPoolTaskRunner``, in one run.

    python -m benchmarks.big_flow                          # 20,000 task runs each
    python -m benchmarks.big_flow --tasks 3000 --first 1000 --json out.json --top 15

Each runner runs in a fresh process of its own (without ``PREFECT_API_URL``: Prefect's
temporary server with a fresh ``PREFECT_HOME``, the README's default), one flow run
that maps a ``gpu`` task (on CPU: the default runner's one worker offering ``GPU=1``,
its guard reading the scripted probe; ``benchmarks.common.one_gpu_slot_runner``):

1. a warm-up map of 200 (one-time caches, the cluster, the workers' imports);
   ``tracemalloc`` starts after it;
2. a map of ``--first`` items (default 1,000), all results read; then, after
   ``gc.collect()``, what the process holds: ``H1``;
3. a map of the other ``--tasks - --first`` items, all results read, every future of
   both maps still referenced; after ``gc.collect()``: ``H2``.

``held`` is the slope between the two, per 1,000 task runs: ``(H2 - H1) / (tasks -
first) x 1000``. Whatever is bounded (distributed's message and event logs of 1,000
entries, the runner's caches of 1,024 entries) fills during
step 2 and does not count; what grows with the flow does. Prefect's event and log
queues are drained before each reading (a backlog waiting for the API is not held per
task run). Both runners keep a final state per future (Prefect's own futures do), so
like is compared with like. ``held (RSS)`` is the same slope of the resident set,
noisier (freed memory is not always returned).

``kept``: what ``tracemalloc`` still counts after the flow run has returned and
``gc.collect()``, over all task runs, per 1,000 task runs: nothing per task run should
outlive its flow run. Prefect itself keeps each flow run's context alive afterwards
(its log and event services run asyncio tasks started in it, holding the flow's task
runner and what the engine recorded per task run): the thread pool's figure is that.

``--top K`` lists the K source lines whose holdings grew most between the two readings,
in each process. ``--scheduler-process`` runs the default runner against a ``dask
scheduler`` (and one ``dask worker``) in processes of their own, so that what the
scheduler keeps per task (its tasks' arguments and bookkeeping, in the flow's own
process on a local cluster) is told apart from what the runner keeps.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RUNNERS = ("threads", "dask")
WARM = 200
FIRST = 1000
MiB = 2**20


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _drain_prefect_services() -> None:
    """Let Prefect's event and log queues reach the API: a backlog is not held per task run."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (EventsWorker, APILogWorker):
        service.drain_all(timeout=60)


def _reading() -> tuple[int, int]:
    _drain_prefect_services()
    gc.collect()
    return tracemalloc.get_traced_memory()[0], _rss()


def _runner(runner_name: str, address: str | None) -> Any:
    from prefect.task_runners import ThreadPoolTaskRunner

    from benchmarks.common import one_gpu_slot_runner

    if runner_name == "threads":
        return ThreadPoolTaskRunner(max_workers=8)
    if address is None:
        return one_gpu_slot_runner()
    from prefect_gpu_dask import GPUDaskTaskRunner

    # The scripted probe's GPU names no device: no host-wide GPU lock to take.
    return GPUDaskTaskRunner(
        address=address, memory_probe="benchmarks.recycle_soak:scripted_gpu_probe", host_gpu_lock=False
    )


def _measure(runner_name: str, n: int, first: int, top: int, address: str | None = None) -> dict[str, Any]:
    """In the child: run the big flow on ``runner_name``; its figures."""
    from prefect import flow, task

    @task(tags=["gpu"])
    def item(i: int) -> int:
        return i

    figures: dict[str, Any] = {}

    @flow(task_runner=_runner(runner_name, address))
    def big_flow(n: int) -> int:
        assert item.map(range(WARM)).result() == list(range(WARM))  # warm: one-time caches
        _drain_prefect_services()
        gc.collect()
        tracemalloc.start(1)
        futures = item.map(range(first))
        total = sum(futures.result())
        figures["h1"], figures["rss1"] = _reading()
        snapshot = tracemalloc.take_snapshot() if top else None
        more = item.map(range(first, n))
        total += sum(more.result())
        figures["h2"], figures["rss2"] = _reading()
        if snapshot is not None:
            stats = tracemalloc.take_snapshot().compare_to(snapshot, "lineno")[:top]
            figures["top"] = [(str(s.traceback), s.size_diff, s.count_diff) for s in stats]
        del futures, more
        return total

    assert big_flow(n) == n * (n - 1) // 2
    figures["kept"] = _reading()[0]
    if top:
        stats = tracemalloc.take_snapshot().statistics("lineno")[:top]
        figures["kept_top"] = [(str(s.traceback), s.size, s.count) for s in stats]
    tracemalloc.stop()
    per_1000 = 1000 / (n - first)
    return {
        "runner": runner_name + (" (scheduler process)" if address else ""),
        "tasks": n,
        "first": first,
        "held_mib_per_1000": (figures["h2"] - figures["h1"]) / MiB * per_1000,
        "held_rss_mib_per_1000": (figures["rss2"] - figures["rss1"]) / MiB * per_1000,
        "kept_mib_per_1000": figures["kept"] / MiB * 1000 / n,
        "top": figures.get("top", []),
        "kept_top": figures.get("kept_top", []),
    }


def measure_in_child(
    runner_name: str,
    n: int,
    first: int = FIRST,
    top: int = 0,
    env: dict[str, str] | None = None,
    address: str | None = None,
) -> dict[str, Any]:
    """``_measure`` in a fresh process."""
    env = dict(os.environ if env is None else env)
    if not env.get("PREFECT_API_URL"):
        import tempfile

        env["PREFECT_HOME"] = tempfile.mkdtemp(prefix=f"prefect-home-big-flow-{runner_name}-")
        env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    args = ["--child", runner_name, "--tasks", str(n), "--first", str(first), "--top", str(top)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.big_flow", *args, *(["--address", address] if address else [])],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("BIG-FLOW ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the {runner_name} run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("BIG-FLOW ") :])


@contextlib.contextmanager
def scheduler_process(env: dict[str, str] | None = None) -> Iterator[str]:
    """A ``dask scheduler`` and one ``dask worker`` (8 threads, ``GPU=1``) in processes of
    their own; the scheduler's address."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env, "cwd": root}
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port)]
        + ["--no-dashboard"],
        **quiet,
    )
    worker = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "8"]
        + ["--resources", "GPU=1", "--no-dashboard"],
        **quiet,
    )
    try:
        import distributed

        with distributed.Client(address, timeout=60) as client:
            client.wait_for_workers(1, timeout=120)
        yield address
    finally:
        for process in (worker, scheduler):
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def compare(
    n: int, first: int = FIRST, top: int = 0, env: dict[str, str] | None = None, scheduler: bool = False
) -> dict[str, Any]:
    """Both runners, each in a fresh process; the ratios of what they hold per task run.
    ``scheduler``: the default runner once more, against a scheduler in its own process."""
    if not 0 < first < n:
        raise ValueError(f"first must be > 0 and < tasks ({n}), got {first!r}")
    results = {name: measure_in_child(name, n, first, top, env) for name in RUNNERS}
    if scheduler:
        with scheduler_process(env) as address:
            results["dask-remote"] = measure_in_child("dask", n, first, top, env, address)
    threads, dask = results["threads"], results["dask"]
    return {
        "tasks": n,
        "first": first,
        "runners": results,
        "held_ratio": dask["held_mib_per_1000"] / threads["held_mib_per_1000"],
        "held_rss_ratio": (
            dask["held_rss_mib_per_1000"] / threads["held_rss_mib_per_1000"]
            if threads["held_rss_mib_per_1000"] > 0
            else None
        ),
    }


def print_table(report: dict[str, Any]) -> None:
    print(
        f"{report['tasks']:,} task runs per flow run, held: the slope from {report['first']:,} to "
        f"{report['tasks']:,}; MiB per 1,000 task runs, after gc.collect()"
    )
    print(f"{'runner':<14}{'held (tracemalloc)':>20}{'held (RSS)':>12}{'kept after flow':>18}")
    for name, r in report["runners"].items():
        print(
            f"{name:<14}{r['held_mib_per_1000']:>20.2f}{r['held_rss_mib_per_1000']:>12.2f}"
            f"{r['kept_mib_per_1000']:>18.3f}"
        )
    rss_ratio = report["held_rss_ratio"]
    print(
        f"dask / threads: held {report['held_ratio']:.2f}x (tracemalloc)"
        + (f", {rss_ratio:.2f}x (RSS)" if rss_ratio is not None else "")
    )
    for name, r in report["runners"].items():
        if r["top"]:
            print(f"-- {name}: largest growth between the two readings (bytes, blocks)")
            for where, size, count in r["top"]:
                print(f"   {size:>12,} {count:>8,}  {where}")
        if r.get("kept_top"):
            print(f"-- {name}: largest holders left after the flow run (bytes, blocks)")
            for where, size, count in r["kept_top"]:
                print(f"   {size:>12,} {count:>8,}  {where}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=20_000, help="task runs per flow (default 20,000)")
    parser.add_argument("--first", type=int, default=FIRST, help="task runs before the first reading")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--top", type=int, default=0, help="list the K largest holders in each process")
    parser.add_argument(
        "--scheduler-process", action="store_true", help="also: the scheduler in a process of its own"
    )
    parser.add_argument("--child", choices=RUNNERS, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 0 < args.first < args.tasks:
        raise ValueError(f"--first must be > 0 and < --tasks ({args.tasks}), got {args.first!r}")
    if args.child:
        figures = _measure(args.child, args.tasks, args.first, args.top, args.address)
        print("BIG-FLOW " + json.dumps(figures), flush=True)
        return
    report = compare(args.tasks, args.first, args.top, scheduler=args.scheduler_process)
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
