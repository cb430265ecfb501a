"""How long a worker thread waits for the scheduler to answer one RPC, the way the
start notice asks it (``worker.recycling._tell_scheduler``), and what that wait depends
on. Dask only, no Prefect: each task holds the GIL for a while (as Prefect's engine
does around the notice), asks, and holds it again.

Variants: the scheduler in the client's process (``LocalCluster``, as the runner's own
local clusters run it) or in a process of its own (``dask scheduler``); the client's
process idle or with one more thread holding the GIL (as the flow's own threads do);
the worker's GIL switch interval at Python's 5 ms or lower.

    python benchmarks/probes/start_notice_rtt.py [tasks] [busy_ms] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import p95  # noqa: E402

THREADS = 8


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def ask_between_work(i: int, busy_ms: float) -> float:
    from distributed import get_worker
    from distributed.utils import sync

    worker = get_worker()
    spin(busy_ms)
    start = time.perf_counter()
    sync(
        worker.loop, worker.scheduler.log_event, topic="probe-start-notice", msg={"i": i}, callback_timeout=30
    )
    rtt = time.perf_counter() - start
    spin(busy_ms)
    return rtt


@contextmanager
def in_process_scheduler() -> Iterator[str]:
    from distributed import LocalCluster

    cluster = LocalCluster(n_workers=1, threads_per_worker=THREADS, dashboard_address=None)
    try:
        yield cluster.scheduler_address
    finally:
        cluster.close(timeout=20)


@contextmanager
def own_process_scheduler() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as work:
        scheduler_file = os.path.join(work, "scheduler.json")
        log = open(os.path.join(work, "log"), "w")
        scheduler = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--dashboard-address",
                ":0",
                "--scheduler-file",
                scheduler_file,
            ],
            stderr=log,
        )
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_worker",
                "--scheduler-file",
                scheduler_file,
                "--nthreads",
                str(THREADS),
                "--nworkers",
                "1",
                "--dashboard-address",
                ":0",
            ],
            stderr=log,
        )
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(scheduler_file):
                if time.monotonic() > deadline or scheduler.poll() is not None:
                    raise RuntimeError(f"the scheduler did not start: {open(log.name).read()[-2000:]}")
                time.sleep(0.1)
            time.sleep(0.2)  # written, and complete
            with open(scheduler_file) as f:
                yield json.load(f)["address"]
        finally:
            for process in (worker, scheduler):
                process.kill()
                process.wait(30)


@contextmanager
def busy_thread(on: bool) -> Iterator[None]:
    stop = threading.Event()

    def hold() -> None:
        while not stop.is_set():
            spin(1.0)

    thread = threading.Thread(target=hold, daemon=True)
    if on:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if on:
            thread.join()


def measure(
    address: str, tasks: int, busy_ms: float, worker_switch_s: float, client_busy: bool
) -> dict[str, Any]:
    from distributed import Client

    with Client(address, timeout=30) as client:
        client.wait_for_workers(1, timeout=60)
        client.run(sys.setswitchinterval, worker_switch_s)
        client.gather(
            client.map(ask_between_work, range(-2 * THREADS, 0), busy_ms=busy_ms, pure=False)
        )  # warm
        with busy_thread(client_busy):
            start = time.perf_counter()
            rtts = client.gather(client.map(ask_between_work, range(tasks), busy_ms=busy_ms, pure=False))
            elapsed = time.perf_counter() - start
        client.run(sys.setswitchinterval, 0.005)
    return {
        "elapsed_s": elapsed,
        "per_task_ms": 1e3 * elapsed / tasks,
        "rtt_median_ms": 1e3 * statistics.median(rtts),
        "rtt_p95_ms": 1e3 * p95(rtts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tasks", type=int, nargs="?", default=1000)
    parser.add_argument("busy_ms", type=float, nargs="?", default=2.0)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for scheduler_name, scheduler in (
        ("client's process", in_process_scheduler),
        ("own process", own_process_scheduler),
    ):
        with scheduler() as address:
            for client_busy in (False, True):
                for switch in (0.005, 0.001):
                    row = {
                        "scheduler": scheduler_name,
                        "client_busy_thread": client_busy,
                        "worker_switch_ms": 1e3 * switch,
                        **measure(address, args.tasks, args.busy_ms, switch, client_busy),
                    }
                    rows.append(row)
                    print(
                        f"{row['scheduler']:>16} | client busy {str(client_busy):>5} | worker switch "
                        f"{row['worker_switch_ms']:.0f} ms | {row['per_task_ms']:6.2f} ms/task | RTT median "
                        f"{row['rtt_median_ms']:6.2f} ms p95 {row['rtt_p95_ms']:6.2f} ms",
                        flush=True,
                    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"tasks": args.tasks, "busy_ms": args.busy_ms, "threads": THREADS, "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
