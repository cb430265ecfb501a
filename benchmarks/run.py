"""Benchmarks: the product against what users would otherwise run, in one process.

    python benchmarks/run.py                 # everything this host can run
    python benchmarks/run.py --quick         # CPU-sized smoke run (any machine)

Prints a table and writes ``benchmarks/results/<date>-<device>.json`` plus the headline
figures to ``benchmarks/results/summary.json``. "Warm" means: the cluster is already
up and the same computation ran once before; each figure is the median of ``--repeat``
runs (batches of trivial tasks: at least 5 rounds, each listed), with the p95 beside it
where the spread matters (the speed-cube through the runner, leak to serving).
Each section is a module of ``benchmarks/sections/``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks.* when run as a script
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
RESULTS = ROOT / "benchmarks" / "results"

if TYPE_CHECKING:
    from benchmarks.common import Options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small CPU-sized run")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sections", default="cube,tasks,guard,leak,scaling")
    parser.add_argument("--tasks", default="200,1000")
    parser.add_argument(
        "--tagged",
        help="TASKS:ROUNDS for the tagged section (gpu-tagged vs untagged, SQLite and PostgreSQL);"
        " default 1000:3, with --quick 100:1",
    )
    parser.add_argument(
        "--scaling-n",
        default="100000",
        help="cube sides (SIDE or SIDE:CHUNK) for the scaling section; the first is the seed's",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from benchmarks.common import WARM_TASKS, Options, device_name, versions
    from prefect_gpu_dask import gpu_available

    gpu = gpu_available() and not args.quick
    n, chunk = (100_000, 10_000) if gpu else (4_000, 1_000)
    # Bad input fails before anything runs.
    tagged_tasks, tagged_rounds = tagged_size(args.tagged or ("100:1" if args.quick else "1000:3"))
    options = Options(
        gpu=gpu,
        n=n,
        chunk=chunk,
        repeat=args.repeat,
        tasks=task_batches(args.tasks),
        tagged_tasks=tagged_tasks,
        tagged_rounds=tagged_rounds,
        scaling_sizes=tuple(scaling_sizes(args.scaling_n, chunk)),
    )
    sections = set(args.sections.split(","))
    if unknown := sections - SUMMARY_KEYS.keys():
        raise SystemExit(f"--sections: {','.join(sorted(unknown))} not among {','.join(SUMMARY_KEYS)}")
    result: dict[str, Any] = {
        "device": device_name(),
        "date": date.today().isoformat(),
        "sections": sorted(sections),
        "quick": args.quick,
        "host_cores": os.cpu_count(),
        "versions": versions(),
        "warm": (
            "cluster already up; medians of --repeat runs after one warm-up run (the speed-cube "
            "through the runner: at least 20, with p95); "
            f"per-task: after {WARM_TASKS} warm-up tasks spread over the workers"
        ),
    }
    from prefect.testing.utilities import prefect_test_harness

    # Every runner reports to the same real API server (SQLite), as a deployment would.
    with prefect_test_harness(server_startup_timeout=120):
        run_sections(result, sections, options)
    write(result, args.out)


def run_sections(result: dict[str, Any], sections: set[str], options: Options) -> None:
    """Each section asked for, in the order of ``SUMMARY_KEYS``; its figures go into
    ``result`` and are printed as each is measured."""
    for section in SUMMARY_KEYS:
        if section not in sections:
            continue
        module = importlib.import_module(f"benchmarks.sections.{section}")
        for key, figures in module.run(options):
            result[key] = figures
            # The tagged section prints its rounds as they run: here only their summary.
            shown = figures["summary"] if key == "per_task_gpu" else figures
            print(key, json.dumps(shown, default=str), flush=True)


def task_batches(spec: str) -> tuple[int, ...]:
    """``"200,1000"`` -> (200, 1000): batch sizes of trivial tasks."""
    try:
        return tuple(int(n) for n in spec.split(","))
    except ValueError:
        raise SystemExit(f"--tasks: {spec!r} is not comma-separated integers") from None


def scaling_sizes(spec: str, chunk: int) -> list[tuple[int, int]]:
    """``"100000,400000:20000"`` -> [(100000, chunk), (400000, 20000)]: cube side[:chunk side]."""
    sizes = []
    for entry in spec.split(","):
        side, _, side_chunk = entry.partition(":")
        try:
            sizes.append((int(side), int(side_chunk or chunk)))
        except ValueError:
            raise SystemExit(f"--scaling-n: {entry!r} is not SIDE or SIDE:CHUNK (integers)") from None
    return sizes


def tagged_size(spec: str) -> tuple[int, int]:
    """``"1000:3"`` -> (1000, 3): tasks per batch, rounds."""
    tasks, _, rounds = spec.partition(":")
    try:
        sizes = int(tasks), int(rounds or 3)
    except ValueError:
        raise SystemExit(f"--tagged: {spec!r} is not TASKS[:ROUNDS] (integers)") from None
    if min(sizes) < 1:
        raise SystemExit(f"--tagged: {spec!r} needs TASKS and ROUNDS >= 1")
    return sizes


# The summary's keys each section measures: a run of some sections updates only those.
SUMMARY_KEYS = {
    "cube": ("speed_cube", "speed_cube_runner_1gpu_s"),
    "tasks": ("per_task",),
    "guard": ("guard_us",),
    "leak": (
        "leak_to_serving_s",
        "leak_to_serving_p95_s",
        "memory_free_s",
        "cluster_start_s",
        "first_task_s",
    ),
    "tagged": ("per_task_gpu_1000",),
    "scaling": ("scaling_2gpu", "scaling_2gpu_raw_distributed", "scaling"),
}


def write(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    slug = result["device"].lower().replace(" ", "-").replace("(", "").replace(")", "")
    path = out / f"{result['date']}-{slug}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    cube = result.get("speed_cube", {})
    per_task = {p["n"]: p for p in result.get("per_task", [])}
    first = per_task.get(200) or next(iter(per_task.values()), {})
    summary = {
        "device": result["device"],
        "date": result["date"],
        "warm": result["warm"],
        "speed_cube": {
            k: cube.get(k) for k in ("runner_s", "raw_threads_s", "cpu_threads_s", "raw_local_cuda_cluster_s")
        }
        | {
            f"runner_{k}": cube.get("runner", {}).get(k)
            for k in ("median_s", "p95_s", "p95_over_median", "max_s", "runs")
        }
        | {
            f"runner_postgres_{k}": cube.get("runner_postgres", {}).get(k)
            for k in ("median_s", "p95_s", "p95_over_median", "max_s", "runs", "skipped")
        },
        # On a host with several GPUs runner_s uses them all; this one is comparable with raw_threads_s.
        "speed_cube_runner_1gpu_s": (
            result.get("scaling", {}).get("runner_1gpu_s")
            if result.get("scaling", {}).get("n") == cube.get("n")
            else None
        ),
        "per_task": {
            k: first.get(k)
            for k in (
                "n",
                "threadpool_s",
                "threadpool_runs_s",
                "prefect_dask_s",
                "runner_s",
                "runner_runs_s",
                "runner_over_threadpool",
                "threadpool_gpu_tagged_s",
                "runner_guarded_gpu_tasks_s",
            )
        },
        "guard_us": result.get("guard", {}).get("guard_us"),
        "leak_to_serving_s": result.get("leak", {}).get("leak_to_serving_s"),
        "leak_to_serving_p95_s": result.get("leak", {}).get("leak_to_serving", {}).get("p95_s"),
        "memory_free_s": result.get("leak", {}).get("memory_free_s"),
        "cluster_start_s": result.get("leak", {}).get("cluster_start_s"),
        "first_task_s": result.get("leak", {}).get("first_task_s"),
        "per_task_gpu_1000": result.get("per_task_gpu", {}).get("summary"),
        "scaling_2gpu": result.get("scaling", {}).get("scaling_2gpu"),
        "scaling_2gpu_raw_distributed": result.get("scaling", {}).get("raw_distributed_scaling_2gpu"),
        "scaling": {
            section: {
                k: v for k, v in figures.items() if k.startswith(("n", "chunk", "scaling_", "efficiency_"))
            }
            for section, figures in result.items()
            if section.startswith("scaling")
        },
        "source": path.name,
    }
    if result["device"].startswith("CPU only") or result["quick"]:
        print("(CPU-only or --quick run: summary.json is kept for full-size GPU figures)")
    elif {"speed_cube", "per_task", "guard", "leak"} <= result.keys():
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    else:
        update_summary(out / "summary.json", summary, result["sections"])
    print_table(result)
    print(f"wrote {path}")


def update_summary(path: Path, summary: dict[str, Any], sections: list[str]) -> None:
    """A run of some sections on the device and date of the full run in ``path`` adds its
    figures there, naming both runs; any other is kept out of it."""
    try:
        full = json.loads(path.read_text())
    except FileNotFoundError:
        full = {}
    if (full.get("device"), full.get("date")) != (summary["device"], summary["date"]):
        print("(some sections only: summary.json is kept for a full run's figures on this device and date)")
        return
    for section in sections:
        full |= {key: summary[key] for key in SUMMARY_KEYS.get(section, ())}
    sources = full["source"] if isinstance(full["source"], list) else [full["source"]]
    full["source"] = [*sources, f"{summary['source']} ({','.join(sections)})"]
    path.write_text(json.dumps(full, indent=2))
    print(f"(summary.json: {','.join(sections)} added from this run)")


def print_table(result: dict[str, Any]) -> None:
    def fmt(v: Any) -> str:
        return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))

    print(f"\n{result['device']} — {result['date']}")
    cube = result.get("speed_cube", {})
    rows = [
        ("speed-cube via GPUDaskTaskRunner (s)", cube.get("runner_s")),
        ("speed-cube raw Dask threads on GPU (s)", cube.get("raw_threads_s")),
        ("speed-cube raw LocalCUDACluster (s)", cube.get("raw_local_cuda_cluster_s")),
        ("speed-cube host CPU threads (s)", cube.get("cpu_threads_s")),
    ]
    for p in result.get("per_task", []):
        for key in (
            "threadpool_s",
            "prefect_dask_s",
            "runner_s",
            "threadpool_gpu_tagged_s",
            "runner_guarded_gpu_tasks_s",
        ):
            rows.append((f"{p['n']} trivial tasks: {key} (s)", p.get(key)))
        rows.append((f"{p['n']} trivial tasks: runner / thread pool", p.get("runner_over_threadpool")))
        rows.append(("… each round (runner / thread pool)", p.get("runner_over_threadpool_runs")))
    rows += [
        ("guard per task (µs, median)", result.get("guard", {}).get("guard_us")),
        ("… with the health screen (µs)", result.get("guard", {}).get("guard_with_screen_us")),
        (
            "… with the screen, in a plain process (µs)",
            result.get("guard", {}).get("in_plain_process", {}).get("guard_with_screen_us"),
        ),
        (
            "… with the screen, a worker sharing its GPU (µs)",
            result.get("guard", {}).get("sharing_its_gpu", {}).get("guard_with_screen_us"),
        ),
        ("speed-cube via runner: p95 / median", cube.get("runner", {}).get("p95_over_median")),
        (
            "… reporting to PostgreSQL: p95 / median",
            cube.get("runner_postgres", {}).get("p95_over_median"),
        ),
        ("leak -> replacement serving (s, median)", result.get("leak", {}).get("leak_to_serving_s")),
        (
            "leak -> replacement serving (s, p95)",
            result.get("leak", {}).get("leak_to_serving", {}).get("p95_s"),
        ),
        ("leak -> old memory free (s, median)", result.get("leak", {}).get("memory_free_s")),
        ("cluster start (s)", result.get("leak", {}).get("cluster_start_s")),
        ("then first trivial task (s)", result.get("leak", {}).get("first_task_s")),
    ]
    if tagged := result.get("per_task_gpu"):
        n, summary = tagged["tasks"], tagged["summary"]
        rows += [
            (f"{n} gpu-tagged tasks, SQLite server (s, median)", summary["sqlite_s"]),
            ("… tagged / untagged, SQLite", summary["tagged_over_untagged_sqlite"]),
            (f"{n} gpu-tagged tasks, PostgreSQL server (s, median)", summary["postgres_s"]),
            ("… tagged / untagged, PostgreSQL", summary["tagged_over_untagged_postgres"]),
        ]
    for section in sorted(key for key in result if key.startswith("scaling")):
        for k, v in result[section].items():
            if isinstance(v, dict):  # a spread: its median and the median inside the task
                rows.append((f"{section} {k} p95 (s)", v["p95_s"]))
                inside = (v.get("inside_task") or {}).get("median_s")
                rows.append((f"{section} {k} inside the task (s)", inside))
            else:
                rows.append((f"{section} {k}", v))
    width = max(len(r[0]) for r in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {fmt(value)}")


if __name__ == "__main__":
    main()
