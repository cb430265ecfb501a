"""A busy night on one GPU host: N flow runs started at once, each its own process with
the default runner (so each starts a cluster of its own, or joins the host cluster with
``--host-cluster``), each one ``gpu`` task that takes ``--fraction`` of the GPU's memory
with CuPy, holds it ``--hold`` seconds and returns (its pool keeps the memory, as a
user's task would leave it).

    python benchmarks/busy_night.py --flows 4 --out busy-4.json
    python benchmarks/busy_night.py --flows 8 --host-cluster --out busy-8-host.json
    python benchmarks/busy_night.py --flows 4 --cpu                 # orchestration only
    python benchmarks/busy_night.py --flows 4 --cpu --scripted-gpu  # ... with the GPU turn

Checked: every flow run and task run ``Completed`` (0 failures), no two tasks on the GPU
at once (the tasks' own start/end times, ``time.time()`` inside the task, do not
overlap), and the first task's start to the last one's end within ``--target`` (15 %)
of the sum of the tasks' own times. Also reported: the gaps between one task's end and
the next one's start, the GPU's idle time while a flow run had asked for it
(``idle_while_asked_s``: the hand-overs' cost) and what the tasks' logs say they waited
for another cluster's memory ("handed over: waited …").

The flow runs report to one ``prefect server start`` (``--api server``, the default,
as deployments do), or each to a temporary server of its own in its own
``PREFECT_HOME`` (``--api own-home``, the README default for scripts). Every flow run
has ``--run-timeout`` seconds (its process group is killed after). The GPU turns and the
host cluster use a private runtime directory of this run only.

``--cpu``: no GPU; the task allocates with NumPy (``--fraction`` of ``--cpu-mib``) and
the default runner runs it on the CPU, with no GPU turn: only that the orchestration
completes is checked (and, with ``--host-cluster``, whose one worker has one ``GPU``
slot, that no two tasks overlap). ``--scripted-gpu`` (with ``--cpu``) gives each flow run a
``LocalCluster`` with a ``GPU`` slot and the tests' scripted GPU
(``tests.scripted_probe``), all with the same UUID, so the GPU turn applies and the
overlap check too. Prints a table and writes JSON (``--out``); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HANDED_OVER = re.compile(r"handed over: waited ([0-9.]+) s for ([0-9.]+) GiB")
STILL_HELD = re.compile(r"still hold ([0-9.]+) GiB more than a CUDA context after ([0-9.]+) s")
TURN_WAIT = re.compile(r"Waited ([0-9.]+) s for GPU")


# -- inside a flow run's process ----------------------------------------------------


def fill_gpu(fraction: float, hold_s: float, on_gpu: bool, cpu_mib: int) -> dict[str, Any]:
    """Take ``fraction`` of the GPU's memory (NumPy: of ``cpu_mib``), hold it, return
    when it had it. The block is dropped, not flushed: CuPy's pool keeps it."""
    started = time.time()
    free = None
    if on_gpu:
        import cupy

        free, total = cupy.cuda.runtime.memGetInfo()
        block = cupy.zeros(int(total * fraction), dtype=cupy.uint8)
        cupy.cuda.Device().synchronize()
    else:
        import numpy

        block = numpy.ones(int(cpu_mib * 2**20 * fraction), dtype=numpy.uint8)
    nbytes = int(block.nbytes)
    time.sleep(hold_s)
    del block
    return {"pid": os.getpid(), "start": started, "end": time.time(), "bytes": nbytes, "free_at_start": free}


