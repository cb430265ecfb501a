"""Benchmarks: the product against what users would otherwise run, in one process.

    python benchmarks/run.py                 # everything this host can run
    python benchmarks/run.py --quick         # CPU-sized smoke run (any machine)

Prints a table and writes ``benchmarks/results/<date>-<device>.json`` plus the headline
figures to ``benchmarks/results/summary.json``. "Warm" means: the cluster is already
up and the same computation ran once before; each figure is the median of ``--repeat``
runs, with the p95 beside it where the spread matters (the speed-cube through the
runner, leak to serving).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import dask.array as da

from prefect_gpu_dask.cluster import GPU_WORKER_THREADS

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks.* when run as a script
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
RESULTS = ROOT / "benchmarks" / "results"
WARM_TASKS = 64  # at least every thread of every worker on the machines we measure
GiB = 2**30


# -- helpers ----------------------------------------------------------------------
def runs_of(fn, repeat: int) -> list[float]:
    fn()  # warm-up: imports, kernels, pools
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_of(fn, repeat: int) -> float:
    return statistics.median(runs_of(fn, repeat))


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def spread(values: list[float]) -> dict[str, Any]:
    median = statistics.median(values)
    return {
        "median_s": median,
        "p95_s": p95(values),
        "p95_over_median": p95(values) / median,
        "max_s": max(values),
        "runs": len(values),
        "runs_s": [round(v, 4) for v in values],
    }


def device_name() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        count = pynvml.nvmlDeviceGetCount()
        name = name.decode() if isinstance(name, bytes) else name
        return f"{count}x {name}" if count > 1 else name
    except Exception:
        return f"CPU only ({os.cpu_count()} cores)"


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("prefect", "prefect_dask", "dask", "distributed", "dask_cuda", "cupy"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "?")
        except Exception:
            pass
    return out


def speed_cube_expr(n: int, chunk: int, gpu: bool):
    """The seed's speed-cube: mean of x[::2, ::2] + 1 for x ~ N(10, 1); about 11."""
    if gpu:
        import cupy

        rs = da.random.RandomState(RandomState=cupy.random.RandomState)
    else:
        rs = da.random.RandomState()
    x = rs.normal(10, 1, size=(n, n), chunks=(chunk, chunk))
    return (x[::2, ::2] + 1).mean()


def check_cube(value: Any) -> float:
    value = float(value)
    assert abs(value - 11) < 0.01, f"speed-cube mean {value} is not ~11"
    return value


# -- (a) speed-cube ---------------------------------------------------------------
def bench_speed_cube(n: int, chunk: int, gpu: bool, repeat: int, cpu_n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"n": n, "chunk": chunk, "cpu_n": cpu_n}
    # The host's cores, threads scheduler, NumPy.
    cpu_s = median_of(
        lambda: check_cube(speed_cube_expr(cpu_n, chunk, False).compute(scheduler="threads")), 1
    )
    out["cpu_threads_s"] = cpu_s * (n / cpu_n) ** 2  # scaled to the full size if run smaller
    out["cpu_threads_measured_s"] = cpu_s
    if not gpu:
        return out
    out["raw_threads_s"] = median_of(
        lambda: check_cube(speed_cube_expr(n, chunk, True).compute(scheduler="threads")), repeat
    )
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    with LocalCUDACluster(threads_per_worker=GPU_WORKER_THREADS) as cluster, Client(cluster) as client:
        out["raw_local_cuda_cluster_s"] = median_of(
            lambda: check_cube(client.compute(speed_cube_expr(n, chunk, True)).result()), repeat
        )

    runner = cube_through_runner(n, chunk, max(repeat, 20), spread_of_runs=True)
    out["runner"] = runner
    out["runner_s"] = runner["median_s"]
    out["runner_postgres"] = on_postgres(lambda: cube_through_runner(n, chunk, max(repeat, 20), True))
    return out


def on_postgres(measure: Any) -> Any:
    """``measure()`` with the runner reporting to ``prefect server start`` on PostgreSQL
    (the production set-up) instead of the embedded SQLite server; why not, if it cannot."""
    from benchmarks.servers import postgres_missing, postgres_server, using_prefect_server

    if (why := postgres_missing()) is not None:
        return {"skipped": why}
    with contextlib.ExitStack() as servers:
        try:
            database = servers.enter_context(postgres_server())
            servers.enter_context(using_prefect_server(database))
        except (subprocess.CalledProcessError, RuntimeError) as exc:
            return {"skipped": f"PostgreSQL or its Prefect server did not start: {exc}"}
        return measure()


