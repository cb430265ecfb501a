"""Fleet soak: hundreds of flow runs with injected faults against one long-lived cluster,
back to back and then several at once, watching what grows.

    python benchmarks/fleet_soak.py                        # 200 + 200 runs (4 at once), LocalCluster
    python benchmarks/fleet_soak.py --runs 16 --concurrent-runs 16 --sample-every 16
    python benchmarks/fleet_soak.py --cluster cli --spawn  # dask scheduler + dask worker, spawned
    python benchmarks/fleet_soak.py --gpu --cluster cli    # real NVML, CuPy, dask cuda worker

One cluster (``recycle_soak``'s: ``local`` is a ``LocalCluster`` of nanny-managed worker
processes in this process, ``cli`` is ``dask scheduler`` and ``dask worker`` subprocesses;
each worker offers ``GPU=1``; its worker processes, replacements included, fork from a
server that imported Prefect and Dask once, as the runner's own local clusters' and
``--preload-nanny prefect_gpu_dask.worker.nanny`` workers do, or with ``--spawn`` are
spawned) and one ``prefect server start`` on SQLite serve every flow run. ``--runs``
flow runs go one after the other, then ``--concurrent-runs`` go ``--concurrency`` at a
time, each a thread of this process calling the flow, each flow run joining the cluster by
``address`` with ``GPUDaskTaskRunner(oom_retries=1)``.

Each flow run is ``--short-tasks`` short ``gpu`` tasks and, every ``--fault-every``-th run
(by its index, so the schedule is the same every time), one fault, the kinds in turn:

- ``leak``: a ``gpu`` task keeps 512 MiB (scripted, or CuPy with ``--gpu``); the guard
  judges a leak and its worker is recycled. Every task ends Completed.
- ``oom``: a ``gpu`` task fails with a CUDA out-of-memory error on its first attempt only
  (attempts are counted in a file); its one out-of-memory retry completes it. The guard
  must not recycle anything.
- ``hung``: a ``gpu`` task with ``timeout_seconds=2`` blocked in C (``time.sleep(40)``):
  it ends TimedOut and its worker is recycled.
- ``killed``: a ``gpu`` task SIGKILLs its own worker process: it ends Crashed, and its
  nanny starts a new worker.

Checked per run: it ended within ``--run-timeout``; every task run ended as injected
(Completed, TimedOut, Crashed); through a ledger each task body appends to, that each
ran once (the OOM task twice, both attempts under its own task run id) and none was lost;
the flow run's GPU report has exactly the restart its fault asks for (leak, hung) and no
other. After the warm-up (``--warmup`` runs), every ``--sample-every`` runs and at the
end, with no flow run in flight: this process's RSS (as found, and settled: after a full
collection and glibc's ``malloc_trim``, which hands freed memory back), threads and open files; on the
scheduler (through a monitor client of our own, which it counts) its plugins, clients,
tasks, workers and events; and the rows of each table of the server's SQLite database,
per flow run of the window. What grew from the first sample after the warm-up window
to the last one (rows per run: to the last window of the same phase) is checked against
``--growth-limit`` (10 %; this process's settled RSS against
``--rss-growth-limit``, as medians of the later and earlier halves of the samples, against
half of it, where there are four or more: ``rss_halves``; the RSS as found is shown: it
also holds what the allocator keeps of memory freed since the last full collection, and
from the second sample on it follows the collection and trim the sample before made);
distributed's own
subscriptions, which every departed client leaves on the scheduler, are shown, not
checked. With ``--cluster local`` the scheduler
and the nannies live in this process: its figures include theirs.

Prints a table and writes JSON (``--out``, default
``benchmarks/results/<date>-<device>-fleet-soak-<cluster>.json``) with every run, each
sample, the summary and the environment; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import ctypes
import gc
import json
import os
import shutil
import signal
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks.* when run as a script

from benchmarks.recycle_soak import (  # noqa: E402  # imports neither Prefect nor Dask
    SCRIPTED_PROBE,
    SHORT_TASKS,
    WORKER_START_TIMEOUT_S,
    cli_cluster,
    environment,
    leaking_gpu_task,
    ledger_lines,
    ledger_times,
    local_cluster,
    median_p95,
    note_run,
    read_report_restarts,
    restart_row,
    run_with_timeout,
    scheduler_workers,
    short_gpu_task,
)

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

# As in recycle_soak: nothing outside functions may import Prefect or Dask (spawned
# workers re-run this module's top level).

FAULTS = ("leak", "oom", "hung", "killed")
CLEAN = "clean"
HUNG_TIMEOUT_S = 2
HUNG_BLOCK_S = 40.0
OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; scripted by the fleet soak: "
    "the first attempt of its oom task)"
)
# What each task run must end as, and how many times its body runs.
EXPECTED_STATE = {
    "short": "Completed",
    "leak": "Completed",
    "oom": "Completed",
    "hung": "TimedOut",
    "killed": "Crashed",
}
EXPECTED_EXECUTIONS = {"short": 1, "leak": 1, "oom": 2, "hung": 1, "killed": 1}
# The restart a run's GPU report must hold: its reason's first word.
EXPECTED_RESTART = {"leak": "leak", "hung": "hung"}
LATE_REPORT_WAIT_S = 15.0
DB_SETTLE_S = 1.0  # the rows are counted again until one such pause adds none
DB_SETTLE_MAX_S = 20.0
POLL_S = 0.5  # the peak watcher's period
# Tables whose rows per flow run the table shows (every table is in the JSON).
SHOWN_TABLES = (
    "flow_run",
    "flow_run_state",
    "task_run",
    "task_run_state",
    "log",
    "artifact",
    "events",
    "event_resources",
)
# Open things a sample may catch a few of in passing (a concurrent run's connections,
# a heartbeat thread still asleep): they must also grow by more than this many.
COUNT_SLACK = {"fds": 8, "threads": 4, "threads_active": 4}
# Counts that must not grow beyond --growth-limit after the warm-up.
CHECKED_GROWTH = (
    "rss_settled_kib",
    "threads_active",
    "threads",
    "fds",
    "scheduler_plugins",
    "scheduler_worker_plugins",
    "scheduler_clients_not_workers",
    "scheduler_runner_clients",
    "scheduler_tasks",
    "scheduler_workers",
    "scheduler_subscribers_ours",
)
RSS_CHECKED = "rss_settled_kib"  # checked as medians of halves (rss_halves), with its own limit
SHOWN_LEVELS = ("rss_kib", "scheduler_events")  # in the growth table, not checked
WORKERS_BACK_S = 60.0  # how long a sample waits for a restarted worker to register again
# Live GPU-memory tables per flow run depend on timing (task runs ending close together
# share one), so their rows are bounded, not compared: at most one per task run, plus
# the flow-end table, summary and restarts table.
FLOW_END_TABLES = 3


def fault_of(index: int, every: int) -> str:
    """The fault run ``index`` (from 1) injects: every ``every``-th run, the kinds in turn."""
    if every < 1 or index % every:
        return CLEAN
    return FAULTS[(index // every - 1) % len(FAULTS)]


# -- on the workers: the faulty tasks -------------------------------------------------------


def oom_once_task(ledger: str, label: str, attempts: str, on_gpu: bool) -> int:
    """Runs out of GPU memory on its first attempt, succeeds on the next."""
    note_run(ledger, label)
    marks = Path(attempts) / label
    with open(marks, "a") as fh:
        fh.write(f"{os.getpid()}\n")
    if len(marks.read_text().splitlines()) == 1:
        if on_gpu:
            import cupy

            _, total = cupy.cuda.runtime.memGetInfo()
            cupy.empty(total + 2**30, dtype=cupy.uint8)  # cupy's OutOfMemoryError
        raise RuntimeError(OOM_MESSAGE)
    return os.getpid()


def hung_task(ledger: str, label: str) -> int:
    note_run(ledger, label)
    time.sleep(HUNG_BLOCK_S)  # in C: Prefect's own timeout lands only after it
    return os.getpid()


def killing_task(ledger: str, label: str) -> int:
    note_run(ledger, label)
    os.kill(os.getpid(), signal.SIGKILL)
    return os.getpid()  # never reached


def scheduler_counts(dask_scheduler: Any = None) -> dict[str, Any]:
    """On the scheduler: what a flow run could leave behind there."""
    topics = dask_scheduler._broker._topics  # distributed's event broker: no public view of it
    return {
        "scheduler_plugins": len(dask_scheduler.plugins),
        "scheduler_plugin_names": sorted(map(str, dask_scheduler.plugins)),
        "scheduler_worker_plugins": len(dask_scheduler.worker_plugins),
        "scheduler_clients": len(dask_scheduler.clients),
        # Flow runs' runners' clients (none while no flow run is in flight), and every other
        # client that is not a worker's own: the monitor and the scheduler's fire-and-forget.
        # A worker's (``get_client()`` on it: an out-of-memory retry asks the scheduler
        # through it) lives as long as its process.
        "scheduler_runner_clients": sum(c.startswith("PrefectDaskClient-") for c in dask_scheduler.clients),
        "scheduler_clients_not_workers": sum(
            not c.startswith("Client-worker-") for c in dask_scheduler.clients
        ),
        "scheduler_tasks": len(dask_scheduler.tasks),
        "scheduler_workers": len(dask_scheduler.workers),
        "scheduler_event_topics": len(topics),
        "scheduler_events": sum(len(topic.events) for topic in topics.values()),
        "scheduler_subscribers": sum(len(topic.subscribers) for topic in topics.values()),
        # This package's topics; the rest are distributed's own ("print", "warn": every client's).
        "scheduler_subscribers_ours": sum(
            len(topic.subscribers) for name, topic in topics.items() if name.startswith("prefect-gpu-dask")
        ),
        "scheduler_subscribers_by_topic": {
            name: len(topic.subscribers) for name, topic in sorted(topics.items()) if topic.subscribers
        },
    }


# -- in this process: the flow --------------------------------------------------------------

SEEN: dict[int, dict[str, Any]] = {}  # what each flow run's body saw, by run index


def note_seen(index: int, context: Any) -> None:
    """Kept out of the flow's body: a flow defined in a function is pickled by value with
    the globals it names, and other flow runs' threads write to ``SEEN`` meanwhile."""
    SEEN[index] = {"flow_run_id": str(context.flow_run.id), "runner": context.task_runner}


