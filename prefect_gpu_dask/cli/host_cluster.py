"""The host cluster: one long-lived cluster per user and host, for every flow run there.

``serve`` is its process (``prefect-gpu-dask cluster start --foreground``, or a service
manager's): it starts the cluster the runner would start (a ``LocalCUDACluster`` with one
worker per GPU, a CPU ``LocalCluster`` without GPUs), with TLS on every connection and a
certificate made for this run, publishes both in the user's private directory
(``host_cluster``), and closes everything on SIGTERM or SIGINT. The HTTP servers
(dashboard, ``/metrics``) of its scheduler and workers take only HTTPS clients that
present that certificate. ``start`` runs ``serve`` in the background and returns once
the cluster is ready; ``status`` and ``stop`` find it through the same file.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefect_gpu_dask import nvml
from prefect_gpu_dask.host_cluster import (
    HTTP_PRELOAD,
    HostCluster,
    dashboard_tls_config,
    find_host_cluster,
    flow_run_of_client,
    remove_credentials,
    remove_host_cluster,
    write_credentials,
    write_host_cluster,
)
from prefect_gpu_dask.private_dir import private_directory
from prefect_gpu_dask.resources import GPU_RESOURCE

logger = logging.getLogger("prefect_gpu_dask.host_cluster")

LOG_NAME = "host-cluster.log"
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
POLL_S = 0.1


class HostClusterError(RuntimeError):
    """The host cluster cannot do what was asked; the message says why and what to do."""


@dataclass(frozen=True)
class ServeOptions:
    """What ``cluster start`` passes on to ``serve``."""

    workers: int | None = None  # CPU hosts only; a GPU host has one worker per GPU
    threads_per_worker: int | None = None
    resources: dict[str, float] = field(default_factory=dict)  # e.g. GPU=1 on a CPU host, for trials
    dashboard_address: str = "127.0.0.1:8787"

    def __post_init__(self) -> None:
        for name in ("workers", "threads_per_worker"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} {value!r} must be a whole number >= 1")
        for name, amount in self.resources.items():
            if not name or not isinstance(amount, (int, float)) or isinstance(amount, bool) or amount <= 0:
                raise ValueError(f"resource {name}={amount!r} must be a name and a number > 0")

    def arguments(self) -> list[str]:
        """The same options on ``cluster start``'s command line."""
        args = ["--dashboard-address", self.dashboard_address]
        if self.workers is not None:
            args += ["--workers", str(self.workers)]
        if self.threads_per_worker is not None:
            args += ["--threads-per-worker", str(self.threads_per_worker)]
        if self.resources:
            args += ["--resources", ",".join(f"{k}={v:g}" for k, v in self.resources.items())]
        return args


def parse_resources(text: str) -> dict[str, float]:
    """``"GPU=1,FOO=2"`` -> ``{"GPU": 1.0, "FOO": 2.0}``, naming a bad entry."""
    resources: dict[str, float] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, equals, amount = entry.partition("=")
        try:
            resources[name.strip()] = float(amount) if equals else float("nan")
        except ValueError:
            raise ValueError(f"resource {entry!r} must be NAME=NUMBER") from None
        if not equals or not name.strip():
            raise ValueError(f"resource {entry!r} must be NAME=NUMBER")
    return resources


# -- the cluster's own process -------------------------------------------------------


def serve(options: ServeOptions, ready: Callable[[HostCluster], None] = lambda host: None) -> None:
    """Run the host cluster until SIGTERM or SIGINT; the discovery file goes with it."""
    # Here, not at the top: the other commands answer without importing Prefect.
    import dask
    from distributed import Client, Security

    from prefect_gpu_dask import forkserver
    from prefect_gpu_dask.flow.cluster import (
        default_cluster_class,
        is_local_cuda_cluster,
        local_cluster_config,
        local_cluster_kwargs,
        start_local_cluster,
    )
    from prefect_gpu_dask.scheduler.metrics import GPUMetrics
    from prefect_gpu_dask.worker.labels import GPULabels

    if (running := find_host_cluster()) is not None:
        raise HostClusterError(f"A host cluster already runs at {running.address} (pid {running.pid})")
    security = Security.temporary()
    cluster_class = default_cluster_class(logger)
    cuda = is_local_cuda_cluster(cluster_class)
    wanted: dict[str, Any] = {
        "security": security,
        "dashboard_address": options.dashboard_address,
        # First among each server's preloads: it runs before the server takes a connection.
        "scheduler_kwargs": {"preload": [HTTP_PRELOAD]},
        "preload": [HTTP_PRELOAD],
    }
    if not cuda and options.workers is not None:
        wanted["n_workers"] = options.workers
    if options.threads_per_worker is not None:
        wanted["threads_per_worker"] = options.threads_per_worker
    if options.resources:
        wanted["resources"] = options.resources
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    # The fork server imports what a task run needs once; each worker start then skips it.
    forkserver.worker_start_method(cuda, preload=forkserver.WORKER_PRELOAD)
    with ExitStack() as stack:
        # HTTPS for the dashboards and /metrics, with the cluster's certificate, in this
        # process for as long as the cluster runs: a nanny hands this process's settings
        # (not a copy) to each worker process it starts, restarts included.
        stack.callback(remove_credentials, security.tls_ca_file)
        https = dashboard_tls_config(*write_credentials(security.tls_ca_file, security.tls_client_key))
        stack.enter_context(dask.config.set(https))
        cluster = start_local_cluster(
            cluster_class,
            local_cluster_kwargs(cluster_class, wanted),
            stack,
            config=local_cluster_config(gpu_wait_s=None),
        )
        with Client(cluster, security=security) as client:
            client.register_plugin(GPULabels(), name=GPULabels.name)
            client.register_plugin(GPUMetrics(), name=GPUMetrics.name)
        host = HostCluster(
            address=cluster.scheduler_address,
            pid=os.getpid(),
            started_at=time.time(),
            dashboard=cluster.dashboard_link or None,
            workers=len(cluster.workers),
            gpus=nvml.visible_gpu_count() if cuda else 0,
            certificate=security.tls_ca_file,
            key=security.tls_client_key,
        )
        stack.callback(remove_host_cluster, host.pid)
        write_host_cluster(host)
        logger.info(
            "Host cluster ready at %s: %d worker(s), %d GPU(s), dashboard %s",
            host.address,
            host.workers,
            host.gpus,
            host.dashboard,
        )
        ready(host)
        while not stop.wait(1.0):
            pass
        logger.info("Stopping the host cluster at %s", host.address)