def cube_through_runner(
    n: int, chunk: int, repeat: int, spread_of_runs: bool = False, **runner_kwargs: Any
) -> Any:
    """The speed-cube as one gpu task that computes its chunks with ``compute_on_gpus``:
    the median of ``repeat`` warm runs (or their spread)."""
    from prefect import flow, task
    from prefect.context import FlowRunContext

    from prefect_gpu_dask import GPUDaskTaskRunner, compute_on_gpus

    @task(tags=["gpu"])
    def cube() -> float:
        return check_cube(compute_on_gpus(speed_cube_expr(n, chunk, True))[0])

    @flow(task_runner=GPUDaskTaskRunner(**runner_kwargs))
    def through_runner() -> tuple[list[float], list[float]]:
        runs = runs_of(lambda: cube.submit().result(), repeat)
        runner = FlowRunContext.get().task_runner
        deadline = time.monotonic() + 10
        while len(runner.records) < repeat + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        inside = [r.duration_s for r in sorted(runner.records, key=lambda r: r.time)][1:]
        return runs, inside

    runs, inside = through_runner()
    if not spread_of_runs:
        return statistics.median(runs)
    # Where a slow run's time went: the user's code (the guard's duration) or around it.
    return spread(runs) | {"inside_task": spread(inside) if inside else None}


# -- (b) per-task overhead --------------------------------------------------------
def bench_per_task(n: int, gpu: bool) -> dict[str, Any]:
    from prefect import flow, task
    from prefect.context import FlowRunContext
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    from prefect_gpu_dask import GPUDaskTaskRunner

    @task
    def noop(i: int) -> int:
        return i

    def timed(runner, job=noop) -> float:
        @flow(task_runner=runner)
        def many() -> tuple[float, str]:
            client = getattr(FlowRunContext.get().task_runner, "client", None)  # start the cluster first
            del client
            # Warm: a task on every thread of every worker, so the timed batch does not
            # include each worker process loading Prefect's engine (~2.5 s, once per
            # process; reported as first_task_s). Arguments < 0 are the warm-up.
            assert all(f.result() < 0 for f in job.map(range(-WARM_TASKS, 0)))
            start = time.perf_counter()
            results = [f.result() for f in job.map(range(n))]
            assert results == list(range(n))
            return time.perf_counter() - start, str(FlowRunContext.get().flow_run.id)

        elapsed, flow_run_id = many()
        api_caught_up(flow_run_id, n + WARM_TASKS)
        return elapsed

    # The runner's own defaults on a GPU host (one worker per GPU, GPU_WORKER_THREADS each);
    # prefect-dask gets the same cluster.
    cluster = {"threads_per_worker": GPU_WORKER_THREADS} if gpu else {"n_workers": 1, "threads_per_worker": 4}
    cuda = "dask_cuda.LocalCUDACluster" if gpu else None
    dask_kwargs = {
        "cluster_class": cuda,
        "cluster_kwargs": {**cluster, **({"resources": {"GPU": 1}} if gpu else {})},
    }
    out = {"n": n, "threadpool_s": timed(ThreadPoolTaskRunner(max_workers=16))}
    out["runner_s"] = timed(GPUDaskTaskRunner(cluster_kwargs=cluster, guard="off"))
    # Tagged tasks cost more anywhere: Prefect's engine asks the API for the tag's
    # concurrency slots before each one. The thread pool pays that too.
    noop_gpu = noop.with_options(tags=["gpu"])
    out["threadpool_gpu_tagged_s"] = timed(ThreadPoolTaskRunner(max_workers=16), noop_gpu)
    guarded = GPUDaskTaskRunner(cluster_kwargs=cluster, guard="gpu")
    out["runner_guarded_gpu_tasks_s"] = timed(guarded, noop_gpu)
    if n <= 200:  # prefect-dask pays ~0.1 s a task: 1,000 would take minutes
        out["prefect_dask_s"] = timed(DaskTaskRunner(**{k: v for k, v in dask_kwargs.items() if v}))
    return out


def api_caught_up(flow_run_id: str, task_runs: int, timeout: float = 60) -> None:
    """Wait until the API server has recorded a flow run's task runs.

    Task runs reach the server as events, ingested after the flow returns; without
    this wait the next measurement shares the server with the previous one's backlog.
    """
    from prefect.client.orchestration import get_client

    only_this = {"flow_runs": {"id": {"any_": [flow_run_id]}}}
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            if client.request("POST", "/task_runs/count", json=only_this).json() >= task_runs:
                return
            time.sleep(1.0)