def one_flow_run(
    index: int, fraction: float, hold_s: float, on_gpu: bool, cpu_mib: int, scripted: bool
) -> None:
    from prefect import flow, task

    from prefect_gpu_dask import GPUDaskTaskRunner

    if scripted:
        from tests.scripted_probe import FAKE_PROBE

        runner = GPUDaskTaskRunner(
            cluster_class="distributed.LocalCluster",
            cluster_kwargs={"n_workers": 1, "threads_per_worker": 1, "resources": {"GPU": 1}},
            memory_probe=FAKE_PROBE,
        )
    else:
        runner = GPUDaskTaskRunner()  # the default: its own cluster, or the host cluster
    gpu_task = task(fill_gpu, name="fill-gpu", tags=["gpu"])

    @flow(name="busy-night", task_runner=runner)
    def busy_night(index: int) -> dict[str, Any]:
        from prefect.context import FlowRunContext

        asked = time.time()
        future = gpu_task.submit(fraction, hold_s, on_gpu, cpu_mib)
        future.wait()
        state = future.state
        row: dict[str, Any] = {
            "flow_run_id": str(FlowRunContext.get().flow_run.id),
            "task_state": state.type.value,
            "asked": asked,
        }
        try:
            row["task"] = future.result()
        except Exception as exc:  # the row says how the task failed; the flow run goes on
            row["task_error"] = f"{type(exc).__name__}: {exc}"[:500]
        return row

    state = busy_night(index, return_state=True)
    row: dict[str, Any] = {"flow": index, "flow_state": state.type.value}
    try:
        row.update(state.result())
    except Exception as exc:  # a failed flow run is a row, not the end
        row["flow_error"] = f"{type(exc).__name__}: {exc}"[:500]
    print("RESULT " + json.dumps(row), flush=True)


# -- the conductor ------------------------------------------------------------------


def overlapping_pairs(spans: list[tuple[float, float]]) -> int:
    """Pairs of spans on the GPU at once (each against every later one that starts
    before it ends)."""
    ordered = sorted(spans)
    return sum(1 for i, (_, end) in enumerate(ordered) for start, _ in ordered[i + 1 :] if start < end)


def _kill_group(proc: subprocess.Popen) -> None:
    """End a flow run's process and everything it started (its Dask processes)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(10)
            return
        except subprocess.TimeoutExpired:
            continue


def start_flow_runs(args: argparse.Namespace, env: dict[str, str], logs: Path) -> list[dict[str, Any]]:
    """All flow runs at once; waits for each within ``--run-timeout`` of the start."""
    runs = []
    for index in range(args.flows):
        run_env = dict(env)
        if args.api == "own-home":
            run_env.pop("PREFECT_API_URL", None)
            run_env["PREFECT_HOME"] = tempfile.mkdtemp(prefix=f"busy-night-home-{index}-", dir=logs)
            run_env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
        command = [sys.executable, str(Path(__file__).resolve()), "--one", str(index)]
        command += [
            "--fraction",
            str(args.fraction),
            "--hold",
            str(args.hold),
            "--cpu-mib",
            str(args.cpu_mib),
        ]
        command += ["--cpu"] * args.cpu + ["--scripted-gpu"] * args.scripted_gpu
        if shutil.which("timeout"):  # a second bound, should this process itself die
            command = ["timeout", "-k", "10", str(int(args.run_timeout) + 30), *command]
        log = logs / f"flow-run-{index}.log"
        with open(log, "w") as out:  # a file, not a pipe: what it said is there even if it hangs
            proc = subprocess.Popen(
                command, env=run_env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
            )
        runs.append({"index": index, "proc": proc, "log": log})
        print(f"flow run {index}: pid {proc.pid}, output in {log}", flush=True)
    deadline = time.monotonic() + args.run_timeout
    for run in runs:
        try:
            run["returncode"] = run["proc"].wait(max(1.0, deadline - time.monotonic()))
            run["timed_out"] = False
        except subprocess.TimeoutExpired:
            _kill_group(run["proc"])
            run["returncode"], run["timed_out"] = run["proc"].returncode, True
        _kill_group(run["proc"])  # whatever it left running
    return runs


def read_run(run: dict[str, Any]) -> dict[str, Any]:
    """What a flow run's process said: its RESULT row and its hand-over lines."""
    text = run["log"].read_text(errors="replace")
    rows = [json.loads(line[len("RESULT ") :]) for line in text.splitlines() if line.startswith("RESULT ")]
    row = rows[-1] if rows else {"flow": run["index"], "flow_state": None}
    row.update(
        exit_code=run["returncode"],
        timed_out=run["timed_out"],
        out_of_memory="OutOfMemory" in text,
        memory_waits=[{"waited_s": float(s), "gib": float(g)} for s, g in set(HANDED_OVER.findall(text))],
        memory_not_back=[{"gib": float(g), "waited_s": float(s)} for g, s in set(STILL_HELD.findall(text))],
        turn_waits_s=sorted({float(s) for s in TURN_WAIT.findall(text)}),
        last_lines=text.splitlines()[-15:] if not rows or row.get("flow_state") != "COMPLETED" else [],
    )
    return row