# -- what the terminal asks of it ----------------------------------------------------


def log_path() -> Path:
    return private_directory() / LOG_NAME


def start(options: ServeOptions, timeout_s: float = START_TIMEOUT_S) -> HostCluster:
    """``serve`` in a process of its own session; returns once it is ready."""
    if (running := find_host_cluster()) is not None:
        raise HostClusterError(f"A host cluster already runs at {running.address} (pid {running.pid})")
    log = log_path()
    command = [sys.executable, "-m", "prefect_gpu_dask", "cluster", "start", "--foreground"]
    with open(log, "ab") as out:
        os.chmod(log, 0o600)
        process = subprocess.Popen(
            command + options.arguments(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # not the terminal's: a closed terminal leaves it running
        )
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        if (host := find_host_cluster()) is not None and host.pid == process.pid:
            return host
        if process.poll() is not None:
            raise HostClusterError(
                f"The host cluster exited with status {process.returncode} before it was ready:\n"
                + _tail(log)
            )
        time.sleep(POLL_S)
    process.terminate()
    raise HostClusterError(f"The host cluster was not ready after {timeout_s:g} s:\n" + _tail(log))


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass(frozen=True)
class WorkerStatus:
    name: str
    address: str
    gpu: str | None  # the model, where the worker has a GPU
    gpu_memory: int | None  # bytes
    gpu_slots: float
    threads: int
    running: int
    memory_limit: int | None
    http: str | None = None  # its HTTP server (/metrics), HTTPS with the cluster's certificate


@dataclass(frozen=True)
class ClusterStatus:
    host: HostCluster
    workers: tuple[WorkerStatus, ...]
    clients: tuple[str, ...]  # every client but the one asking
    flow_runs: tuple[str, ...]  # the flow run ids among the clients
    tasks: int

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.host.describe(),
            "workers": [asdict(w) for w in self.workers],
            "clients": list(self.clients),
            "flow_runs": list(self.flow_runs),
            "tasks": self.tasks,
        }


def status(host: HostCluster) -> ClusterStatus:
    """What the running host cluster has, and who uses it."""
    from distributed import Client

    with Client(host.address, security=host.security, timeout=10, set_as_default=False) as client:
        info = client.scheduler_info(n_workers=-1)
        clients = client.run_on_scheduler(_clients_and_tasks)
        me = client.id
    workers = []
    for address, worker in sorted(info["workers"].items(), key=lambda item: str(item[1].get("name"))):
        resources = worker.get("resources", {})
        model = next((name[4:] for name in resources if name.startswith("GPU-") and name != "GPU-MEM"), None)
        workers.append(
            WorkerStatus(
                name=str(worker.get("name")),
                address=address,
                gpu=model,
                gpu_memory=int(resources["GPU-MEM"]) if "GPU-MEM" in resources else None,
                gpu_slots=float(resources.get(GPU_RESOURCE, 0)),
                threads=int(worker.get("nthreads", 0)),
                running=int(worker.get("metrics", {}).get("executing", 0)),
                memory_limit=worker.get("memory_limit"),
                http=f"https://{worker['host']}:{port}" if (port := _http_port(worker)) else None,
            )
        )
    others = tuple(c for c in clients["clients"] if c != me)
    flow_runs = tuple(sorted({run for c in others if (run := flow_run_of_client(c)) is not None}))
    return ClusterStatus(host, tuple(workers), others, flow_runs, clients["tasks"])


def _http_port(worker: dict[str, Any]) -> int | None:
    port = worker.get("services", {}).get("dashboard")
    return port if isinstance(port, int) and worker.get("host") else None


def _clients_and_tasks(dask_scheduler: Any = None) -> dict[str, Any]:
    return {
        "clients": sorted(c for c in dask_scheduler.clients if c != "fire-and-forget"),
        "tasks": len(dask_scheduler.tasks),
    }


def stop(host: HostCluster, force: bool = False, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Close the host cluster. Refused while flow runs use it, unless ``force``."""
    if not force and (users := status(host).flow_runs):
        raise HostClusterError(
            f"{len(users)} flow run(s) use the host cluster ({', '.join(users[:5])}): "
            "stop it when they are done, or pass --force"
        )
    os.kill(host.pid, signal.SIGTERM)
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        if not _alive(host.pid):
            remove_host_cluster(host.pid)
            return
        time.sleep(POLL_S)
    # Its workers close with it; one that would not is killed with its session.
    os.killpg(host.pid, signal.SIGKILL)
    remove_host_cluster(host.pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # our own child (``start`` in this process, e.g. a test) is a zombie until reaped
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True
