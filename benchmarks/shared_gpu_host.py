"""Several flow runs started together on one GPU host, each with the default runner
(so each starts a cluster of its own), each with one ``gpu`` task that needs a given
fraction of the GPU's memory.

    python benchmarks/shared_gpu_host.py --flows 2 --fraction 0.6            # with the host lock
    python benchmarks/shared_gpu_host.py --flows 2 --fraction 0.6 --no-lock  # without: they collide

Every flow run is a process of its own (as under a process work pool), all reporting
to one ``prefect server start`` (``benchmarks/servers.py``). Each task allocates its
share with CuPy, holds it ``--hold`` seconds and writes when it had the GPU to a
ledger. Reports failed flow runs, whether any two tasks overlapped on the GPU, and the
span from the first task's start to the last one's end against the sum of the tasks'
own times. Prints a table, writes JSON (``--out``); exits 1 when a flow run failed or
tasks overlapped with the lock on. Needs a GPU, CuPy and dask-cuda.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def fill_gpu(ledger: str, fraction: float, hold_s: float) -> int:
    """Take ``fraction`` of the GPU's memory, hold it, and say when."""
    import cupy

    started = time.time()
    free, total = cupy.cuda.runtime.memGetInfo()
    block = cupy.ones(int(total * fraction) // 8, dtype=cupy.float64)
    cupy.cuda.Device().synchronize()
    time.sleep(hold_s)
    nbytes = int(block.nbytes)
    del block
    cupy.get_default_memory_pool().free_all_blocks()
    with open(ledger, "a") as fh:
        fh.write(
            json.dumps({"pid": os.getpid(), "start": started, "end": time.time(), "free_at_start": free})
        )
        fh.write("\n")
    return nbytes


def one_flow_run(ledger: str, fraction: float, hold_s: float, lock: bool) -> None:
    from prefect import flow, task

    from prefect_gpu_dask import GPUDaskTaskRunner

    gpu_task = task(fill_gpu, name="fill-gpu", tags=["gpu"])

    @flow(name="shared-gpu-host", task_runner=GPUDaskTaskRunner(host_gpu_lock=lock))
    def nightly() -> int:
        return gpu_task.submit(ledger, fraction, hold_s).result()

    nightly()


def overlaps(spans: list[tuple[float, float]]) -> int:
    ordered = sorted(spans)
    return sum(1 for (_, end), (start, _) in zip(ordered, ordered[1:]) if start < end)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--flows", type=int, default=2)
    parser.add_argument("--fraction", type=float, default=0.6)
    parser.add_argument("--hold", type=float, default=5.0)
    parser.add_argument("--no-lock", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one", nargs=3, metavar=("LEDGER", "FRACTION", "HOLD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a flow run's own process
        one_flow_run(args.one[0], float(args.one[1]), float(args.one[2]), not args.no_lock)
        return 0
    if args.flows < 1 or not 0 < args.fraction < 1:
        parser.error(f"--flows {args.flows} must be >= 1 and --fraction {args.fraction} in (0, 1)")

    from benchmarks.servers import using_prefect_server

    ledger = Path(f"/tmp/shared-gpu-host-{os.getpid()}.jsonl")
    ledger.unlink(missing_ok=True)
    with using_prefect_server() as api:
        env = {
            **os.environ,
            "PREFECT_API_URL": api,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        command = [sys.executable, __file__, "--one", str(ledger), str(args.fraction), str(args.hold)]
        command += ["--no-lock"] if args.no_lock else []
        started = time.time()
        runs = [
            subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(args.flows)
        ]
        outputs = [run.communicate(timeout=600)[0] for run in runs]
        wall = time.time() - started
    rows = [json.loads(line) for line in ledger.read_text().splitlines()] if ledger.exists() else []
    spans = [(r["start"], r["end"]) for r in rows]
    failed = sum(run.returncode != 0 for run in runs)
    ooms = sum("OutOfMemory" in out for out in outputs)
    busy = sum(end - start for start, end in spans)
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
    summary = {
        "flows": args.flows,
        "fraction": args.fraction,
        "hold_s": args.hold,
        "host_gpu_lock": not args.no_lock,
        "failed_flow_runs": failed,
        "flow_runs_with_oom": ooms,
        "tasks_done": len(rows),
        "overlapping_pairs": overlaps(spans),
        "sum_of_task_s": round(busy, 3),
        "first_start_to_last_end_s": round(span, 3),
        "span_over_sum": round(span / busy, 3) if busy else None,
        "wall_s": round(wall, 3),
    }
    print(f"{'measure':34} value")
    for key, value in summary.items():
        print(f"{key:34} {value}")
    for i, out in enumerate(outputs):
        if runs[i].returncode != 0:
            print(
                f"--- flow run {i} (exit {runs[i].returncode}), last lines:\n"
                + "\n".join(out.splitlines()[-15:])
            )
    result = {
        "benchmark": "shared_gpu_host",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": _gpu_name(),
        "nproc": os.cpu_count(),
        "summary": summary,
        "tasks": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 1 if not args.no_lock and (failed or summary["overlapping_pairs"]) else 0


def _gpu_name() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