def summarize(rows: list[dict[str, Any]], args: argparse.Namespace, wall_s: float) -> dict[str, Any]:
    tasks = sorted((r["task"] for r in rows if "task" in r), key=lambda t: t["start"])
    spans = [(t["start"], t["end"]) for t in tasks]
    own = sum(end - start for start, end in spans)
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
    # The GPU idle between two tasks while the next one's flow run had already asked:
    # what the hand-overs cost (a flow run still starting is not their cost).
    asked = {r["task"]["start"]: r["asked"] for r in rows if "task" in r}
    idle_asked = sum(max(0.0, b[0] - max(a[1], asked[b[0]])) for a, b in zip(spans, spans[1:]))
    memory_waits = [w["waited_s"] for r in rows for w in r["memory_waits"]]
    failures = [
        r["flow"]
        for r in rows
        if r.get("flow_state") != "COMPLETED"
        or r.get("task_state") != "COMPLETED"
        or r["exit_code"]
        or r["timed_out"]
    ]
    # On a plain CPU no turn applies, but a host cluster's one GPU slot does.
    checked_overlap = not args.cpu or args.scripted_gpu or args.host_cluster
    summary = {
        "flows": args.flows,
        "fraction": args.fraction,
        "hold_s": args.hold,
        "mode": "cpu-scripted-gpu" if args.scripted_gpu else "cpu" if args.cpu else "gpu",
        "host_cluster": args.host_cluster,
        "api": args.api,
        "failed_flow_runs": len(failures),
        "failed": failures,
        "flow_runs_with_oom": sum(r["out_of_memory"] for r in rows),
        "timed_out": sum(r["timed_out"] for r in rows),
        "tasks_done": len(tasks),
        "overlapping_pairs": overlapping_pairs(spans),
        "overlap_checked": checked_overlap,
        "sum_of_task_s": round(own, 3),
        "first_start_to_last_end_s": round(span, 3),
        "span_over_sum": round(span / own, 3) if own else None,
        "target": 1 + args.target,
        "idle_while_asked_s": round(idle_asked, 3),
        "handover_gap_mean_s": round(sum(gaps) / len(gaps), 3) if gaps else None,
        "handover_gap_max_s": round(max(gaps), 3) if gaps else None,
        "memory_waits": len(memory_waits),
        "memory_wait_max_s": max(memory_waits) if memory_waits else None,
        "memory_not_back": sum(len(r["memory_not_back"]) for r in rows),
        "wall_s": round(wall_s, 3),
    }
    ok = not failures and len(tasks) == args.flows
    if checked_overlap:
        ok = ok and summary["overlapping_pairs"] == 0
        ok = ok and summary["span_over_sum"] is not None and summary["span_over_sum"] <= 1 + args.target
    summary["ok"] = bool(ok)
    return summary


def print_table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    origin = min((r["task"]["start"] for r in rows if "task" in r), default=0.0)
    print(
        f"{'flow':>4} {'state':10} {'task':10} {'exit':>4} "
        f"{'start_s':>8} {'end_s':>8} {'own_s':>6} {'mem_wait_s':>10}"
    )
    for r in sorted(rows, key=lambda r: r.get("task", {}).get("start", float("inf"))):
        t = r.get("task")
        times = (
            f"{t['start'] - origin:8.2f} {t['end'] - origin:8.2f} {t['end'] - t['start']:6.2f}"
            if t
            else f"{'-':>8} {'-':>8} {'-':>6}"
        )
        waits = ",".join(f"{w['waited_s']:.2f}" for w in r["memory_waits"]) or "-"
        print(
            f"{r['flow']:>4} {str(r.get('flow_state')):10} {str(r.get('task_state')):10} "
            f"{str(r['exit_code']):>4} {times} {waits:>10}"
        )
    print()
    for key, value in summary.items():
        print(f"{key:28} {value}")
    for r in rows:
        if r["last_lines"]:
            print(
                f"--- flow run {r['flow']} (exit {r['exit_code']}), last lines:\n"
                + "\n".join(r["last_lines"])
            )


