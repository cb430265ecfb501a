"""What a big flow's process keeps per task run: the default runner against Prefect's
``ThreadPoolTaskRunner``, in one run.

    python -m benchmarks.big_flow                      # 20,000 task runs each
    python -m benchmarks.big_flow --tasks 2000 --json out.json --top 15

Each runner runs in a fresh process of its own: one flow that maps a ``gpu`` task over
``--tasks`` items (on CPU: the default runner's one worker offering ``GPU=1``, its guard
reading the scripted probe; ``benchmarks.common.one_gpu_slot_runner``) after a warm-up
map, and holds every future until all results are in. Measured after ``gc.collect()``,
per 1,000 task runs:

- ``held``: what the flow's process holds with every future still referenced
  (tracemalloc, started after the warm-up; and the RSS growth);
- ``kept``: what is left of it after the flow run has returned (tracemalloc): nothing
  per task run should outlive its flow run.

``--top K`` lists the K source lines holding the most in each process while held.
Without ``PREFECT_API_URL`` each process runs on Prefect's temporary server with a
fresh ``PREFECT_HOME`` (the README's default).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

RUNNERS = ("threads", "dask")
WARM = 200
MiB = 2**20


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _measure(runner_name: str, n: int, top: int) -> dict[str, Any]:
    """In the child: run the big flow on ``runner_name``; its figures."""
    from prefect import flow, task
    from prefect.task_runners import ThreadPoolTaskRunner

    from benchmarks.common import one_gpu_slot_runner

    @task(tags=["gpu"])
    def item(i: int) -> int:
        return i

    runner = ThreadPoolTaskRunner(max_workers=8) if runner_name == "threads" else one_gpu_slot_runner()
    figures: dict[str, Any] = {}

    @flow(task_runner=runner)
    def big_flow(n: int) -> int:
        assert item.map(range(WARM)).result() == list(range(WARM))  # warm: one-time caches
        gc.collect()
        rss_before = _rss()
        tracemalloc.start(1)
        futures = item.map(range(n))
        total = sum(futures.result())
        gc.collect()
        figures["held_bytes"] = tracemalloc.get_traced_memory()[0]
        figures["held_rss_bytes"] = _rss() - rss_before
        if top:
            stats = tracemalloc.take_snapshot().statistics("lineno")[:top]
            figures["top"] = [(str(s.traceback), s.size, s.count) for s in stats]
        del futures
        return total

    assert big_flow(n) == n * (n - 1) // 2
    gc.collect()
    figures["kept_bytes"] = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_1000 = 1000 / n
    return {
        "runner": runner_name,
        "tasks": n,
        "held_mib_per_1000": figures["held_bytes"] / MiB * per_1000,
        "held_rss_mib_per_1000": figures["held_rss_bytes"] / MiB * per_1000,
        "kept_mib_per_1000": figures["kept_bytes"] / MiB * per_1000,
        "top": figures.get("top", []),
    }


def measure_in_child(
    runner_name: str, n: int, top: int = 0, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``_measure`` in a fresh process."""
    env = dict(os.environ if env is None else env)
    if not env.get("PREFECT_API_URL"):
        import tempfile

        env["PREFECT_HOME"] = tempfile.mkdtemp(prefix=f"prefect-home-big-flow-{runner_name}-")
        env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.big_flow",
            "--child",
            runner_name,
            "--tasks",
            str(n),
            "--top",
            str(top),
        ],
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


def compare(n: int, top: int = 0, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Both runners, each in a fresh process; the ratios of what they hold per task run."""
    results = {name: measure_in_child(name, n, top, env) for name in RUNNERS}
    threads, dask = results["threads"], results["dask"]
    return {
        "tasks": n,
        "runners": results,
        "held_ratio": dask["held_mib_per_1000"] / threads["held_mib_per_1000"],
        "held_rss_ratio": (
            dask["held_rss_mib_per_1000"] / threads["held_rss_mib_per_1000"]
            if threads["held_rss_mib_per_1000"] > 0
            else None
        ),
    }


def print_table(report: dict[str, Any]) -> None:
    print(f"{report['tasks']:,} task runs per flow; MiB per 1,000 task runs, after gc.collect()")
    print(f"{'runner':<10}{'held (tracemalloc)':>20}{'held (RSS)':>12}{'kept after flow':>18}")
    for name, r in report["runners"].items():
        print(
            f"{name:<10}{r['held_mib_per_1000']:>20.2f}{r['held_rss_mib_per_1000']:>12.2f}{r['kept_mib_per_1000']:>18.3f}"
        )
    rss_ratio = report["held_rss_ratio"]
    print(
        f"dask / threads: held {report['held_ratio']:.2f}x (tracemalloc)"
        + (f", {rss_ratio:.2f}x (RSS)" if rss_ratio is not None else "")
    )
    for name, r in report["runners"].items():
        if r["top"]:
            print(f"-- {name}: largest holders while held (bytes, blocks)")
            for where, size, count in r["top"]:
                print(f"   {size:>12,} {count:>8,}  {where}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=20_000, help="task runs per flow (default 20,000)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--top", type=int, default=0, help="list the K largest holders in each process")
    parser.add_argument("--child", choices=RUNNERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tasks < 1:
        raise ValueError(f"--tasks must be >= 1, got {args.tasks!r}")
    if args.child:
        print("BIG-FLOW " + json.dumps(_measure(args.child, args.tasks, args.top)), flush=True)
        return
    report = compare(args.tasks, args.top)
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