def build_flow(address: str, memory_probe: str | None, on_gpu: bool, short_tasks: int) -> Any:
    """The soak's flow; its tasks wrap this module's functions, which workers import by name."""
    from prefect import flow, task
    from prefect.context import FlowRunContext
    from prefect.futures import wait

    from prefect_gpu_dask import GPUDaskTaskRunner

    short = task(short_gpu_task, name="short", tags=["gpu"])
    faulty = {
        "leak": task(leaking_gpu_task, name="leak-512MiB", tags=["gpu"]),
        "oom": task(oom_once_task, name="oom-once", tags=["gpu"]),
        "hung": task(hung_task, name="hung", tags=["gpu"], timeout_seconds=HUNG_TIMEOUT_S),
        "killed": task(killing_task, name="kills-its-worker", tags=["gpu"]),
    }

    def submit_fault(fault: str, ledger: str, label: str, attempts: str) -> Any:
        if fault == "leak":
            return faulty[fault].submit(ledger, label, on_gpu)
        if fault == "oom":
            return faulty[fault].submit(ledger, label, attempts, on_gpu)
        return faulty[fault].submit(ledger, label)

    runner = GPUDaskTaskRunner(address=address, memory_probe=memory_probe, oom_retries=1)
    fault_after = max(1, short_tasks // 2)

    @flow(name="fleet-soak", task_runner=runner)
    def fleet_run(ledger: str, attempts: str, index: int, fault: str) -> dict[str, Any]:
        note_seen(index, FlowRunContext.get())
        submitted: list[tuple[str, str, Any]] = []
        for i in range(short_tasks):
            label = f"run{index}-short{i}"
            submitted.append(("short", label, short.submit(ledger, label)))
            if fault != CLEAN and i == fault_after - 1:  # some short tasks queue behind it
                label = f"run{index}-{fault}"
                submitted.append((fault, label, submit_fault(fault, ledger, label, attempts)))
        wait([future for _, _, future in submitted])
        tasks = []
        for kind, label, future in submitted:
            state = future.state
            tasks.append(
                {
                    "kind": kind,
                    "label": label,
                    "task_run_id": str(future.task_run_id),
                    "state": state.name,
                    "message": None if state.is_completed() else state.message,
                }
            )
        return {"tasks": tasks}

    return fleet_run


@dataclass
class RunRow:
    """One flow run of the soak, as the JSON keeps it."""

    index: int
    phase: str  # sequential | concurrent
    fault: str
    started_s: float | None = None  # from the soak's start
    ended: bool = False
    error: str | None = None
    wall_s: float | None = None
    flow_run_id: str | None = None
    tasks: list[dict[str, Any]] = field(default_factory=list)
    report_restarts: int | None = None
    restart_late_s: float | None = None
    restarts: list[dict[str, Any]] = field(default_factory=list)
    runner_restarts: int | None = None
    workers_after: int | None = None
    problems: list[str] = field(default_factory=list)


@dataclass
class Sample:
    """What this process, the scheduler and the database held after ``after_runs`` runs."""

    after_runs: int
    phase: str
    at_s: float
    window_runs: int  # runs since the previous sample
    rss_kib: int  # as found
    threads_active: int  # threading.active_count()
    threads: int  # /proc/self/status Threads: Python's and every native one
    fds: int
    peak: dict[str, int]  # the highest of each of the three since the previous sample
    scheduler: dict[str, Any]
    db_rows: dict[str, int] | None = None
    db_settle_s: float | None = None
    workers_back_s: float | None = None  # waited for the scheduler to have every worker
    rows_per_run: dict[str, float] | None = None  # rows added per flow run in the window
    python_heap_kib: int | None = None  # what tracemalloc traces (--trace-python-heap)
    # glibc's heap (mallinfo2): bytes handed out and not yet freed, by any library, and
    # bytes freed but kept by the allocator; None where the C library is not glibc.
    malloc_in_use_kib: int | None = None
    malloc_free_kib: int | None = None
    fd_kinds: dict[str, int] | None = None  # this process's open files by kind: socket, pipe, ...
    rss_settled_kib: int | None = None  # after a full collection and malloc_trim (settled_rss_kib)


class PythonHeap:
    """Python's own allocations (``tracemalloc``): their total at each sample, and where
    the ones made after the warm-up and still held at the end were made. Tracing costs
    memory and time: RSS figures of a traced soak are not comparable with an untraced one."""

    def __init__(self, frames: int):
        import tracemalloc

        tracemalloc.start(frames)
        self._mark: Any = None

    @staticmethod
    def traced_kib() -> int:
        import tracemalloc

        return tracemalloc.get_traced_memory()[0] // 1024

    def mark(self) -> None:
        import tracemalloc

        gc.collect()
        self._mark = tracemalloc.take_snapshot()

    def growth(self, top: int = 10) -> list[dict[str, Any]]:
        """The ``top`` call sites by bytes gained since ``mark``, deepest frame last."""
        import tracemalloc

        if self._mark is None:
            return []
        gc.collect()
        mine = [tracemalloc.Filter(False, tracemalloc.__file__)]
        now = tracemalloc.take_snapshot().filter_traces(mine)
        stats = now.compare_to(self._mark.filter_traces(mine), "traceback")
        return [
            {"kib": round(s.size_diff / 1024, 1), "blocks": s.count_diff, "traceback": s.traceback.format()}
            for s in stats[:top]
        ]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            *("arena", "ordblks", "smblks", "hblks", "hblkhd"),
            *("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"),
        )
    ]