# -- (c) guard cost ---------------------------------------------------------------
def bench_guard(samples: int) -> dict[str, Any]:
    """begin()+end() of the guard around an empty task, with the real NVML probe."""
    import asyncio

    from prefect_gpu_dask.guard import GPUMemoryGuard
    from prefect_gpu_dask.health import HealthMonitor
    from prefect_gpu_dask.settings import RunnerSettings

    class FakeWorker:
        address, name = "bench", "bench"

        def log_event(self, topic, msg):
            pass

    try:  # a GPU task's worker has CuPy loaded: the guard then reads its pool too
        import cupy

        cupy.zeros(1)
    except ImportError:
        pass
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    # Timed in a quiet process: the sections before leave events and logs still being sent.
    EventsWorker.drain_all()
    APILogWorker.drain_all()
    guard = GPUMemoryGuard(RunnerSettings(health_check_s=None))  # health: timed on its own below
    asyncio.run(guard.setup(FakeWorker()))
    if not guard.active:
        return {"guard_us": None, "note": "no GPU: the guard is a no-op"}
    health = HealthMonitor(guard.probe.health_reader())
    checks = []
    for _ in range(samples):
        start = time.perf_counter()
        health.check()
        checks.append(time.perf_counter() - start)
    costs = []
    for _ in range(samples):
        start = time.perf_counter()
        ticket, before, started = guard.begin()
        guard.end(ticket, before, started)
        costs.append(time.perf_counter() - start)
    activity = []  # of the guard's cost: the task thread's utilisation/energy/temperature part
    watch = guard._activity
    for ticket in range(samples if watch is not None else 0):
        start = time.perf_counter()
        watch.start(-1 - ticket)
        watch.stop(-1 - ticket)
        activity.append(time.perf_counter() - start)
    sampler = guard._sampler

    def peak_sampler_start_stop() -> None:
        sampler.start(-1, 0)
        sampler.stop(-1, 0)

    parts = {  # each reading and step of begin()+end() on its own
        "process_read": guard._read_process,
        "allocators_read": guard._read_allocators,
        "device_and_process_read": guard.probe.sample,
        "peak_sampler_start_stop": peak_sampler_start_stop,
    }
    parts_us = {name: statistics.median(runs_of(step, samples)) * 1e6 for name, step in parts.items()}
    return {
        "guard_us": statistics.median(costs) * 1e6,
        "nvml_sample_us": parts_us["device_and_process_read"],  # one full probe read
        "guard_p95_us": sorted(costs)[int(0.95 * len(costs))] * 1e6,
        "health_check_us": statistics.median(checks) * 1e6,  # before each gpu task, and on a timer
        "activity_us": statistics.median(activity) * 1e6 if activity else None,
        "parts_us": parts_us,
        "health_limits": list(health.limits),
        "samples": samples,
    }


# -- (d) leak -> replacement serving, (e) cluster start --------------------------------
def bench_leak_and_start(gpu: bool, cycles: int = 5) -> dict[str, Any]:
    """Cluster start and first task; then ``cycles`` times: a task leaks 512 MiB, and the
    clock runs from its result to the next task that runs in the replacement worker on
    that GPU (``leak_to_serving_s``)."""
    from prefect import flow, task
    from prefect.context import FlowRunContext

    from prefect_gpu_dask import GPUDaskTaskRunner

    @task(tags=["gpu"])
    def leak() -> tuple[int, str]:
        import cupy

        leak.kept = cupy.ones(512 * 2**20 // 8)  # noqa: B010  # held by the task object: a leak
        return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]

    @task(tags=["gpu"])
    def pid() -> tuple[int, str]:
        return os.getpid(), os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]

    @flow(task_runner=GPUDaskTaskRunner(leak_threshold="256MiB"))
    def leaky() -> dict[str, Any]:
        runner = FlowRunContext.get().task_runner
        start = time.perf_counter()
        runner.client  # noqa: B018
        started = time.perf_counter() - start
        start = time.perf_counter()
        pid.submit().result()  # the first task run loads Prefect's engine on its worker
        first_task = time.perf_counter() - start
        out: dict[str, Any] = {"cluster_start_s": started, "first_task_s": first_task}
        if not gpu:
            return out
        [pid.submit().result() for _ in range(8)]  # warm
        serving, restarts = [], []
        for cycle in range(cycles):
            old, device = leak.submit().result()
            leaked_at = time.perf_counter()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the next task on that GPU, in a new process
                new, where = pid.submit().result()
                if where == device and new != old:
                    break
            serving.append(time.perf_counter() - leaked_at)
            while len(runner.restarts) <= cycle and time.monotonic() < deadline:
                time.sleep(0.01)
            restarts.append(runner.restarts[cycle])
        free = [r.memory_free_s for r in restarts if r.memory_free_s is not None]
        out.update(
            {
                "leak_to_serving": spread(serving),
                "leak_to_serving_s": statistics.median(serving),
                "memory_free_s": statistics.median(free) if free else None,
                # The recycler's own clock: from the record's arrival in the flow.
                "safe_point_s": statistics.median(r.safe_point_s or 0 for r in restarts),
                "restart_s": statistics.median(r.restart_s for r in restarts),
                "serving_s": statistics.median(r.serving_s for r in restarts),
                "restarts": [r.to_payload() for r in restarts],
            }
        )
        return out

    return leaky()


