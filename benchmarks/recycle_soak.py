"""Recycle soak: sequential flow runs against a cluster of nanny-managed workers joined by
``address``, a leaking task every few runs, each leak recycling its worker.

    python benchmarks/recycle_soak.py                                 # 100 runs, LocalCluster
    python benchmarks/recycle_soak.py --runs 12 --leak-every 4 --cluster cli
    python benchmarks/recycle_soak.py --gpu --cluster cli             # real NVML, CuPy, dask cuda worker

Each flow run is ``GPUDaskTaskRunner(address=...)`` with six short ``gpu`` tasks; every
``--leak-every``-th run adds one ``gpu`` task that keeps 512 MiB (twice the default 256 MiB
threshold), so its worker is recycled. On CPU the GPU memory is scripted (``memory_probe``,
below); with ``--gpu`` it is NVML's and the leak is a CuPy array. The cluster is started
here, outside the runner: ``local`` is a ``LocalCluster`` of worker processes in this
process, ``cli`` is ``dask scheduler`` and ``dask worker`` (``dask cuda worker``)
subprocesses, all on 127.0.0.1. The flows report to ``prefect server start`` on SQLite
(``benchmarks/servers.py``).

Measures flow-run wall time (leak and clean runs apart) and each recycle's ``serving_s``;
checks that every leak run's ``read_flow_run_gpu_report``, read as soon as the run returns,
has exactly one restart that was not lost, that no other run has one, that the scheduler
keeps its workers, that no run hangs (``--run-timeout``), and, through a ledger each task
appends to, that no task ran twice and none was lost. The first run (its workers load
Prefect's task engine) is kept out of the wall-time figures. Prints a table and writes JSON
(``--out``, default ``benchmarks/results/<date>-<device>-recycle-soak-<cluster>.json``) with
every run, the summary and the environment; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks.* when run as a script
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

# Nothing above this line or below, outside functions, may import Prefect or Dask: the
# LocalCluster's worker processes are spawned, and spawning re-runs this script's top level
# in each of them, restarts included, where it would add seconds to every recycle measured.

SHORT_TASKS = 6
SHORT_TASK_S = 0.05
LEAK_BYTES = 512 * 2**20
LEAK_AFTER = 3  # the leak is submitted among the short tasks: some are queued behind it
SCRIPTED_GPU_TOTAL = 16 * 2**30
SCRIPTED_PROBE = "benchmarks.recycle_soak:scripted_gpu_probe"
# How long a report missing its restart is read again, to tell "late" from "never there".
LATE_REPORT_WAIT_S = 15.0
WORKER_START_TIMEOUT_S = 120.0

# -- on the workers: the scripted GPU and the tasks ---------------------------------------

SCRIPTED_HELD: list[int] = []  # bytes this worker process's scripted GPU hands out
KEPT_ON_GPU: list[Any] = []  # --gpu: the CuPy arrays the leaking tasks keep


class ScriptedGPU:
    """A ``MemoryProbe`` for CPU hosts: this process's GPU memory is what ``SCRIPTED_HELD``
    holds. Its allocator says it hands all of it out, so growth that stays is a leak
    (still owned by the task), not a library's one-time growth."""

    def __init__(self, gpu: Any):
        self.gpu = gpu

    def sample(self) -> Any:
        from prefect_gpu_dask.worker.probe import MemorySample

        used = sum(SCRIPTED_HELD)
        return MemorySample(used, used, SCRIPTED_GPU_TOTAL)

    def allocator_bytes(self) -> Any:
        from prefect_gpu_dask.worker.probe import AllocatorBytes

        return AllocatorBytes(owned=sum(SCRIPTED_HELD))


def scripted_gpu_probe() -> ScriptedGPU:
    """The runner's ``memory_probe`` on CPU: every worker of the soak has a scripted GPU."""
    from distributed import Worker

    from prefect_gpu_dask.worker.probe import GPUIdentity

    workers = list(Worker._instances)  # plugins' setup runs outside any task: no get_worker()
    name = str(workers[0].name) if len(workers) == 1 else "unknown"
    return ScriptedGPU(GPUIdentity(0, f"GPU-scripted-{name}", "NVIDIA ScriptedGPU", SCRIPTED_GPU_TOTAL))


