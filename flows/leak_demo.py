"""The GPU memory guard at work: a task leaks on purpose and its worker is recycled.

``leak`` keeps a CuPy array (512 MiB by default) alive in a module-level list of the
worker process. The runner's guard (``leak_threshold="256MiB"``) sees the task
leave that much behind on its GPU, and the runner restarts that worker once it is
idle: the worker comes back as a new process, with the memory back. The flow asserts
exactly that, asking the worker for its pid for up to ``timeout_s`` seconds.

Without a GPU nothing can leak GPU memory: ``leak`` logs that and keeps nothing,
the guard is a no-op, and the flow asserts only that every task still completes.

    python flows/leak_demo.py
"""

from __future__ import annotations

import os

# Before Prefect is imported: the embedded API server may need more than Prefect's
# default 20 s to start on a small, busy machine, and an offline host cannot send
# the server's telemetry (each failed attempt logs an error).
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

import os
import sys
import time
import types
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.context import FlowRunContext

from prefect_gpu_dask import GPUDaskTaskRunner, gpu_available

MiB = 2**20
LEAK_THRESHOLD = "256MiB"
LEAK_THRESHOLD_BYTES = 256 * MiB
_HOLDER = "_prefect_gpu_dask_leak_demo"


def kept() -> list:
    """The module-level list of leaked arrays in *this* process.

    Looked up in ``sys.modules`` rather than through this module's globals: run as
    ``python flows/leak_demo.py`` the tasks travel to the workers by value, each call
    with a fresh copy of the globals, and a list there would die with the task.
    """
    holder = sys.modules.get(_HOLDER)
    if holder is None:
        holder = sys.modules[_HOLDER] = types.ModuleType(_HOLDER)
        holder.KEPT = []
    return holder.KEPT


def _where() -> dict[str, Any]:
    import distributed

    try:
        worker = str(distributed.get_worker().name)
    except ValueError:
        worker = None
    return {"pid": os.getpid(), "worker": worker, "device": "GPU" if gpu_available() else "CPU"}


@task(tags=["gpu"])
def leak(mib: int) -> dict[str, Any]:
    """Keep ``mib`` MiB of GPU memory alive after returning: a bug, on purpose."""
    where = _where()
    if where["device"] == "GPU":
        import cupy

        kept().append(cupy.ones(mib * MiB // 8, dtype=cupy.float64))
        where["leaked_bytes"] = mib * MiB
    else:
        get_run_logger().info("No GPU on this worker: nothing to leak, skipping the leak")
        where["leaked_bytes"] = 0
    return where


@task(tags=["gpu"])
def whoami() -> dict[str, Any]:
    """Which process and worker a ``gpu`` task runs in."""
    return _where()


def _pid_of(client: Any, worker_name: str) -> int | None:
    """The PID of the Dask worker called ``worker_name``, None while it is away."""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    address = next((a for a, w in workers.items() if str(w["name"]) == worker_name), None)
    if address is None:
        return None
    pid = client.run(os.getpid, workers=[address], on_error="return").get(address)
    return pid if isinstance(pid, int) else None  # a worker mid-restart may not answer


@flow(name="leak-demo", task_runner=GPUDaskTaskRunner(leak_threshold=LEAK_THRESHOLD))
def leak_demo(mib: int = 512, timeout_s: float = 60.0) -> dict[str, Any]:
    """One leaking ``gpu`` task; asserts (on a GPU) that its worker comes back as a new process."""
    if mib * MiB <= LEAK_THRESHOLD_BYTES:
        raise ValueError(f"mib={mib}: a leak must exceed the {LEAK_THRESHOLD} threshold to be caught")
    logger = get_run_logger()
    runner = FlowRunContext.get().task_runner
    leaked = leak.submit(mib).result()
    report: dict[str, Any] = {"device": leaked["device"], "leaked": leaked, "restarted": False}
    if leaked["device"] != "GPU":
        after = whoami.submit().result()
        guard_on = bool(getattr(runner, "_guard_on", False))
        assert after["device"] == "CPU", after
        assert not guard_on, "the GPU memory guard is on in a cluster without GPUs"
        logger.info(
            "No GPU: the GPU memory guard is a no-op here; the flow completed "
            "(leak task in pid %s, next gpu task in pid %s)",
            leaked["pid"],
            after["pid"],
        )
        report.update(after=after, guard="no-op")
        return report

    # Ask the leaking worker itself (its name survives a nanny restart): on a multi-GPU
    # host the next gpu task would likely land on another, idle, GPU.
    deadline = time.monotonic() + timeout_s
    after = leaked
    while time.monotonic() < deadline:
        after = {"worker": leaked["worker"], "pid": _pid_of(runner.client, leaked["worker"])}
        if after["pid"] not in (None, leaked["pid"]):
            report["restarted"] = True
            break
        time.sleep(0.1)
    report.update(after=after, guard="on", restart_s=timeout_s - (deadline - time.monotonic()))
    assert report["restarted"], (
        f"worker {leaked['worker']!r} (pid {leaked['pid']}) leaked {mib} MiB "
        f"(threshold {LEAK_THRESHOLD}) but was not restarted within {timeout_s} s"
    )
    logger.info(
        "The guard caught the %d MiB leak: worker %s went from pid %s to pid %s in %.1f s",
        mib,
        leaked["worker"],
        leaked["pid"],
        after["pid"],
        report["restart_s"],
    )
    return report


if __name__ == "__main__":
    print(leak_demo())
