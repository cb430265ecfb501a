"""What the benchmark sections (and the probes) share: timing, the speed-cube, the host."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

WARM_TASKS = 64  # at least every thread of every worker on the machines we measure


def use_readme_default(label: str) -> None:
    """The README's default as a new user meets it: no ``PREFECT_API_URL`` and a fresh
    ``PREFECT_HOME``, so Prefect's embedded SQLite server. Call before Prefect is imported."""
    import tempfile

    os.environ.pop("PREFECT_API_URL", None)
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix=f"prefect-home-{label}-")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@dataclass(frozen=True)
class Options:
    """What ``run.py``'s command line asks of the sections."""

    gpu: bool  # a GPU run: full-size figures; else the CPU-sized ones
    n: int  # the speed-cube's side
    chunk: int  # and its chunks' side
    repeat: int
    tasks: tuple[int, ...]  # batch sizes of the per-task section
    tagged_tasks: int
    tagged_rounds: int
    scaling_sizes: tuple[tuple[int, int], ...]  # (side, chunk side) for the scaling section


class ServerLog:
    """This process's stderr, which the embedded server inherits, copied to a file."""

    def __init__(self) -> None:
        self.file = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self._tee = os.popen(f"tee -a {self.file.name} >&2", "w")  # noqa: S605
        os.dup2(self._tee.fileno(), 2)

    def count(self, *texts: str) -> dict[str, int]:
        """How often each of ``texts`` is in the log so far."""
        sys.stderr.flush()
        time.sleep(0.5)
        with open(self.file.name, errors="replace") as log_file:
            log = log_file.read()
        return {text: log.count(text) for text in texts}


def one_gpu_slot_runner(**runner_kwargs):
    """The default runner on its own cluster (with ``runner_kwargs``, such as ``guard``);
    on CPU one worker offering ``GPU=1`` with 8 threads stands in for a one-GPU host's
    worker, its guard reading the scripted probe."""
    from prefect_gpu_dask import GPUDaskTaskRunner, gpu_available

    if gpu_available():
        return GPUDaskTaskRunner(host_cluster=False, **runner_kwargs)
    return GPUDaskTaskRunner(
        host_cluster=False,
        memory_probe="benchmarks.recycle_soak:scripted_gpu_probe",
        cluster_kwargs={"n_workers": 1, "threads_per_worker": 8, "resources": {"GPU": 1}},
        **runner_kwargs,
    )


def cluster_start_and_first_task(runner: Any, first_task: Any) -> tuple[float, float]:
    """Inside a flow run: seconds for the runner's cluster (``runner.client``), then for
    ``first_task`` submitted and its result read."""
    start = time.perf_counter()
    runner.client  # noqa: B018
    started = time.perf_counter() - start
    start = time.perf_counter()
    first_task.submit().result()
    return started, time.perf_counter() - start


def runs_of(fn, repeat: int) -> list[float]:
    fn()  # warm-up: imports, kernels, pools
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def warm_every_worker(job: Any, *args: Any) -> int:
    """Inside a flow run: one run of the Prefect task ``job`` per worker of the runner's
    cluster, submitted together so the scheduler spreads them. A worker's first task run
    loads Prefect's engine and the task's libraries in that process; a warm run should
    not pay for it on whichever worker it lands. Returns how many runs it made."""
    from prefect.context import FlowRunContext

    workers = max(len(FlowRunContext.get().task_runner.client.nthreads()), 1)
    for future in [job.submit(*args) for _ in range(workers)]:
        future.result()
    return workers


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
    import dask.array as da

    if gpu:
        import cupy

        rs = da.random.RandomState(RandomState=cupy.random.RandomState)
    else:
        rs = da.random.RandomState()
    x = rs.normal(10, 1, size=(n, n), chunks=(chunk, chunk))
    return (x[::2, ::2] + 1).mean()


def in_child_process(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` (importable, as are its arguments) in a fresh spawned process.

    GPU work measured here leaves no CUDA context in the benchmark's own process: one
    would sit on every GPU worker's GPU of a one-GPU host, and a worker beside another
    process reads its memory the slower way (``docs/performance.md``, the guard)."""
    import concurrent.futures
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as child:
        return child.submit(fn, *args).result()


def threads_cube_runs(n: int, chunk: int, runs: int, gpu: bool = True, pool: Any = None) -> list[float]:
    """The speed-cube on Dask's threads scheduler (its default pool, or ``pool``) on this
    process's GPU (or CPU, ``gpu=False``): ``runs`` warm runs' seconds, after one that
    loads its kernels. For a plain process, run it ``in_child_process``."""
    import dask

    where = {"scheduler": "threads", **({"pool": pool} if pool is not None else {})}
    return runs_of(lambda: check_cube(dask.compute(speed_cube_expr(n, chunk, gpu), **where)[0]), runs)


def device_cube_runs(runs: int, pool: Any = None) -> list[float]:
    """``threads_cube_runs`` at the size of this process's device (``flows/speed_cube.py``)."""
    from flows.speed_cube import default_size
    from prefect_gpu_dask import gpu_available

    gpu = gpu_available()
    return threads_cube_runs(*default_size(gpu), runs, gpu, pool)


@contextlib.contextmanager
def another_process_on_gpu(device: str) -> Iterator[None]:
    """A process holding a CUDA context (CuPy's) on GPU ``device`` (as
    ``CUDA_VISIBLE_DEVICES`` names it) for the block: as a second cluster's worker on
    that GPU would."""
    hold = "import cupy, sys; cupy.zeros(1); print('ready', flush=True); sys.stdin.read()"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": device}
    with subprocess.Popen(
        [sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
    ) as holder:
        answer: list[str] = []
        try:
            read = lambda: answer.append(holder.stdout.readline().strip())  # noqa: E731
            ready = threading.Thread(target=read, daemon=True)
            ready.start()
            ready.join(60)  # a CUDA start that hangs must not hang the benchmark
            if answer != ["ready"]:
                raise RuntimeError(f"no process could hold a CUDA context on GPU {device}")
            yield
        finally:
            if holder.stdin:
                holder.stdin.close()
            try:
                holder.wait(30 if answer == ["ready"] else 0)
            except subprocess.TimeoutExpired:
                holder.kill()


def check_cube(value: Any) -> float:
    value = float(value)
    assert abs(value - 11) < 0.01, f"speed-cube mean {value} is not ~11"
    return value


def against_thread_pool(runs: dict[str, list[float]], heading: str, out: str | None, tasks: int) -> None:
    """Print each runner's rounds beside ``runs["thread pool"]`` as a table under
    ``heading``, and write them as JSON to ``out`` (with the device and core count)."""
    import json

    pool = statistics.median(runs["thread pool"])
    print(f"# {device_name()}, {os.cpu_count()} cores; {heading}")
    print("| runner | median s | p95 s | / thread pool | rounds |")
    print("|---|---:|---:|---:|---|")
    rows = []
    for name, values in runs.items():
        row = {"runner": name, "median_s": statistics.median(values), "p95_s": p95(values), "runs_s": values}
        row["over_thread_pool"] = row["median_s"] / pool
        rows.append(row)
        print(
            f"| {name} | {row['median_s']:.3f} | {row['p95_s']:.3f} | {row['over_thread_pool']:.2f} |"
            f" {', '.join(f'{v:.3f}' for v in values)} |"
        )
    if out:
        with open(out, "w") as f:
            json.dump(
                {"device": device_name(), "cores": os.cpu_count(), "tasks": tasks, "rows": rows}, f, indent=1
            )