def malloc_status() -> dict[str, int | None]:
    """What glibc's allocator holds: in use (``uordblks`` + ``hblkhd``) and free but kept
    (``fordblks``). Python's heap, C extensions', OpenSSL's and Rust's all come from it."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return {"malloc_in_use_kib": None, "malloc_free_kib": None}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    in_use = info.uordblks + info.hblkhd
    return {"malloc_in_use_kib": in_use // 1024, "malloc_free_kib": info.fordblks // 1024}


def settled_rss_kib() -> int:
    """This process's RSS once its garbage is collected and glibc's allocator has handed
    back what it keeps of freed memory (``malloc_trim``; only the collection where the C
    library is not glibc). Freed memory the allocator keeps comes and goes with Python's
    full collections, a cycle as long as a short soak; what is left after both is what
    the process still holds."""
    gc.collect()
    with contextlib.suppress(AttributeError, OSError):  # not glibc
        ctypes.CDLL(None).malloc_trim(0)
    return process_status()["rss_kib"]


def fd_kinds() -> dict[str, int]:
    """This process's open files by what they are: ``socket``, ``pipe``, ``anon_inode``
    (epoll, eventfd), ``dev`` or ``file``."""
    kinds: Counter[str] = Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        kind = target.split(":", 1)[0] if ":" in target and not target.startswith("/") else "file"
        kinds["dev" if target.startswith("/dev/") else kind] += 1
    return dict(sorted(kinds.items()))


def process_status() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "Threads"):
                fields[name] = int(value.split()[0])
    return {
        "rss_kib": fields["VmRSS"],
        "threads_active": threading.active_count(),
        "threads": fields["Threads"],
        "fds": len(os.listdir("/proc/self/fd")),
    }


class PeakWatch:
    """A thread reading ``process_status`` every ``POLL_S``: the peaks between samples
    (flow runs in flight included). Its own thread is in every figure."""

    def __init__(self) -> None:
        self._peak: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-soak-peaks", daemon=True)

    def __enter__(self) -> PeakWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.note(process_status())

    def note(self, status: dict[str, int]) -> None:
        with self._lock:
            for name, value in status.items():
                self._peak[name] = max(self._peak.get(name, 0), value)

    def take(self) -> dict[str, int]:
        with self._lock:
            peak, self._peak = self._peak, {}
        return peak


def table_rows(database: Path) -> dict[str, int]:
    """Rows per table of the server's SQLite database, read-only beside the server."""
    uri = f"file:{database}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=30)) as db:
        names = [
            row[0]
            for row in db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            )
        ]
        return {name: db.execute(f'SELECT COUNT(*) FROM "{name}"').fetchone()[0] for name in sorted(names)}


def settled_rows(database: Path) -> tuple[dict[str, int], float]:
    """The rows once the server has stored what it was sent (events and logs arrive in
    batches): counted again after each pause until one adds none."""
    started = time.perf_counter()
    rows = table_rows(database)
    while time.perf_counter() - started < DB_SETTLE_MAX_S:
        time.sleep(DB_SETTLE_S)
        again = table_rows(database)
        if again == rows:
            break
        rows = again
    return rows, time.perf_counter() - started


