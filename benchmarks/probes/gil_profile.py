"""Where the GIL goes, per task run: the runner's worker and flow processes against
Prefect's thread pool, sampled by py-spy while batches of trivial tasks run.

Trivial tasks are GIL-bound: the thread pool runs Prefect's engine in the flow's
process; the runner runs it in the worker's, beside Dask's event loop. py-spy samples
only the thread holding the GIL (``--gil``), so samples / rate / task runs is GIL time
per task run, split here by where it went.

    python benchmarks/probes/gil_profile.py [--tasks 200] [--seconds 10] [--out DIR]

Needs ``py-spy`` on PATH and the right to attach to this process's children.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RATE = 250  # samples a second

# Where a sample's stack says its GIL time went (first match wins).
PARTS = (
    ("Prefect engine", ("run_task_sync", "run_task_async")),
    ("task run set-up (package)", ("run_task_run",)),
    ("Dask: gather results", ("Worker.get_data", "gather")),
    ("Dask: start notices", ("StartNotices", "send_recv_from_rpc")),
    ("Dask: profiler", ("trigger_profile",)),
    ("Dask: heartbeat and monitors", ("heartbeat", "SystemMonitor", "memory_monitor")),
    ("Dask: task state and streams", ("handle_scheduler", "handle_stimulus", "execute", "batched")),
    ("Prefect: events and logs", ("EventsWorker", "APILogWorker", "QueueService", "_QueueServiceBase")),
    ("Prefect: event loop threads", ("EventLoopThread",)),
    ("flow: submitting", ("submit", "TaskSubmitter")),
    ("flow: waiting on futures", ("RecyclableFuture", "PrefectDaskFuture")),
)


def part_of(stack: str) -> str:
    for name, marks in PARTS:
        if any(mark in stack for mark in marks):
            return name
    return "other (event loop, comms)"


def summarise(raw: Path, tasks: int, label: str) -> dict[str, float]:
    """GIL milliseconds per task run by part, from py-spy's raw (collapsed) output."""
    parts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        parts[part_of(stack)] += int(count)
    per_task = {name: samples / RATE / max(tasks, 1) * 1e3 for name, samples in parts.items()}
    total = sum(per_task.values())
    print(f"\n{label}: {tasks} task runs sampled, GIL {total:.2f} ms a task run")
    for name, ms in sorted(per_task.items(), key=lambda item: -item[1]):
        print(f"  {name:34s} {ms:7.3f} ms  {ms / total * 100 if total else 0:5.1f} %")
    return per_task


def spy(pid: int, seconds: float, out: Path, idle: bool = False) -> subprocess.Popen:
    """py-spy on ``pid``: the thread holding the GIL, or (``idle``) every thread, waiting or not."""
    command = [
        "py-spy",
        "record",
        "--pid",
        str(pid),
        "--idle" if idle else "--gil",
        "-r",
        str(RATE),
        "-f",
        "raw",
    ]
    command += ["-d", str(int(seconds)), "-o", str(out)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def batches_while(profilers: list[subprocess.Popen], batch, tasks: int) -> int:
    """Run batches until the profilers stop; returns the task runs they saw."""
    time.sleep(1.0)  # py-spy attaches
    done = 0
    while any(p.poll() is None for p in profilers):
        batch(tasks)
        done += tasks
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200, help="task runs a batch")
    parser.add_argument("--seconds", type=float, default=10.0, help="of sampling per process")
    parser.add_argument("--out", default=".", help="folder for py-spy's raw stacks")
    parser.add_argument("--idle", action="store_true", help="also sample every thread of the runner's worker")
    args = parser.parse_args()
    if args.tasks < 1 or args.seconds < 1:
        parser.error(f"--tasks {args.tasks} and --seconds {args.seconds} must be >= 1")
    if shutil.which("py-spy") is None:
        parser.error("py-spy is not on PATH")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from prefect import flow, task
    from prefect.task_runners import ThreadPoolTaskRunner

    from benchmarks.common import WARM_TASKS, device_name
    from prefect_gpu_dask import GPUDaskTaskRunner
    from prefect_gpu_dask.flow.cluster import GPU_WORKER_THREADS
    from prefect_gpu_dask.nvml import visible_gpu_count

    @task
    def noop(i: int) -> int:
        return i

    def batch(n: int) -> None:
        assert [f.result() for f in noop.map(range(n))] == list(range(n))

    gpu = visible_gpu_count() > 0
    cluster = {"threads_per_worker": GPU_WORKER_THREADS} if gpu else {"n_workers": 1, "threads_per_worker": 4}
    print(f"{device_name()}, {os.cpu_count()} host cores, {time.strftime('%Y-%m-%d')}")

    @flow(task_runner=ThreadPoolTaskRunner(max_workers=16))
    def pool() -> None:
        batch(WARM_TASKS)
        profiler = spy(os.getpid(), args.seconds, out / "pool-flow.txt")
        seen = batches_while([profiler], batch, args.tasks)
        summarise(out / "pool-flow.txt", seen, "thread pool, flow process")

    @flow(task_runner=GPUDaskTaskRunner(cluster_kwargs=cluster, guard="off"))
    def runner() -> None:
        from prefect.context import FlowRunContext

        batch(WARM_TASKS)
        client = FlowRunContext.get().task_runner.client
        (worker_pid,) = client.run(os.getpid).values()
        profilers = [
            spy(worker_pid, args.seconds, out / "runner-worker.txt"),
            spy(os.getpid(), args.seconds, out / "runner-flow.txt"),
        ]
        seen = batches_while(profilers, batch, args.tasks)
        summarise(out / "runner-worker.txt", seen, "runner, worker process")
        summarise(out / "runner-flow.txt", seen, "runner, flow process")
        if args.idle:  # where the worker's threads wait: raw stacks only
            batches_while(
                [spy(worker_pid, args.seconds, out / "runner-worker-idle.txt", idle=True)], batch, args.tasks
            )

    pool()
    runner()


if __name__ == "__main__":
    main()
