"""Several flow runs started together on one GPU host, each with the default runner
(so each starts a cluster of its own), each with one ``gpu`` task that needs a given
fraction of the GPU's memory.

    python benchmarks/shared_gpu_host.py --flows 2 --fraction 0.6            # with the host lock
    python benchmarks/shared_gpu_host.py --flows 2 --fraction 0.6 --no-lock  # without: they collide
    python benchmarks/shared_gpu_host.py --flows 4 --host-cluster --leak-in-one --tasks 10

``--host-cluster`` starts ``prefect-gpu-dask cluster start`` first (in a private runtime
directory), so every flow run joins that one cluster instead of starting its own.
``--leak-in-one``: the first flow run's task also keeps 512 MiB on the GPU (a leak), so
its worker is recycled while the others run; ``--tasks`` short ``gpu`` tasks per flow run
follow the big one. Checked: every task of every flow run completed, none ran twice, the
leaking flow run's restart is in its GPU report (``read_flow_run_gpu_report``).

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
import tempfile
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


KEPT: list = []  # the leaking task's CuPy arrays, kept by its worker process
LEAK_BYTES = 512 * 2**20


def short_gpu_task(ledger: str, label: str) -> int:
    """A little real GPU work, noted in the ledger."""
    import cupy

    started = time.time()
    x = cupy.random.random((2048, 2048))
    float((x @ x).sum())
    with open(ledger, "a") as fh:
        fh.write(
            json.dumps({"pid": os.getpid(), "start": started, "end": time.time(), "label": label}) + "\n"
        )
    return os.getpid()


def leaking_gpu_task(ledger: str, label: str) -> int:
    import cupy

    started = time.time()
    KEPT.append(cupy.ones(LEAK_BYTES // 8))
    cupy.cuda.Device().synchronize()
    with open(ledger, "a") as fh:
        fh.write(
            json.dumps({"pid": os.getpid(), "start": started, "end": time.time(), "label": label}) + "\n"
        )
    return os.getpid()


def one_flow_run(
    ledger: str, fraction: float, hold_s: float, lock: bool, index: int, tasks: int, leak: bool
) -> None:
    from prefect import flow, task
    from prefect.context import FlowRunContext
    from prefect.futures import wait

    from prefect_gpu_dask import GPUDaskTaskRunner, read_flow_run_gpu_report

    gpu_task = task(fill_gpu, name="fill-gpu", tags=["gpu"])
    short = task(short_gpu_task, name="short", tags=["gpu"])
    leaking = task(leaking_gpu_task, name="leak-512MiB", tags=["gpu"])

    @flow(name="shared-gpu-host", task_runner=GPUDaskTaskRunner(host_gpu_lock=lock))
    def nightly() -> dict:
        futures = [gpu_task.submit(ledger, fraction, hold_s)]
        if leak:
            futures.append(leaking.submit(ledger, f"flow{index}-leak"))
        futures += [short.submit(ledger, f"flow{index}-short{i}") for i in range(tasks)]
        wait(futures)
        states = [f.state.type.value for f in futures]
        return {"flow": index, "states": states, "flow_run_id": str(FlowRunContext.get().flow_run.id)}

    result = nightly()
    # Read once the flow run is over: a recycle it ordered may end after its body (the
    # runner waits for it on the way out and publishes it to the API).
    report = read_flow_run_gpu_report(result.pop("flow_run_id"))
    result["restarts"] = [
        {"reason": r.reason, "outcome": r.outcome, "serving_s": r.serving_s} for r in report.restarts
    ]
    print("RESULT " + json.dumps(result))


def overlaps(spans: list[tuple[float, float]]) -> int:
    ordered = sorted(spans)
    return sum(1 for (_, end), (start, _) in zip(ordered, ordered[1:]) if start < end)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--flows", type=int, default=2)
    parser.add_argument("--fraction", type=float, default=0.6)
    parser.add_argument("--hold", type=float, default=5.0)
    parser.add_argument("--no-lock", action="store_true")
    parser.add_argument("--host-cluster", action="store_true", help="flow runs join one host cluster")
    parser.add_argument("--leak-in-one", action="store_true", help="the first flow run also leaks 512 MiB")
    parser.add_argument("--tasks", type=int, default=0, help="short gpu tasks per flow run after the big one")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--one", nargs=5, metavar=("LEDGER", "FRACTION", "HOLD", "INDEX", "LEAK"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.one:  # a flow run's own process
        ledger, fraction, hold, index, leak = args.one
        one_flow_run(
            ledger, float(fraction), float(hold), not args.no_lock, int(index), args.tasks, leak == "1"
        )
        return 0
    if args.flows < 1 or not 0 < args.fraction < 1:
        parser.error(f"--flows {args.flows} must be >= 1 and --fraction {args.fraction} in (0, 1)")

    from benchmarks.servers import using_prefect_server

    ledger = Path(f"/tmp/shared-gpu-host-{os.getpid()}.jsonl")
    ledger.unlink(missing_ok=True)
    runtime = tempfile.mkdtemp(prefix="shared-gpu-host-")
    base_env = {
        **os.environ,
        "PREFECT_GPU_DASK_RUNTIME_DIR": runtime,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    host_cluster = [sys.executable, "-m", "prefect_gpu_dask", "cluster"]
    if args.host_cluster:
        began = time.time()
        subprocess.run(
            host_cluster + ["start", "--dashboard-address", "127.0.0.1:0"], env=base_env, check=True
        )
        print(f"host cluster started in {time.time() - began:.2f} s")
    try:
        with using_prefect_server() as api:
            env = {**base_env, "PREFECT_API_URL": api}
            started = time.time()
            runs = []
            for index in range(args.flows):
                leak = "1" if args.leak_in_one and index == 0 else "0"
                one = [str(ledger), str(args.fraction), str(args.hold), str(index), leak]
                command = [sys.executable, __file__, "--one", *one, "--tasks", str(args.tasks)]
                command += ["--no-lock"] if args.no_lock else []
                # To a file, not a pipe: what a flow run said is there even if it never ends.
                log = Path(runtime) / f"flow-run-{index}.log"
                with open(log, "w") as out:
                    runs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT))
                print(f"flow run {index}: pid {runs[-1].pid}, output in {log}", flush=True)
            for run in runs:
                run.wait(timeout=600)
            wall = time.time() - started
            outputs = [(Path(runtime) / f"flow-run-{i}.log").read_text() for i in range(len(runs))]
    finally:
        if args.host_cluster:
            subprocess.run(host_cluster + ["stop", "--force"], env=base_env)
    results = [
        json.loads(line[len("RESULT ") :])
        for out in outputs
        for line in out.splitlines()
        if line.startswith("RESULT ")
    ]
    rows = [json.loads(line) for line in ledger.read_text().splitlines()] if ledger.exists() else []
    fills = [r for r in rows if "label" not in r]
    labels = [r["label"] for r in rows if "label" in r]
    spans = [(r["start"], r["end"]) for r in fills]
    failed = sum(run.returncode != 0 for run in runs)
    ooms = sum("OutOfMemory" in out for out in outputs)
    busy = sum(end - start for start, end in spans)
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
    summary = {
        "flows": args.flows,
        "fraction": args.fraction,
        "hold_s": args.hold,
        "host_gpu_lock": not args.no_lock,
        "host_cluster": args.host_cluster,
        "leak_in_one": args.leak_in_one,
        "short_tasks_per_flow": args.tasks,
        "failed_flow_runs": failed,
        "flow_runs_with_oom": ooms,
        "tasks_done": len(fills),
        "short_or_leak_tasks_done": len(labels),
        "tasks_run_twice": len(labels) - len(set(labels)),
        "tasks_not_completed": sum(s != "COMPLETED" for r in results for s in r["states"]),
        "restarts": [dict(flow=r["flow"], **x) for r in results for x in r["restarts"]],
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
        "flow_runs": results,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    broken = (
        failed or summary["overlapping_pairs"] or summary["tasks_run_twice"] or summary["tasks_not_completed"]
    )
    unrecycled = args.leak_in_one and not any(
        r["flow"] == 0 and r["outcome"] == "replaced" for r in summary["restarts"]
    )
    return 1 if not args.no_lock and (broken or unrecycled) else 0


def _gpu_name() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