class Soak:
    """The two phases of flow runs, their checks and the samples between them."""

    def __init__(
        self,
        args: argparse.Namespace,
        address: str,
        work: Path,
        monitor: Any,
        database: Path | None,
        peaks: PeakWatch,
    ):
        self.args = args
        self.address = address
        self.ledger = work / "ledger.txt"
        self.attempts = work / "attempts"
        self.attempts.mkdir(exist_ok=True)
        self.monitor = monitor
        self.database = database
        self.peaks = peaks
        self.rows: list[RunRow] = []
        self.samples: list[Sample] = []
        self.started = time.perf_counter()
        self.stop = threading.Event()  # a run hung: start no more
        self.total = args.runs + args.concurrent_runs
        self.heap = PythonHeap(args.trace_python_heap) if args.trace_python_heap else None
        self.flow = build_flow(address, None if args.gpu else SCRIPTED_PROBE, args.gpu, args.short_tasks)
        self._print_lock = threading.Lock()

    # -- runs ---------------------------------------------------------------------
    def run_one(self, index: int, phase: str) -> RunRow:
        row = RunRow(index=index, phase=phase, fault=fault_of(index, self.args.fault_every))
        row.started_s = round(time.perf_counter() - self.started, 2)
        ended, value, error, wall_s = run_with_timeout(
            lambda: self.flow(str(self.ledger), str(self.attempts), index, row.fault), self.args.run_timeout
        )
        row.ended, row.wall_s = ended, round(wall_s, 3)
        seen = SEEN.pop(index, {})
        row.flow_run_id = seen.get("flow_run_id")
        if not ended:
            row.error = f"hung: no end after {self.args.run_timeout:g} s"
            row.problems.append(row.error)
            self.stop.set()
            self.say(
                f"run {index}/{self.total} {row.fault}: HUNG after {self.args.run_timeout:g} s; stopping"
            )
            return row
        if error is not None:
            row.error = f"{type(error).__name__}: {error}"
            row.problems.append(f"the flow run raised {row.error}")
        if isinstance(value, dict):
            row.tasks = value["tasks"]
        if row.flow_run_id is not None:
            self.read_restarts(row)
        runner = seen.get("runner")
        row.runner_restarts = len(runner.restarts) if runner is not None else None
        row.workers_after = len(scheduler_workers(self.monitor))
        row.problems += state_problems(row, self.args.short_tasks)
        self.say(run_line(row, self.total))
        return row

    def read_restarts(self, row: RunRow) -> None:
        expected = 1 if row.fault in EXPECTED_RESTART else 0
        report, _ = read_report_restarts(row.flow_run_id)
        if len(report.restarts) < expected:  # late, or never there?
            waited = time.perf_counter()
            while time.perf_counter() - waited < LATE_REPORT_WAIT_S:
                time.sleep(0.5)
                report, _ = read_report_restarts(row.flow_run_id)
                if len(report.restarts) >= expected:
                    row.restart_late_s = round(time.perf_counter() - waited, 2)
                    break
        row.report_restarts = len(report.restarts)
        row.restarts = [restart_row(r) for r in report.restarts]

    def say(self, line: str) -> None:
        with self._print_lock:
            print(line, flush=True)

    def sequential(self, first: int, last: int) -> None:
        for index in range(first, last + 1):
            if self.stop.is_set():
                return
            self.rows.append(self.run_one(index, "sequential"))
            self.maybe_sample(index, "sequential")

    def concurrent(self, first: int, last: int) -> None:
        """``--concurrency`` lanes take runs in order; they all finish before a sample,
        so every sample sees no flow run in flight."""
        start = first
        while start <= last and not self.stop.is_set():
            end = min(last, self.next_sample_at(start))
            indices = iter(range(start, end + 1))
            lock = threading.Lock()
            lanes = [
                # Each in this thread's context: the Prefect settings that point at the server.
                threading.Thread(
                    target=contextvars.copy_context().run,
                    args=(self.lane, indices, lock),
                    name=f"fleet-lane-{n}",
                )
                for n in range(self.args.concurrency)
            ]
            for thread in lanes:
                thread.start()
            for thread in lanes:
                thread.join()
            self.maybe_sample(end, "concurrent")
            start = end + 1

    def lane(self, indices: Iterator[int], lock: threading.Lock) -> None:
        while not self.stop.is_set():
            with lock:
                index = next(indices, None)
            if index is None:
                return
            row = self.run_one(index, "concurrent")
            with lock:
                self.rows.append(row)

    def next_sample_at(self, index: int) -> int:
        """The first run index at or after ``index`` followed by a sample."""
        at = index
        while not self.sample_due(at):
            at += 1
        return at

    def sample_due(self, index: int) -> bool:
        return (
            index == self.args.warmup
            or index % self.args.sample_every == 0
            or index in (self.args.runs, self.total)
        )

    # -- samples ------------------------------------------------------------------
    def maybe_sample(self, index: int, phase: str) -> None:
        if not self.sample_due(index) or self.stop.is_set():
            return
        self.samples.append(self.sample(index, phase))
        self.say(sample_line(self.samples[-1]))

    def sample(self, after_runs: int, phase: str) -> Sample:
        previous = self.samples[-1] if self.samples else None
        rows, settle_s = (None, None)
        if self.database is not None:
            rows, settle_s = settled_rows(self.database)  # first: the process settles meanwhile
        waited = time.perf_counter()
        with contextlib.suppress(TimeoutError):  # a worker killed last may still be starting
            self.monitor.wait_for_workers(self.args.workers, timeout=WORKERS_BACK_S)
        workers_back_s = time.perf_counter() - waited
        status = process_status()
        self.peaks.note(status)
        window = after_runs - (previous.after_runs if previous else 0)
        sample = Sample(
            after_runs=after_runs,
            phase=phase,
            at_s=round(time.perf_counter() - self.started, 1),
            window_runs=window,
            peak=self.peaks.take(),
            scheduler=self.monitor.run_on_scheduler(scheduler_counts),
            db_rows=rows,
            db_settle_s=None if settle_s is None else round(settle_s, 1),
            workers_back_s=round(workers_back_s, 1),
            python_heap_kib=self.heap.traced_kib() if self.heap else None,
            **malloc_status(),
            fd_kinds=fd_kinds(),
            **status,
        )
        sample.rss_settled_kib = settled_rss_kib()  # last: it frees what the figures above saw
        if self.heap and after_runs == self.args.warmup:
            self.heap.mark()
        if rows is not None and previous is not None and previous.db_rows is not None and window:
            sample.rows_per_run = {
                name: round((count - previous.db_rows.get(name, 0)) / window, 2)
                for name, count in rows.items()
            }
        return sample


