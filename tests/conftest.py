"""Real parts only: a real Prefect API server and real Dask scheduler/worker processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# No telemetry from test servers: this network reaches nothing, and its heartbeat clutters logs.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# The scripted GPU has one UUID in every worker: each test process keeps its own GPU
# turns, so two test processes never wait for each other's "GPU". Set, not defaulted:
# xdist's test processes inherit the environment of the process that started them.
os.environ["PREFECT_GPU_DASK_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="gpu-turns-")
# A worker or server process that crashes writes its Python stack to its stderr.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def has_gpu() -> bool:
    try:
        import cupy  # noqa: F401

        from prefect_gpu_dask.nvml import visible_gpu_count

        return visible_gpu_count() > 0
    except Exception:
        return False


# The longest files first, unit tests last: xdist hands out whole files in collection
# order (--dist loadfile --no-loadscope-reorder), so a long file never starts last.
LONGEST_FIRST = (
    "integration/test_fleet_soak.py",
    "integration/test_guard_restarts.py",
    "integration/test_reliability.py",
    "integration/test_shared_cluster.py",
    "integration/test_shared_host.py",
    "integration/test_recycle_loss.py",
    "integration/test_host_cluster.py",
    "integration/test_load.py",
    "integration/test_runner.py",
    "integration/test_restart_races.py",
    "integration/test_ui_browser.py",
    "integration/test_elastic.py",
    "integration/test_postgres.py",
    "integration/test_security.py",
)


def file_rank(item: pytest.Item) -> int:
    try:
        path = item.path.resolve().relative_to(ROOT / "tests").as_posix()
    except ValueError:  # collected from outside tests/
        return len(LONGEST_FIRST)
    if path in LONGEST_FIRST:
        return LONGEST_FIRST.index(path)
    return len(LONGEST_FIRST) + path.startswith("unit/")


def pytest_collection_modifyitems(config, items):
    items.sort(key=file_rank)  # stable: each file keeps its own order
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CuPy (none here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class DaskProcesses:
    """``dask scheduler`` and ``dask worker`` subprocesses on 127.0.0.1."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.address = ""

    def _spawn(self, *args: str, log: str) -> subprocess.Popen:
        env = {
            **os.environ,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_" + args[0], *args[1:]],
            stdout=open(self.tmp / log, "w"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: close() ends nanny and worker at once
        )
        self.procs.append(proc)
        return proc

    def start_scheduler(self, *extra: str) -> str:
        scheduler_file = self.tmp / "scheduler.json"
        self._spawn(
            "scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-dashboard",
            "--scheduler-file",
            str(scheduler_file),
            *extra,
            log="scheduler.log",
        )
        deadline = time.monotonic() + 60
        while True:  # the file may exist before it is written
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                self.address = json.loads(scheduler_file.read_text())["address"]
                return self.address
            if time.monotonic() > deadline:
                raise TimeoutError(f"no scheduler address in {scheduler_file} after 60 s")
            time.sleep(0.1)

    def start_worker(self, name: str, *extra: str, fork: bool = False) -> None:
        """``fork``: the nanny forks its worker processes from a preloaded server
        (``--preload-nanny prefect_gpu_dask.worker.nanny``) instead of spawning them, as a
        plain ``dask worker`` does. It costs the nanny the imports up front, which
        only restarts win back."""
        preload = ["--preload-nanny", "prefect_gpu_dask.worker.nanny"] if fork else []
        self._spawn(
            "worker",
            self.address,
            "--host",
            "127.0.0.1",
            "--name",
            name,
            "--no-dashboard",
            "--preload",
            "tests.worker_faulthandler",
            *preload,
            *extra,
            log=f"worker-{name}.log",
        )

    def wait_for_workers(self, n: int, timeout: float = 60) -> None:
        from distributed import Client

        with Client(self.address, timeout=timeout) as client:
            client.wait_for_workers(n, timeout=timeout)

    def print_thread_stacks(self, timeout: float = 10) -> None:
        """Every thread's stack in each worker process: what a hung test's workers were
        doing. Asked through ``client.run`` where a worker's event loop still answers
        within ``timeout``; every worker process also writes them to its log on SIGUSR1
        (``tests/worker_faulthandler.py``), which ``print_log_tails`` then shows."""
        import concurrent.futures

        import psutil
        from distributed import Client

        try:
            with Client(self.address, timeout=timeout) as client:
                pool = concurrent.futures.ThreadPoolExecutor(1)
                asked = pool.submit(client.run, thread_stacks, on_error="return")
                try:
                    stacks = asked.result(timeout=timeout)
                except concurrent.futures.TimeoutError:
                    stacks = {}
                    print(f"--- a worker did not answer within {timeout} s: its log has its stacks")
                pool.shutdown(wait=False)
                for address, stack in stacks.items():
                    print(f"--- threads of worker {address}", stack, sep="\n")
        except Exception as exc:
            print(f"--- no thread stacks through the scheduler: {exc!r}")
        for proc in self.procs:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        child.send_signal(signal.SIGUSR1)
        time.sleep(1)  # the dumps reach the logs

    def print_log_tails(self, lines: int = 30) -> None:
        """The end of each process's log: pytest shows it where the test failed."""
        for log in sorted(self.tmp.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            print(f"--- {log.name} (last {len(tail)} lines)", *tail, sep="\n")

    def close(self) -> None:
        """Kill every process group: a graceful close of a worker whose scheduler is
        going too spends seconds giving up on it, and nothing here is kept."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait(10)
        self.procs.clear()


def thread_stacks() -> str:
    """For ``Client.run``: this process's threads and their stacks."""
    import threading
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )


def exit_with_module_loaded(name: str) -> None:
    """For a process forked from the fork server: exit 0 where it inherited ``name``
    imported, 3 where not."""
    os._exit(0 if name in sys.modules else 3)


def worker_process_state() -> tuple[int, int, bool]:
    """For ``Client.run``: a worker process's pid, its parent's, and whether it has
    imported Prefect's task engine (this module imports nothing of Prefect's)."""
    return os.getpid(), os.getppid(), "prefect.task_engine" in sys.modules


@pytest.fixture(autouse=True)
def one_gpu_test_at_a_time(request) -> Iterator[None]:
    """GPU tests share the host's GPUs: with test processes side by side (``-n 2``), one
    filling a GPU on purpose would starve the other's. They take turns, host-wide."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    import fcntl

    with open(Path(tempfile.gettempdir()) / "prefect-gpu-dask-gpu-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def remote_cluster(tmp_path_factory) -> Iterator[DaskProcesses]:
    """A scheduler, one worker labelled GPU=1 and one plain CPU worker."""
    procs = DaskProcesses(tmp_path_factory.mktemp("dask"))
    procs.start_scheduler()
    procs.start_worker("gpu-worker", "--nthreads", "4", "--resources", "GPU=1")
    procs.start_worker("cpu-worker", "--nthreads", "4")
    procs.wait_for_workers(2)
    yield procs
    procs.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.call_failed = report.failed  # for fixtures' teardown
    return report


@pytest.fixture
def dask_processes(request, tmp_path) -> Iterator[DaskProcesses]:
    """A private set of Dask processes, for tests that kill or restart them."""
    procs = DaskProcesses(tmp_path)
    yield procs
    failed = getattr(request.node, "call_failed", False)
    if failed and procs.address:
        procs.print_thread_stacks()
    procs.close()
    procs.print_log_tails(400 if failed else 30)  # a failed test's logs hold its workers' stacks


def task_run_logs(task_run_id, containing: str = "", timeout: float = 20) -> list[str]:
    """The task run's log lines from the API; workers send logs in batches, so poll."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(LogFilter(task_run_id=LogFilterTaskRunId(any_=[task_run_id])))
            lines = [log.message for log in logs]
            if any(containing in line for line in lines) or time.monotonic() > deadline:
                return lines
            time.sleep(0.25)


def recorded_task_run(
    task_run_id, settled=lambda run: run.state is not None and run.state.is_final(), timeout=30
):
    """The task run as the API has recorded it, once ``settled(run)``: its states reach the
    server as events, which its task-run recorder writes behind them (seconds behind a burst),
    so poll, taking "not found" for "not yet"."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            try:
                run = client.read_task_run(task_run_id)
            except ObjectNotFound:
                run = None
            if (run is not None and settled(run)) or time.monotonic() > deadline:
                assert run is not None, f"the API never recorded task run {task_run_id}"
                return run
            time.sleep(0.25)