def note_run(ledger: str, label: str) -> None:
    """One ledger line per execution of a task body: ``task_run_id label pid time``."""
    from prefect.runtime import task_run

    with open(ledger, "a") as fh:  # one short append per line: lines from processes do not mix
        fh.write(f"{task_run.id} {label} {os.getpid()} {time.time():.3f}\n")


def short_gpu_task(ledger: str, label: str) -> int:
    note_run(ledger, label)
    time.sleep(SHORT_TASK_S)
    return os.getpid()


def leaking_gpu_task(ledger: str, label: str, on_gpu: bool) -> int:
    note_run(ledger, label)
    if on_gpu:
        import cupy

        KEPT_ON_GPU.append(cupy.ones(LEAK_BYTES // 8))  # float64: 512 MiB, kept: a leak
    else:
        SCRIPTED_HELD.append(LEAK_BYTES)
    return os.getpid()


# -- in this process: the flow ------------------------------------------------------------

# What each flow run's body saw (its id, its runner), by run index: a run that never
# returns still says which flow run it was.
SEEN: dict[int, dict[str, Any]] = {}


def build_flow(address: str, memory_probe: str | None, on_gpu: bool) -> Any:
    """The soak's flow. Its tasks wrap this module's functions, which workers import by
    name (a task defined in ``__main__`` would travel by value)."""
    from prefect import flow, task
    from prefect.context import FlowRunContext
    from prefect.futures import wait

    from prefect_gpu_dask import GPUDaskTaskRunner

    short = task(short_gpu_task, name="short", tags=["gpu"])
    leaking = task(leaking_gpu_task, name="leak-512MiB", tags=["gpu"])

    @flow(name="recycle-soak", task_runner=GPUDaskTaskRunner(address=address, memory_probe=memory_probe))
    def soak_run(ledger: str, index: int, leak: bool) -> dict[str, Any]:
        context = FlowRunContext.get()
        # Prefect runs a duplicate of the runner: the one whose restarts count is this one.
        SEEN[index] = {"flow_run_id": str(context.flow_run.id), "runner": context.task_runner}
        futures = []
        for i in range(SHORT_TASKS):
            futures.append(short.submit(ledger, f"run{index}-short{i}"))
            if leak and i == LEAK_AFTER - 1:
                futures.append(leaking.submit(ledger, f"run{index}-leak", on_gpu))
        wait(futures)
        states = [f.state for f in futures]
        return {
            "task_run_ids": [str(f.task_run_id) for f in futures],
            "not_completed": [
                f"{f.task_run_id}: {s.type.value}" for f, s in zip(futures, states) if not s.is_completed()
            ],
        }

    return soak_run


@dataclass
class RunRow:
    """One flow run of the soak, as the JSON keeps it."""

    index: int
    leak: bool
    ended: bool = False  # returned (or raised) within --run-timeout
    error: str | None = None
    wall_s: float | None = None
    flow_run_id: str | None = None
    task_run_ids: list[str] = field(default_factory=list)
    not_completed: list[str] = field(default_factory=list)
    report_restarts: int | None = None  # in read_flow_run_gpu_report, read at once
    report_read_s: float | None = None
    report_leak_records: int | None = None
    runner_restarts: int | None = None  # the flow's runner's own .restarts
    restart_late_s: float | None = None  # a restart missing at once showed up this much later
    restarts: list[dict[str, Any]] = field(default_factory=list)
    workers_after: int | None = None
    worker_names_after: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)  # worker processes that ran its tasks (the ledger's)
    fresh_pids: int = 0  # of them, processes no earlier run used: they load Prefect's engine first


def run_with_timeout(
    fn: Callable[[], Any], timeout_s: float
) -> tuple[bool, Any, BaseException | None, float]:
    """``fn()`` in a daemon thread, in this context (the Prefect settings that point at the
    server are a context variable): (ended, value, error, wall seconds). A hung run is
    left behind, not waited for."""
    outcome: dict[str, Any] = {}
    context = contextvars.copy_context()

    def target() -> None:
        started = time.perf_counter()
        try:
            outcome["value"] = context.run(fn)
        except BaseException as exc:  # a failed flow run is a row of the table, not the end
            outcome["error"] = exc
        outcome["wall_s"] = time.perf_counter() - started

    started = time.perf_counter()
    thread = threading.Thread(target=target, name="soak-flow-run", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return False, None, None, time.perf_counter() - started
    return True, outcome.get("value"), outcome.get("error"), outcome["wall_s"]


def restart_row(restart: Any) -> dict[str, Any]:
    keep = ("worker_name", "worker", "new_worker", "old_pid", "new_pid", "outcome", "lost_reason", "reason")
    keep += ("requested_at",)
    times = ("safe_point_s", "restart_s", "serving_s", "memory_free_s")
    return {k: getattr(restart, k) for k in keep + times}


def read_report_restarts(flow_run_id: str) -> tuple[Any, float]:
    from prefect_gpu_dask import read_flow_run_gpu_report

    started = time.perf_counter()
    report = read_flow_run_gpu_report(flow_run_id)
    return report, time.perf_counter() - started


def scheduler_workers(monitor: Any) -> list[str]:
    workers = monitor.scheduler_info()["workers"]
    return sorted(str(w.get("name", address)) for address, w in workers.items())


def soak(args: argparse.Namespace, address: str, ledger: Path, monitor: Any) -> list[RunRow]:
    memory_probe = None if args.gpu else SCRIPTED_PROBE
    soak_run = build_flow(address, memory_probe, args.gpu)
    rows: list[RunRow] = []
    for index in range(1, args.runs + 1):
        row = RunRow(index=index, leak=index % args.leak_every == 0)
        rows.append(row)
        ended, value, error, wall_s = run_with_timeout(
            lambda i=index, leak=row.leak: soak_run(str(ledger), i, leak), args.run_timeout
        )
        row.ended, row.wall_s = ended, round(wall_s, 3)
        seen = SEEN.pop(index, {})  # not kept: each runner holds its closed client
        row.flow_run_id = seen.get("flow_run_id")
        if not ended:
            row.error = f"hung: no end after {args.run_timeout:g} s"
            print(
                f"run {index}/{args.runs}: HUNG after {args.run_timeout:g} s; the soak stops here", flush=True
            )
            break  # the hung run still holds its runner on the cluster: later runs would measure that
        if error is not None:
            row.error = f"{type(error).__name__}: {error}"
        if isinstance(value, dict):
            row.task_run_ids, row.not_completed = value["task_run_ids"], value["not_completed"]
        if row.flow_run_id is not None:
            report, read_s = read_report_restarts(row.flow_run_id)
            row.report_read_s = round(read_s, 3)
            row.report_restarts = len(report.restarts)
            row.report_leak_records = len(report.leaks)
            expected = 1 if row.leak else 0
            if len(report.restarts) < expected:  # late, or never there?
                waited = time.perf_counter()
                while time.perf_counter() - waited < LATE_REPORT_WAIT_S:
                    time.sleep(0.5)
                    report, _ = read_report_restarts(row.flow_run_id)
                    if len(report.restarts) >= expected:
                        row.restart_late_s = round(time.perf_counter() - waited, 2)
                        break
            row.restarts = [restart_row(r) for r in report.restarts]
        runner = seen.get("runner")
        row.runner_restarts = len(runner.restarts) if runner is not None else None
        row.worker_names_after = scheduler_workers(monitor)
        row.workers_after = len(row.worker_names_after)
        print(run_line(row, args.runs), flush=True)
    return rows


def run_line(row: RunRow, runs: int) -> str:
    restarts = ", ".join(f"{r['outcome']} serving {r['serving_s']:.2f} s" for r in row.restarts) or "none"
    failed = f"  ERROR {row.error}" if row.error else ""
    return (
        f"run {row.index}/{runs} {'leak ' if row.leak else 'clean'} wall {row.wall_s:6.2f} s"
        f"  report restarts {row.report_restarts} ({restarts})  runner restarts {row.runner_restarts}"
        f"  workers {row.workers_after}{failed}"
    )


# -- the clusters ---------------------------------------------------------------------------


def worker_env() -> dict[str, str]:
    """Workers import this module (the tasks, the scripted probe) by name."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}


@contextlib.contextmanager
def local_cluster(workers: int, on_gpu: bool, fork: bool = False) -> Iterator[str]:
    """Worker processes under nannies in this process, each offering ``GPU=1``; spawned,
    or with ``fork`` forked from a server that imported Prefect and Dask once, as the
    runner's own local clusters are (``prefect_gpu_dask.forkserver``)."""
    import distributed

    from prefect_gpu_dask.forkserver import worker_processes

    os.environ.update(PYTHONPATH=worker_env()["PYTHONPATH"])
    start_method = worker_processes(on_gpu) if fork else contextlib.nullcontext("spawn")
    common: dict[str, Any] = dict(
        n_workers=workers,
        threads_per_worker=2,
        resources={"GPU": 1},
        processes=True,
        host="127.0.0.1",
        dashboard_address=None,
    )
    with start_method:
        if on_gpu:
            from dask_cuda import LocalCUDACluster

            cluster = LocalCUDACluster(CUDA_VISIBLE_DEVICES=list(range(workers)), **common)
        else:
            cluster = distributed.LocalCluster(**common)
        with cluster:
            yield cluster.scheduler_address


class CliCluster:
    """``dask scheduler`` and ``dask worker`` (``dask cuda worker``) subprocesses on 127.0.0.1."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, module: str, args: list[str], log: str, env: dict[str, str]) -> None:
        with open(self.logs / log, "w") as output:  # the child keeps its own descriptor
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, *args],
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # a group of its own: nanny and worker end together
                )
            )

    def start_scheduler(self) -> str:
        scheduler_file = self.logs / "scheduler.json"
        args = [
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-dashboard",
            "--scheduler-file",
            str(scheduler_file),
        ]
        self.spawn("distributed.cli.dask_scheduler", args, "scheduler.log", worker_env())
        deadline = time.monotonic() + 60
        while True:  # the file may exist before it is written
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, KeyError):
                return json.loads(scheduler_file.read_text())["address"]
            if time.monotonic() > deadline or self.procs[0].poll() is not None:
                raise RuntimeError(f"dask scheduler gave no address: see {self.logs / 'scheduler.log'}")
            time.sleep(0.1)

    def start_workers(self, address: str, workers: int, on_gpu: bool, fork: bool = False) -> None:
        common = ["--host", "127.0.0.1", "--nthreads", "2", "--resources", "GPU=1", "--no-dashboard"]
        if fork:  # each worker process forks from a server that imported Prefect and Dask once
            common += ["--preload-nanny", "prefect_gpu_dask.worker.nanny"]
        if on_gpu:
            # One ``dask cuda worker`` starts a worker per visible GPU (soak-0, soak-1, ...; soak alone).
            env = worker_env() | {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(workers)))}
            self.spawn("dask_cuda.cli", [address, "--name", "soak", *common], "worker-cuda.log", env)
            return
        for i in range(workers):
            self.spawn(
                "distributed.cli.dask_worker",
                [address, "--name", f"soak-{i}", *common],
                f"worker-{i}.log",
                worker_env(),
            )

    def close(self) -> None:
        # Nothing they hold is kept: a graceful close would spend seconds per worker.
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait(10)


@contextlib.contextmanager
def cli_cluster(workers: int, on_gpu: bool, logs: Path, fork: bool = False) -> Iterator[str]:
    cluster = CliCluster(logs)
    try:
        address = cluster.start_scheduler()
        cluster.start_workers(address, workers, on_gpu, fork)
        yield address
    finally:
        cluster.close()


# -- the summary and its checks -------------------------------------------------------------


def ledger_lines(ledger: Path) -> list[tuple[str, str, int]]:
    if not ledger.exists():
        return []
    lines = [line.split() for line in ledger.read_text().splitlines() if line.strip()]
    return [(task_run_id, label, int(pid)) for task_run_id, label, pid, *_ in lines]


def ledger_times(ledger: Path) -> dict[str, list[float]]:
    """When each task run's body started, per execution (the ledger's last field)."""
    times: dict[str, list[float]] = {}
    for fields in (line.split() for line in ledger.read_text().splitlines() if line.strip()):
        if len(fields) > 3:
            times.setdefault(fields[0], []).append(float(fields[3]))
    return times


def attach_pids(rows: list[RunRow], ledger: Path) -> None:
    """Which worker processes ran each run's tasks, and which of them were new then."""
    by_run: dict[int, set[int]] = {}
    for _, label, pid in ledger_lines(ledger):
        by_run.setdefault(int(label.split("-")[0].removeprefix("run")), set()).add(pid)
    used: set[int] = set()
    for row in rows:
        row.pids = sorted(by_run.get(row.index, ()))
        row.fresh_pids = len(set(row.pids) - used)
        used.update(row.pids)


def median_p95(values: list[float]) -> dict[str, float | None]:
    from benchmarks.common import p95

    if not values:
        return {"median_s": None, "p95_s": None, "max_s": None, "runs": 0}
    return {
        "median_s": statistics.median(values),
        "p95_s": p95(values),
        "max_s": max(values),
        "runs": len(values),
    }


def summarize(rows: list[RunRow], runs: int, expected_workers: int, ledger: Path) -> dict[str, Any]:
    ended = [r for r in rows if r.ended]
    leak_rows = [r for r in ended if r.leak]
    restarts = [restart for r in leak_rows for restart in r.restarts]
    lines = ledger_lines(ledger)
    executions = Counter(task_run_id for task_run_id, _, _ in lines)
    submitted = [task_run_id for r in ended for task_run_id in r.task_run_ids]
    worker_counts = [r.workers_after for r in ended if r.workers_after is not None]
    return {
        "runs": runs,
        "runs_ended": len(ended),
        "runs_hung": sum(not r.ended for r in rows),
        "runs_failed": sum(bool(r.error or r.not_completed) for r in ended),
        "leak_runs": len(leak_rows),
        # The first run's workers load Prefect's task engine with their first task: kept apart.
        "first_run_wall_s": ended[0].wall_s if ended and ended[0].index == 1 else None,
        "clean_wall": median_p95([r.wall_s for r in ended if not r.leak and r.index > 1]),
        "leak_wall": median_p95([r.wall_s for r in leak_rows if r.index > 1]),
        # Clean runs whose tasks met a replacement worker's first task, against the others.
        "clean_wall_fresh_worker": median_p95(
            [r.wall_s for r in ended if not r.leak and r.index > 1 and r.fresh_pids]
        ),
        "clean_wall_warm_workers": median_p95(
            [r.wall_s for r in ended if not r.leak and r.index > 1 and not r.fresh_pids]
        ),
        "serving": median_p95([r["serving_s"] for r in restarts if not r["outcome"] == "lost"]),
        "recycles_expected": len(leak_rows),
        # A leak run's one restart, replaced: what the soak is for.
        "recycles_done": sum(len(r.restarts) == 1 and r.restarts[0]["outcome"] != "lost" for r in leak_rows),
        "recycles_lost": sum(restart["outcome"] == "lost" for r in ended for restart in r.restarts),
        "unexpected_restarts": sum(len(r.restarts) for r in ended if not r.leak)
        + sum(max(0, len(r.restarts) - 1) for r in leak_rows),
        "runner_report_mismatches": sum(
            r.runner_restarts is not None and r.runner_restarts != r.report_restarts for r in ended
        ),
        "reports_with_restart_at_once": sum((r.report_restarts or 0) >= 1 for r in leak_rows),
        "reports_with_restart_late": sum(r.restart_late_s is not None for r in leak_rows),
        "workers_expected": expected_workers,
        "workers_min": min(worker_counts) if worker_counts else None,
        "workers_at_end": worker_counts[-1] if worker_counts else None,
        "tasks_submitted": len(submitted),
        "tasks_run_twice": sum(n > 1 for n in executions.values()),
        "tasks_run_twice_lines": [" ".join(map(str, line)) for line in lines if executions[line[0]] > 1],
        "tasks_lost": sum(task_run_id not in executions for task_run_id in submitted),
    }


def failed_checks(s: dict[str, Any]) -> list[str]:
    checks = {
        "a run hung": s["runs_hung"] > 0,
        "a run ended early or failed": s["runs_ended"] < s["runs"] or s["runs_failed"] > 0,
        "a task ran twice": s["tasks_run_twice"] > 0,
        "a task was lost": s["tasks_lost"] > 0,
        "a recycle lost its worker": s["recycles_lost"] > 0,
        "a leak run was not recycled exactly once": s["recycles_done"] < s["recycles_expected"],
        "a restart nobody asked for": s["unexpected_restarts"] > 0,
        "a report missing its restart when the run returned": s["reports_with_restart_at_once"]
        < s["recycles_expected"],
        "the runner and the report disagree on restarts": s["runner_report_mismatches"] > 0,
        "the scheduler lost a worker": s["workers_min"] is not None
        and s["workers_min"] < s["workers_expected"],
    }
    return [name for name, failed in checks.items() if failed]


def print_table(s: dict[str, Any], failures: list[str]) -> None:
    def seconds(spread: dict[str, float | None], key: str) -> str:
        return "-" if spread[key] is None else f"{spread[key]:.2f} s"

    first = s["first_run_wall_s"]
    fresh, warm = s["clean_wall_fresh_worker"], s["clean_wall_warm_workers"]
    rows = [
        ("flow-run wall, first run (cold workers)", "-" if first is None else f"{first:.2f} s"),
        (
            "flow-run wall, clean runs after it: median / p95",
            f"{seconds(s['clean_wall'], 'median_s')} / {seconds(s['clean_wall'], 'p95_s')}",
        ),
        (
            "  of which met a fresh worker / all warm: median",
            f"{seconds(fresh, 'median_s')} ({fresh['runs']} runs)"
            f" / {seconds(warm, 'median_s')} ({warm['runs']} runs)",
        ),
        (
            "flow-run wall, leak runs: median / p95",
            f"{seconds(s['leak_wall'], 'median_s')} / {seconds(s['leak_wall'], 'p95_s')}",
        ),
        (
            "recycle serving_s: median / p95 / max",
            " / ".join(seconds(s["serving"], k) for k in ("median_s", "p95_s", "max_s")),
        ),
        ("recycles done / expected", f"{s['recycles_done']} / {s['recycles_expected']}"),
        ("lost recycles", str(s["recycles_lost"])),
        ("restarts nobody asked for", str(s["unexpected_restarts"])),
        (
            "worker count: min / at end (expected)",
            f"{s['workers_min']} / {s['workers_at_end']} ({s['workers_expected']})",
        ),
        (
            "runs ended / hung / failed",
            f"{s['runs_ended']} of {s['runs']} / {s['runs_hung']} / {s['runs_failed']}",
        ),
        (
            "tasks run twice / lost (of submitted)",
            f"{s['tasks_run_twice']} / {s['tasks_lost']} ({s['tasks_submitted']})",
        ),
        (
            "reports with the restart readable at once",
            f"{s['reports_with_restart_at_once']} of {s['recycles_expected']}"
            + (f" ({s['reports_with_restart_late']} later)" if s["reports_with_restart_late"] else ""),
        ),
        ("runner .restarts vs report mismatches", str(s["runner_report_mismatches"])),
    ]
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for line in s["tasks_run_twice_lines"]:
        print(f"  ran twice (ledger: task_run_id label pid): {line}")
    print("checks: " + ("all passed" if not failures else "FAILED: " + "; ".join(failures)))


def environment(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.common import device_name, versions

    device = device_name()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "device": device,
        "gpu": None if device.startswith("CPU only") else device,
        "nproc": os.cpu_count(),
        "versions": versions(),
    }


def default_out(env: dict[str, Any], cluster: str) -> Path:
    slug = env["device"].replace(" ", "-").replace("(", "").replace(")", "").lower()
    return ROOT / "benchmarks" / "results" / f"{date.today().isoformat()}-{slug}-recycle-soak-{cluster}.json"


# -- the command line -----------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--leak-every", type=int, default=5, help="every Nth run leaks 512 MiB (default 5)")
    parser.add_argument("--cluster", choices=("local", "cli"), default="local")
    parser.add_argument("--gpu", action="store_true", help="real NVML and CuPy instead of the scripted GPU")
    parser.add_argument(
        "--workers", type=int, default=None, help="workers (default: 2 on CPU, every visible GPU with --gpu)"
    )
    parser.add_argument("--run-timeout", type=float, default=120.0, help="seconds a flow run may take")
    parser.add_argument(
        "--out", type=Path, default=None, help="the JSON file (default: benchmarks/results/...)"
    )
    args = parser.parse_args()
    if args.runs < 1 or args.leak_every < 1 or args.run_timeout <= 0:
        parser.error("--runs and --leak-every must be >= 1, --run-timeout > 0")
    if args.workers is None:
        if args.gpu:
            from prefect_gpu_dask import nvml

            args.workers = nvml.visible_gpu_count()
        else:
            args.workers = 2
    if args.workers < 1:
        parser.error("no workers: --workers must be >= 1 (with --gpu: no GPU is visible)")
    return args


def main() -> int:
    args = parse_args()
    from distributed import Client

    from benchmarks.servers import using_prefect_server

    env = environment(args)
    out = args.out or default_out(env, args.cluster)
    logs = Path(tempfile.mkdtemp(prefix="recycle-soak-"))
    ledger = logs / "ledger.txt"
    rows: list[RunRow] = []
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(using_prefect_server())
        if args.cluster == "local":
            address = stack.enter_context(local_cluster(args.workers, args.gpu))
        else:
            address = stack.enter_context(cli_cluster(args.workers, args.gpu, logs))
        monitor = stack.enter_context(Client(address, timeout=WORKER_START_TIMEOUT_S))
        monitor.wait_for_workers(args.workers, timeout=WORKER_START_TIMEOUT_S)
        print(f"cluster {args.cluster} at {address}: workers {scheduler_workers(monitor)}", flush=True)
        try:
            rows = soak(args, address, ledger, monitor)
        except KeyboardInterrupt:
            print("interrupted: summarizing the runs so far", flush=True)
    attach_pids(rows, ledger)
    summary = summarize(rows, args.runs, args.workers, ledger)
    failures = failed_checks(summary)
    result = {
        "benchmark": "recycle_soak",
        "environment": env,
        "options": {
            "runs": args.runs,
            "leak_every": args.leak_every,
            "cluster": args.cluster,
            "gpu": args.gpu,
            "workers": args.workers,
            "run_timeout_s": args.run_timeout,
            "short_tasks": SHORT_TASKS,
            "short_task_s": SHORT_TASK_S,
            "leak_bytes": LEAK_BYTES,
        },
        "total_s": round(time.perf_counter() - started, 1),
        "summary": summary,
        "failures": failures,
        "runs": [asdict(row) for row in rows],
    }
    print_table(summary, failures)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if failures:
        print(f"ledger and cluster logs kept in {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    status = 1 if failures else 0
    if summary["runs_hung"]:
        # The hung flow run's thread still holds a Dask client and Prefect's workers: the
        # interpreter's exit would wait on them.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


if __name__ == "__main__":
    from benchmarks.recycle_soak import main as soak_main  # the importable module, not __main__

    sys.exit(soak_main())