def state_problems(row: RunRow, short_tasks: int) -> list[str]:
    """What the flow run's task runs ended as, against what was injected."""
    problems = []
    kinds = Counter(task["kind"] for task in row.tasks)
    wanted = Counter({"short": short_tasks, **({row.fault: 1} if row.fault != CLEAN else {})})
    if row.ended and row.error is None and kinds != wanted:
        problems.append(f"submitted {dict(kinds)}, expected {dict(wanted)}")
    for task in row.tasks:
        if task["state"] != EXPECTED_STATE[task["kind"]]:
            problems.append(
                f"{task['label']} ended {task['state']} ({task['message']}), "
                f"expected {EXPECTED_STATE[task['kind']]}"
            )
    reasons = [str(r["reason"]).split(":")[0] for r in row.restarts if r["outcome"] != "lost"]
    expected = [EXPECTED_RESTART[row.fault]] if row.fault in EXPECTED_RESTART else []
    if reasons != expected or len(row.restarts) != len(expected):
        problems.append(
            f"restarts in its GPU report: {[(r['reason'], r['outcome']) for r in row.restarts]}, "
            f"expected {expected}"
        )
    if row.runner_restarts is not None and row.runner_restarts != row.report_restarts:
        problems.append(f"the runner has {row.runner_restarts} restarts, the report {row.report_restarts}")
    return problems


def ledger_problems(rows: list[RunRow], ledger: Path, attempts: Path) -> dict[str, Any]:
    """Each task body ran as often as its kind says (the ledger) and under its own task run id."""
    lines = ledger_lines(ledger)
    executions = Counter(task_run_id for task_run_id, _, _ in lines)
    pids: dict[str, list[int]] = {}
    for task_run_id, _, pid in lines:
        pids.setdefault(task_run_id, []).append(pid)
    started_at = ledger_times(ledger) if ledger.exists() else {}
    labels_of: dict[str, set[str]] = {}
    for task_run_id, label, _ in lines:
        labels_of.setdefault(task_run_id, set()).add(label)
    twice, lost, submitted = [], [], 0
    for row in rows:
        for task in row.tasks:
            submitted += 1
            ran = executions.get(task["task_run_id"], 0)
            task["executions"] = ran
            task["pids"] = pids.get(task["task_run_id"], [])
            task["started_at"] = started_at.get(task["task_run_id"], [])
            wanted = EXPECTED_EXECUTIONS[task["kind"]]
            if ran == 0:
                lost.append(task["label"])
                row.problems.append(f"{task['label']} never ran (not in the ledger)")
            elif ran > wanted:
                twice.append(task["label"])
                row.problems.append(f"{task['label']} ran {ran} times, expected {wanted}")
            elif ran < wanted:
                row.problems.append(f"{task['label']} ran {ran} times, expected {wanted}")
            if labels_of.get(task["task_run_id"], {task["label"]}) != {task["label"]}:
                row.problems.append(f"{task['label']}'s task run id ran {labels_of[task['task_run_id']]}")
            if task["kind"] == "oom":
                marks = attempts / task["label"]
                task["attempts"] = len(marks.read_text().splitlines()) if marks.exists() else 0
                if task["attempts"] != 2:
                    row.problems.append(f"{task['label']} made {task['attempts']} attempts, expected 2")
    known = {task["task_run_id"] for row in rows for task in row.tasks}
    stray = sorted({label for task_run_id, label, _ in lines if task_run_id not in known})
    return {
        "tasks_submitted": submitted,
        "tasks_run_too_often": twice,
        "tasks_lost": lost,
        "ledger_lines": len(lines),
        # Lines of task runs no finished flow run reported (e.g. a hung run's).
        "ledger_unreported": stray,
    }


def run_line(row: RunRow, total: int) -> str:
    restarts = ", ".join(f"{r['reason'].split(':')[0]} {r['outcome']}" for r in row.restarts) or "none"
    states = Counter(task["state"] for task in row.tasks)
    problems = f"  PROBLEMS: {'; '.join(row.problems)}" if row.problems else ""
    return (
        f"run {row.index}/{total} {row.phase[:3]} {row.fault:<6} wall {row.wall_s:6.2f} s"
        f"  states {dict(states)}  restarts {restarts}  workers {row.workers_after}{problems}"
    )


def sample_line(s: Sample) -> str:
    sched = s.scheduler
    rows = ""
    if s.rows_per_run:
        rows = "  rows/run " + " ".join(f"{t}={s.rows_per_run.get(t, 0):g}" for t in SHOWN_TABLES)
    return (
        f"sample after {s.after_runs} runs: rss {s.rss_kib / 1024:.0f} MiB"
        + (f" (settled {s.rss_settled_kib / 1024:.0f} MiB)" if s.rss_settled_kib is not None else "")
        + f" threads {s.threads_active}/"
        f"{s.threads} fds {s.fds}  scheduler plugins {sched['scheduler_plugins']} clients "
        f"{sched['scheduler_clients']} tasks {sched['scheduler_tasks']} workers {sched['scheduler_workers']}"
        + rows
        + (f"  python heap {s.python_heap_kib / 1024:.1f} MiB" if s.python_heap_kib is not None else "")
        + (
            f"  malloc in use {s.malloc_in_use_kib / 1024:.0f} MiB free {s.malloc_free_kib / 1024:.0f} MiB"
            if s.malloc_in_use_kib is not None and s.malloc_free_kib is not None
            else ""
        )
    )


# -- the summary ---------------------------------------------------------------------------


def flat(sample: Sample) -> dict[str, float]:
    values: dict[str, float] = {
        "rss_kib": sample.rss_kib,
        "threads_active": sample.threads_active,
        "threads": sample.threads,
        "fds": sample.fds,
    }
    values |= {k: v for k, v in sample.scheduler.items() if isinstance(v, int)}
    for name in ("rss_settled_kib", "malloc_in_use_kib", "malloc_free_kib"):
        if getattr(sample, name) is not None:
            values[name] = getattr(sample, name)
    values |= {f"fds.{kind}": n for kind, n in (sample.fd_kinds or {}).items()}
    if sample.rows_per_run is not None:
        values |= {f"rows_per_run.{name}": value for name, value in sample.rows_per_run.items()}
    return values