def host_cluster(command: str, env: dict[str, str], on_gpu: bool, timeout_s: float) -> None:
    cli = [sys.executable, "-m", "prefect_gpu_dask", "cluster", command]
    if command == "start":
        cli += ["--dashboard-address", "127.0.0.1:0"]
        cli += [] if on_gpu else ["--workers", "1", "--resources", "GPU=1"]  # one "GPU"
    if command == "stop":
        cli += ["--force"]
    subprocess.run(cli, env=env, check=command == "start", timeout=timeout_s)


def gpu_name() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return name.decode() if isinstance(name, bytes) else name
    except Exception:  # no GPU or no NVML here: the JSON says None
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--flows", type=int, default=4)
    parser.add_argument("--fraction", type=float, default=0.6, help="of the GPU's memory each task takes")
    parser.add_argument("--hold", type=float, default=8.0, help="seconds each task holds it")
    parser.add_argument("--host-cluster", action="store_true", help="start the host cluster; runs join it")
    parser.add_argument("--api", choices=("server", "own-home"), default="server")
    parser.add_argument("--cpu", action="store_true", help="no GPU: NumPy allocations, orchestration only")
    parser.add_argument("--scripted-gpu", action="store_true", help="with --cpu: the tests' scripted GPU")
    parser.add_argument(
        "--cpu-mib", type=int, default=128, help="with --cpu: the 'GPU memory' fractions take"
    )
    parser.add_argument(
        "--target", type=float, default=0.15, help="span may exceed the tasks' own time by this"
    )
    parser.add_argument("--run-timeout", type=float, default=None, help="seconds for all flow runs to end")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a flow run's own process
    args = parser.parse_args()
    if args.flows < 1:
        parser.error(f"--flows {args.flows} must be at least 1")
    if not 0 < args.fraction < 1:
        parser.error(f"--fraction {args.fraction} must be between 0 and 1")
    if args.hold < 0:
        parser.error(f"--hold {args.hold} must not be negative")
    if args.scripted_gpu and not args.cpu:
        parser.error("--scripted-gpu needs --cpu")
    if args.scripted_gpu and args.host_cluster:
        parser.error("--scripted-gpu starts a cluster per flow run; it cannot go with --host-cluster")
    if args.one is not None:
        one_flow_run(args.one, args.fraction, args.hold, not args.cpu, args.cpu_mib, args.scripted_gpu)
        return 0
    if args.run_timeout is None:  # every task after every other, with room for starting clusters
        args.run_timeout = 180 + args.flows * (args.hold + 30)

    logs = Path(tempfile.mkdtemp(prefix="busy-night-"))
    runtime = logs / "runtime"
    runtime.mkdir(mode=0o700)
    env = {
        **os.environ,
        "PREFECT_GPU_DASK_RUNTIME_DIR": str(runtime),  # this run's GPU turns and host cluster only
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    print(f"logs in {logs}", flush=True)
    from benchmarks.servers import prefect_server

    started = time.time()
    try:
        if args.host_cluster:
            began = time.time()
            host_cluster("start", env, not args.cpu, timeout_s=300)
            print(f"host cluster started in {time.time() - began:.2f} s", flush=True)
        if args.api == "server":
            (logs / "server-home").mkdir()
            with prefect_server(home=logs / "server-home") as api:
                started = time.time()
                runs = start_flow_runs(args, {**env, "PREFECT_API_URL": api}, logs)
        else:
            started = time.time()
            runs = start_flow_runs(args, env, logs)
        wall_s = time.time() - started
    finally:
        if args.host_cluster:
            try:
                host_cluster("stop", env, not args.cpu, timeout_s=120)
            except subprocess.TimeoutExpired:
                print("host cluster did not stop within 120 s", file=sys.stderr)
    rows = [read_run(run) for run in runs]
    summary = summarize(rows, args, wall_s)
    print_table(rows, summary)
    if args.out:
        result = {
            "benchmark": "busy_night",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "gpu": None if args.cpu else gpu_name(),
            "nproc": os.cpu_count(),
            "argv": sys.argv[1:],
            "summary": summary,
            "flow_runs": rows,
            "logs": str(logs),
        }
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
