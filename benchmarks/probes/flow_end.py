"""Where a flow run's time goes around its tasks, joining a running cluster on the
README's default (embedded SQLite server, fresh PREFECT_HOME): the flow process's steps
from the call to the first result and from the last result to the return, each timed
by wrapping it in this process.

    python benchmarks/probes/flow_end.py [runs]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import use_readme_default  # noqa: E402

use_readme_default("flow-end")

import functools  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import prefect.flow_engine as flow_engine  # noqa: E402
import prefect_dask  # noqa: E402
from prefect import flow, task  # noqa: E402
from prefect.artifacts import Artifact  # noqa: E402
from prefect.client.orchestration import SyncPrefectClient  # noqa: E402

from prefect_gpu_dask import GPUDaskTaskRunner, gpu_available  # noqa: E402
from prefect_gpu_dask.flow import cluster, recycling, reporting, runner, sizing  # noqa: E402

RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
TIMES: dict[str, list[float]] = {}


class Sampler:
    """The main thread's stack every 2 ms while ``on``: where a flow run's end waits."""

    def __init__(self) -> None:
        import collections
        import threading

        self.on = threading.Event()
        self.stacks: collections.Counter = collections.Counter()
        self.main = threading.get_ident()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        import traceback

        while True:
            self.on.wait()
            frame = sys._current_frames().get(self.main)
            if frame is not None:
                stack = traceback.extract_stack(frame)[-8:]
                where = (f"{f.name}@{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(stack))
                self.stacks[" <- ".join(where)] += 1
            time.sleep(0.002)


SAMPLER = Sampler()


def timed(owner: object, name: str, label: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            TIMES.setdefault(label, []).append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


for owner, name in (
    (SyncPrefectClient, "create_flow_run"),
    (flow_engine.FlowRunEngine, "set_state"),
    (cluster, "start_or_join"),
    (prefect_dask.DaskTaskRunner, "__enter__"),
    (prefect_dask.DaskTaskRunner, "__exit__"),
    (reporting, "publish_artifacts"),
    (reporting.LivePublisher, "close"),
    (recycling.Recycler, "close"),
    (runner, "unsubscribe"),
    (sizing, "remember"),
    (Artifact, "create"),
):
    timed(owner, name, f"{getattr(owner, '__name__', owner)}.{name}")


@task(tags=["gpu"])
def noop(i: int) -> int:
    return i


@flow(task_runner=GPUDaskTaskRunner())
def joined() -> tuple[float, float]:
    body = time.perf_counter()
    futures = [noop.submit(i) for i in range(3)]
    assert [f.result() for f in futures] == [0, 1, 2]
    sys.modules[__name__].SAMPLER.on.set()  # not a global of the flow: the flow is pickled
    return body, time.perf_counter()


if __name__ == "__main__":
    cli = [sys.executable, "-m", "prefect_gpu_dask", "cluster"]
    extra = [] if gpu_available() else ["--workers", "2", "--threads-per-worker", "4", "--resources", "GPU=4"]
    subprocess.run([*cli, "start", *extra], check=True, capture_output=True)
    try:
        joined()
        SAMPLER.on.clear()
        SAMPLER.stacks.clear()
        TIMES.clear()
        to_body, to_return = [], []
        for _ in range(RUNS):
            call = time.perf_counter()
            body, last = joined()
            SAMPLER.on.clear()
            to_body.append(body - call)
            to_return.append(time.perf_counter() - last)
    finally:
        subprocess.run([*cli, "stop", "--force"], capture_output=True)
    print(f"# {RUNS} flow runs of three trivial gpu tasks joining the host cluster (median, ms, and each)")
    rows = {"call -> flow body": to_body, "last result -> return": to_return, **TIMES}
    for label, values in rows.items():
        each = [round(v * 1e3) for v in values]
        print(f"{label:40s} {statistics.median(values) * 1e3:7.0f}  n={len(values)} {each}")
    print("# where the main thread was from the last result to the return (2 ms samples, top 12)")
    for stack, count in SAMPLER.stacks.most_common(12):
        print(f"{count:5d}  {stack}")