def growth(samples: list[Sample], warmup: int, limit: float, rss_limit: float) -> dict[str, Any]:
    """Last sample against the first after the warm-up window, figure by figure.

    A level (RSS, threads, ...) is compared at the end of both windows; rows per run over
    each window, the last one of the first window's phase. A figure that was 0 may not
    grow at all; RSS has a limit of its own; open files and threads must also grow by
    more than ``COUNT_SLACK``. Artifact rows per
    run depend on timing, so they are held to a ceiling instead: one table per task run
    plus ``FLOW_END_TABLES``, in every window.
    The settled RSS still moves with what a collection leaves, so with four samples or
    more it is checked as the median of the later half against
    the median of the earlier half (``rss_halves``), against half the limit: the two
    medians sit about a quarter and three quarters of the way, so a steady leak moves
    them apart by about half its growth; one sample on a crest or in a trough does not.
    """
    after = [s for s in samples if s.after_runs > warmup]
    if len(after) < 2:
        return {"first": None, "last": None, "figures": {}, "exceeded": [], "rss_halves": None}
    first, last = after[0], after[-1]
    a, b = flat(first), flat(last)
    # Rows per run depend on the window's runs: a phase's own mix of faults and
    # concurrency, and a short window's share of faults. Compared within the first
    # sample's phase; later phases' windows are only held to the artifact ceiling.
    same_phase = [s for s in after if s.phase == first.phase][-1]
    rows_then = {k: v for k, v in flat(same_phase).items() if k.startswith("rows_per_run.")}
    b = {k: v for k, v in b.items() if not k.startswith("rows_per_run.")} | rows_then
    figures, exceeded = {}, []
    for name in sorted(set(a) & set(b)):
        change = b[name] - a[name]
        fraction = change / a[name] if a[name] else (0.0 if change <= 0 else float("inf"))
        figures[name] = {"first": a[name], "last": b[name], "growth": round(fraction, 4)}
        checked = name in CHECKED_GROWTH or (
            name.startswith("rows_per_run.") and name != "rows_per_run.artifact"
        )
        beyond_slack = change > COUNT_SLACK.get(name, 0)
        if checked and beyond_slack and fraction > (rss_limit if name == RSS_CHECKED else limit):
            exceeded.append(name)
    for sample in after:
        rows = sample.rows_per_run or {}
        if rows.get("artifact", 0) > rows.get("task_run", 0) + FLOW_END_TABLES:
            exceeded.append("rows_per_run.artifact")  # more tables than task runs: a leak of them
            break
    halves = rss_halves(after)
    if halves is not None and RSS_CHECKED in figures:
        exceeded = [name for name in exceeded if name != RSS_CHECKED]
        if halves["growth"] > rss_limit / 2:
            exceeded.append(RSS_CHECKED)
    return {
        "first": first.after_runs,
        "last": last.after_runs,
        "rows_last": same_phase.after_runs,
        "figures": figures,
        "exceeded": exceeded,
        "rss_halves": halves,
    }


def rss_halves(after_warmup: list[Sample]) -> dict[str, Any] | None:
    """Median settled RSS of the later half of the samples against the earlier half's (KiB)."""
    if len(after_warmup) < 4 or any(s.rss_settled_kib is None for s in after_warmup):
        return None
    middle = len(after_warmup) // 2
    earlier = statistics.median(s.rss_settled_kib for s in after_warmup[:middle])
    later = statistics.median(s.rss_settled_kib for s in after_warmup[-middle:])
    return {
        "earlier_runs": [s.after_runs for s in after_warmup[:middle]],
        "later_runs": [s.after_runs for s in after_warmup[-middle:]],
        "earlier_median_kib": earlier,
        "later_median_kib": later,
        "growth": round((later - earlier) / earlier, 4),
    }


def wall_by_kind(rows: list[RunRow]) -> dict[str, dict[str, Any]]:
    """Median and p95 of flow-run wall times, per phase and fault (run 1 apart: cold workers)."""
    out: dict[str, dict[str, Any]] = {}
    for phase in ("sequential", "concurrent"):
        for kind in (CLEAN, *FAULTS):
            walls = [
                r.wall_s for r in rows if r.ended and r.phase == phase and r.fault == kind and r.index > 1
            ]
            out[f"{phase}.{kind}"] = median_p95(walls)
    return out


def summarize(soak: Soak) -> dict[str, Any]:
    rows = sorted(soak.rows, key=lambda r: r.index)
    ledger = ledger_problems(rows, soak.ledger, soak.attempts)
    ended = [r for r in rows if r.ended]
    states = Counter((task["kind"], task["state"]) for r in rows for task in r.tasks)
    phases = {}
    for phase in ("sequential", "concurrent"):
        mine = [r for r in rows if r.phase == phase]
        started = [r.started_s for r in mine if r.started_s is not None]
        span = max((r.started_s + r.wall_s for r in mine if r.wall_s is not None), default=0) - min(
            started, default=0
        )
        phases[phase] = {"runs": len(mine), "span_s": round(span, 1), "runs_per_min": None}
        if span > 0:
            phases[phase]["runs_per_min"] = round(60 * len(mine) / span, 2)
    return {
        "runs": soak.total,
        "runs_started": len(rows),
        "runs_ended": len(ended),
        "runs_hung": sum(not r.ended for r in rows),
        "runs_with_problems": sum(bool(r.problems) for r in rows),
        "faults": dict(Counter(r.fault for r in rows)),
        "task_states": {f"{kind} {state}": n for (kind, state), n in sorted(states.items())},
        "first_run_wall_s": rows[0].wall_s if rows and rows[0].index == 1 else None,
        "wall": wall_by_kind(rows),
        "phases": phases,
        "restarts": sum(len(r.restarts) for r in rows),
        "restarts_lost": sum(x["outcome"] == "lost" for r in rows for x in r.restarts),
        "serving": median_p95([x["serving_s"] for r in rows for x in r.restarts if x["outcome"] != "lost"]),
        "restarts_late": sum(r.restart_late_s is not None for r in rows),
        # After each run (a killed or recycled worker may be on its way back), and at each sample.
        "workers_min_after_run": min(
            (r.workers_after for r in ended if r.workers_after is not None), default=None
        ),
        "workers_min_at_sample": min((x.scheduler["scheduler_workers"] for x in soak.samples), default=None),
        **ledger,
        "growth": growth(soak.samples, soak.args.warmup, soak.args.growth_limit, soak.args.rss_growth_limit),
        "growth_limit": soak.args.growth_limit,
        "rss_growth_limit": soak.args.rss_growth_limit,
    }