# -- (f) scaling ------------------------------------------------------------------
def bench_scaling(n: int, chunk: int, repeat: int) -> dict[str, Any]:
    """1, 2, 4, 8 GPUs: through the runner (one gpu task, compute_on_gpus) and raw Dask."""
    import pynvml
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    pynvml.nvmlInit()
    count = pynvml.nvmlDeviceGetCount()
    out: dict[str, Any] = {"gpus": count, "n": n, "chunk": chunk}
    for k in sorted({1, 2, 4, 8, count}):
        if k > count:
            continue
        devices = ",".join(str(i) for i in range(k))
        runs = cube_through_runner(
            n, chunk, max(repeat, 10), spread_of_runs=True, cluster_kwargs={"CUDA_VISIBLE_DEVICES": devices}
        )
        out[f"runner_{k}gpu"] = runs  # with the time inside the task: the rest is the task's overhead
        out[f"runner_{k}gpu_s"] = runs["median_s"]
        with (
            LocalCUDACluster(CUDA_VISIBLE_DEVICES=devices, threads_per_worker=GPU_WORKER_THREADS) as cl,
            Client(cl) as client,
        ):
            out[f"raw_distributed_{k}gpu_s"] = median_of(
                lambda: check_cube(client.compute(speed_cube_expr(n, chunk, True)).result()), repeat
            )
    for k in (2, 4, 8):
        if f"runner_{k}gpu_s" in out:
            out[f"scaling_{k}gpu"] = out["runner_1gpu_s"] / out[f"runner_{k}gpu_s"]
            out[f"raw_distributed_scaling_{k}gpu"] = (
                out["raw_distributed_1gpu_s"] / out[f"raw_distributed_{k}gpu_s"]
            )
            out[f"efficiency_{k}gpu"] = out[f"scaling_{k}gpu"] / k
    return out


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

    from prefect_gpu_dask import gpu_available

    gpu = gpu_available() and not args.quick
    n, chunk = (100_000, 10_000) if gpu else (4_000, 1_000)
    # Bad input fails before anything runs.
    args.scaling_sizes = scaling_sizes(args.scaling_n, chunk)
    args.tagged_tasks, args.tagged_rounds = tagged_size(args.tagged or ("100:1" if args.quick else "1000:3"))
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
        run_sections(result, sections, args, gpu, n, chunk)
    write(result, args.out)


def run_sections(
    result: dict[str, Any], sections: set[str], args: Any, gpu: bool, n: int, chunk: int
) -> None:
    if "cube" in sections:
        result["speed_cube"] = bench_speed_cube(n, chunk, gpu, args.repeat, cpu_n=n if not gpu else 40_000)
        print("speed_cube", json.dumps(result["speed_cube"]), flush=True)
    if "tasks" in sections:
        result["per_task"] = [bench_per_task(int(k), gpu) for k in args.tasks.split(",")]
        print("per_task", json.dumps(result["per_task"]), flush=True)
    if "guard" in sections:
        result["guard"] = bench_guard(2000)
        print("guard", json.dumps(result["guard"]), flush=True)
    if "leak" in sections:
        result["leak"] = bench_leak_and_start(gpu)
        print("leak", json.dumps(result["leak"], default=str), flush=True)
    if "tagged" in sections:
        from benchmarks.per_task_gpu import compare

        result["per_task_gpu"] = compare(args.tagged_tasks, args.tagged_rounds)
        print("per_task_gpu", json.dumps(result["per_task_gpu"]["summary"]), flush=True)
    if "scaling" in sections and gpu:
        for i, (side, side_chunk) in enumerate(args.scaling_sizes):
            # After the seed's cube, more work per GPU: fixed costs weigh less.
            name = "scaling" if i == 0 else f"scaling_n{side}"
            name += f"_c{side_chunk}" if i and side_chunk != chunk else ""
            result[name] = bench_scaling(side, side_chunk, args.repeat)
            print(name, json.dumps(result[name]), flush=True)


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
                "prefect_dask_s",
                "runner_s",
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
    rows += [
        ("guard per task (µs, median)", result.get("guard", {}).get("guard_us")),
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
