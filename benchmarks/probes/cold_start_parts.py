"""Where a flow process's first cluster start goes: the fork server's start, the
cluster's constructor (scheduler, then workers), each worker's own start and
registration (from Dask's log lines), the runner's plugins and the first ``gpu`` task,
on one wall clock. Run it in a fresh process with a fresh ``PREFECT_HOME``:

    PREFECT_HOME=$(mktemp -d) python benchmarks/probes/cold_start_parts.py 2>&1 | tail -40
"""

import time

T0 = time.time()
import contextlib  # noqa: E402
import multiprocessing.forkserver  # noqa: E402

import distributed  # noqa: E402
from prefect import flow, task  # noqa: E402
from prefect.context import FlowRunContext  # noqa: E402

from prefect_gpu_dask import GPUDaskTaskRunner, forkserver  # noqa: E402
from prefect_gpu_dask.flow import runner as runner_module  # noqa: E402

marks: list[tuple[float, str]] = []


def mark(name: str) -> None:
    marks.append((time.time(), name))


mark("imports done")


def timed(owner: object, name: str, before: str, after: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        mark(before)
        try:
            return original(*args, **kwargs)
        finally:
            mark(after)

    setattr(owner, name, wrapper)


timed(multiprocessing.forkserver.ForkServer, "ensure_running", "fork server: ensure_running", "… returned")
timed(distributed.LocalCluster, "__init__", "cluster constructor", "cluster constructor returned")
timed(runner_module.GPUDaskTaskRunner, "_register_plugins", "plugins", "plugins registered")
_worker_processes = forkserver.worker_processes


@contextlib.contextmanager
def worker_processes(*args, **kwargs):
    mark("worker_processes (start method, fork server)")
    with _worker_processes(*args, **kwargs) as method:
        mark(f"… {method}")
        yield method


forkserver.worker_processes = worker_processes


@task(tags=["gpu"])
def one() -> int:
    return 1


# LocalCluster silences its processes' Dask logs below WARNING unless told otherwise.
@flow(task_runner=GPUDaskTaskRunner(cluster_kwargs={"silence_logs": False}))
def first_cluster() -> None:
    mark("flow body")
    _ = FlowRunContext.get().task_runner.client  # starts the cluster
    mark("runner.client")
    one.submit().result()
    mark("first gpu task")
    with contextlib.suppress(Exception):  # packages before the context was made beside the start
        made = FlowRunContext.get().task_runner.client.run(_context_made_in_s)
        print("each worker's CUDA context, made in a thread beside its start, took:", made)


def _context_made_in_s() -> float | None:
    from prefect_gpu_dask.worker import cuda_context

    return cuda_context.made_in_s()


def clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at)) + f".{int(at % 1 * 1000):03d}"


if __name__ == "__main__":
    first_cluster()
    body = next(at for at, name in marks if name == "flow body")
    for at, name in marks:
        print(f"{clock(at)}  {at - body:+7.3f} s  {name}")
    print(f"process start {clock(T0)}; the lines of Dask above are on the same clock")