def failed_checks(s: dict[str, Any], workers: int) -> list[str]:
    checks = {
        "a run hung": s["runs_hung"] > 0,
        "not every run ran": s["runs_started"] < s["runs"],
        "a run ended otherwise than injected": s["runs_with_problems"] > 0,
        "a task ran more often than its kind": bool(s["tasks_run_too_often"]),
        "a task was lost": bool(s["tasks_lost"]),
        "a recycle lost its worker": s["restarts_lost"] > 0,
        "the scheduler lost a worker": s["workers_min_at_sample"] is not None
        and s["workers_min_at_sample"] < workers,
        f"grew more than {s['growth_limit']:.0%} after the warm-up: "
        + ", ".join(s["growth"]["exceeded"]): bool(s["growth"]["exceeded"]),
    }
    return [name for name, failed in checks.items() if failed]


def print_tables(s: dict[str, Any], samples: list[Sample], failures: list[str], rows: list[RunRow]) -> None:
    print()
    header = (
        f"{'after':>5} {'phase':<10} {'RSS MiB':>7} {'settled':>7} {'thr':>4} {'/proc':>5} {'fds':>4} "
        f"{'peak thr':>8} {'peak fds':>8} {'plugins':>7} {'wplug':>5} {'clients run/all':>15} {'tasks':>5} "
        f"{'workers':>7} {'subs ours/all':>13}"
    )
    print(header)
    for x in samples:
        sc = x.scheduler
        print(
            f"{x.after_runs:>5} {x.phase:<10} {x.rss_kib / 1024:>7.0f} "
            f"{'-' if x.rss_settled_kib is None else f'{x.rss_settled_kib / 1024:.0f}':>7} "
            f"{x.threads_active:>4} {x.threads:>5} "
            f"{x.fds:>4} {x.peak.get('threads', 0):>8} {x.peak.get('fds', 0):>8} "
            f"{sc['scheduler_plugins']:>7} {sc['scheduler_worker_plugins']:>5} "
            f"{str(sc['scheduler_runner_clients']) + '/' + str(sc['scheduler_clients']):>15} "
            f"{sc['scheduler_tasks']:>5} {sc['scheduler_workers']:>7} "
            f"{str(sc['scheduler_subscribers_ours']) + '/' + str(sc['scheduler_subscribers']):>13}"
        )
    if any(x.rows_per_run for x in samples):
        print()
        print(f"{'rows added per flow run':<24}" + "".join(f"{t:>16}" for t in SHOWN_TABLES))
        for x in samples:
            if x.rows_per_run:
                window = f"runs {x.after_runs - x.window_runs + 1}-{x.after_runs}"
                print(f"{window:<24}" + "".join(f"{x.rows_per_run.get(t, 0):>16g}" for t in SHOWN_TABLES))
    print()
    print(f"{'flow-run wall s':<22}{'runs':>6}{'median':>9}{'p95':>9}{'max':>9}")
    for name, spread in s["wall"].items():
        if spread["runs"]:
            print(
                f"{name:<22}{spread['runs']:>6}{spread['median_s']:>9.2f}{spread['p95_s']:>9.2f}"
                f"{spread['max_s']:>9.2f}"
            )
    g = s["growth"]
    if g["figures"]:
        print()
        print(
            f"growth, sample after run {g['first']} -> after run {g['last']} (limit {s['growth_limit']:.0%};"
            f" rows per run -> the window ending at run {g.get('rows_last', g['last'])}, the same phase):"
        )
        halves = g.get("rss_halves")
        for name, fig in g["figures"].items():
            if name in CHECKED_GROWTH or name.split(".", 1)[-1] in SHOWN_TABLES or name in SHOWN_LEVELS:
                mark = "  EXCEEDED" if name in g["exceeded"] else ""
                if name == RSS_CHECKED and halves:
                    mark = "  (shown; checked as medians, below)" + mark
                print(f"  {name:<34} {fig['first']:>10g} -> {fig['last']:>10g}  {fig['growth']:+.1%}{mark}")
        if halves:
            mark = "  EXCEEDED" if RSS_CHECKED in g["exceeded"] else ""
            print(
                f"  {RSS_CHECKED}, median of runs {halves['earlier_runs']} -> of runs {halves['later_runs']}:"
                f" {halves['earlier_median_kib']:g} -> {halves['later_median_kib']:g}"
                f"  {halves['growth']:+.1%} (limit {s['rss_growth_limit'] / 2:.0%}){mark}"
            )
    serving = s["serving"]
    print()
    lines = [
        ("first run (cold workers)", f"{s['first_run_wall_s']} s"),
        (
            "phases: runs, span, runs/min",
            "; ".join(
                f"{k} {v['runs']}, {v['span_s']} s, {v['runs_per_min']}" for k, v in s["phases"].items()
            ),
        ),
        ("faults injected", str(s["faults"])),
        ("task states (kind state: n)", str(s["task_states"])),
        (
            "restarts: all / lost / late in report",
            f"{s['restarts']} / {s['restarts_lost']} / {s['restarts_late']}",
        ),
        (
            "recycle serving_s: median / p95 / max",
            " / ".join(
                "-" if serving[k] is None else f"{serving[k]:.2f}" for k in ("median_s", "p95_s", "max_s")
            ),
        ),
        (
            "runs ended / hung / with problems",
            f"{s['runs_ended']} / {s['runs_hung']} / {s['runs_with_problems']}",
        ),
        (
            "tasks: submitted / ran too often / lost",
            f"{s['tasks_submitted']} / {len(s['tasks_run_too_often'])} / {len(s['tasks_lost'])}",
        ),
        (
            "worker count, min after a run / at a sample",
            f"{s['workers_min_after_run']} / {s['workers_min_at_sample']}",
        ),
    ]
    width = max(len(name) for name, _ in lines)
    for name, value in lines:
        print(f"{name:<{width}}  {value}")
    for row in rows:
        for problem in row.problems:
            print(f"  run {row.index} ({row.phase}, {row.fault}): {problem}")
    print("checks: " + ("all passed" if not failures else "FAILED: " + "; ".join(failures)))


# -- the whole soak ------------------------------------------------------------------------


@contextlib.contextmanager
def fleet(
    args: argparse.Namespace, work: Path, server: bool = True
) -> Iterator[tuple[str, Any, Path | None]]:
    """The Prefect server (``server``: else the one in the settings already), the cluster
    and a monitor client: (scheduler address, monitor, the server's SQLite file or None)."""
    from distributed import Client

    from benchmarks.servers import using_prefect_server

    # The scripted GPUs' host-wide turns stay this soak's own.
    os.environ.setdefault("PREFECT_GPU_DASK_LOCK_DIR", str(work / "gpu-turns"))
    with contextlib.ExitStack() as stack:
        database = None
        if server:
            home = work / "prefect-home"
            home.mkdir()
            stack.enter_context(using_prefect_server(home=home))
            database = home / "prefect.db"
        if args.cluster == "local":
            address = stack.enter_context(local_cluster(args.workers, args.gpu, args.fork))
        else:
            address = stack.enter_context(cli_cluster(args.workers, args.gpu, work, args.fork))
        monitor = stack.enter_context(Client(address, timeout=WORKER_START_TIMEOUT_S, set_as_default=False))
        monitor.wait_for_workers(args.workers, timeout=WORKER_START_TIMEOUT_S)
        yield address, monitor, database


def soak(
    args: argparse.Namespace, address: str, work: Path, monitor: Any, database: Path | None
) -> tuple[Soak, dict[str, Any], list[str]]:
    """Both phases against a running cluster and server; the soak, its summary and the
    checks that failed."""
    with PeakWatch() as peaks:
        run = Soak(args, address, work, monitor, database, peaks)
        try:
            run.sequential(1, args.runs)
            run.concurrent(args.runs + 1, run.total)
        except KeyboardInterrupt:
            print("interrupted: summarizing the runs so far", flush=True)
    summary = summarize(run)
    return run, summary, failed_checks(summary, args.workers)


def default_out(env: dict[str, Any], cluster: str) -> Path:
    slug = env["device"].replace(" ", "-").replace("(", "").replace(")", "").lower()
    return ROOT / "benchmarks" / "results" / f"{date.today().isoformat()}-{slug}-fleet-soak-{cluster}.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="flow runs back to back (default 200)")
    parser.add_argument("--concurrent-runs", type=int, default=200, help="then these, --concurrency at once")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--fault-every", type=int, default=4, help="every Nth run injects a fault (default 4)"
    )
    parser.add_argument("--warmup", type=int, default=10, help="runs before the first sample (default 10)")
    parser.add_argument("--sample-every", type=int, default=50, help="runs between samples (default 50)")
    parser.add_argument("--growth-limit", type=float, default=0.10, help="allowed growth after the warm-up")
    parser.add_argument("--rss-growth-limit", type=float, default=0.10, help="and for this process's RSS")
    parser.add_argument(
        "--short-tasks", type=int, default=SHORT_TASKS, help=f"per run (default {SHORT_TASKS})"
    )
    parser.add_argument("--cluster", choices=("local", "cli"), default="local")
    parser.add_argument(
        "--spawn",
        dest="fork",
        action="store_false",
        help="spawn worker processes (default: fork them from a server that imported Prefect and Dask once)",
    )
    parser.add_argument("--gpu", action="store_true", help="real NVML and CuPy instead of the scripted GPU")
    parser.add_argument("--workers", type=int, default=None, help="workers (default 2; --gpu: every GPU)")
    parser.add_argument("--run-timeout", type=float, default=180.0, help="seconds a flow run may take")
    parser.add_argument(
        "--trace-python-heap",
        type=int,
        default=0,
        metavar="FRAMES",
        help="trace Python's allocations (tracemalloc, FRAMES deep): their total per sample, and "
        "what grew from the warm-up to the end",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if min(args.runs, args.concurrent_runs) < 0 or args.concurrency < 1 or args.run_timeout <= 0:
        parser.error("--runs and --concurrent-runs must be >= 0, --concurrency >= 1, --run-timeout > 0")
    if args.sample_every < 1 or args.warmup < 0 or args.short_tasks < 1:
        parser.error("--sample-every and --short-tasks must be >= 1, --warmup >= 0")
    if args.workers is None:
        if args.gpu:
            from prefect_gpu_dask import nvml

            args.workers = nvml.visible_gpu_count()
        else:
            args.workers = 2
    if args.workers < 1:
        parser.error("no workers: --workers must be >= 1 (with --gpu: no GPU is visible)")
    return args


def result_json(
    args: argparse.Namespace, env: dict[str, Any], run: Soak, summary: dict[str, Any], failures: list[str]
) -> dict[str, Any]:
    return {
        "benchmark": "fleet_soak",
        "environment": env,
        "options": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "faults": FAULTS,
            "hung_timeout_s": HUNG_TIMEOUT_S,
            "oom_retries": 1,
        },
        "total_s": round(time.perf_counter() - run.started, 1),
        "summary": summary,
        "failures": failures,
        "samples": [asdict(s) for s in run.samples],
        "python_heap_growth": run.heap.growth() if run.heap else None,
        "runs": [asdict(r) for r in sorted(run.rows, key=lambda r: r.index)],
    }


def main() -> int:
    args = parse_args()
    env = environment(args)
    out = args.out or default_out(env, args.cluster)
    work = Path(tempfile.mkdtemp(prefix="fleet-soak-"))
    with fleet(args, work) as (address, monitor, database):
        print(f"cluster {args.cluster} at {address}: workers {scheduler_workers(monitor)}", flush=True)
        run, summary, failures = soak(args, address, work, monitor, database)
    print_tables(summary, run.samples, failures, sorted(run.rows, key=lambda r: r.index))
    result = result_json(args, env, run, summary, failures)
    for grown in result["python_heap_growth"] or []:
        print(f"python heap: +{grown['kib']} KiB in {grown['blocks']:+d} blocks, made at")
        print("\n".join("    " + line for line in grown["traceback"][-12:]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if failures:
        print(f"ledger and cluster logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    status = 1 if failures else 0
    if summary["runs_hung"]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # the hung run's thread still holds a client
    return status


if __name__ == "__main__":
    from benchmarks.fleet_soak import main as soak_main  # the importable module, not __main__

    sys.exit(soak_main())
