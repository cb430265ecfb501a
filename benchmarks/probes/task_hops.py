"""Where one task run's time around its body goes, hop by hop: the flow's submit, the
worker's entry (``run_task_run``), the start notice heard, the body, the run's end told
to the scheduler (``announce_end``), the entry's return, and the result in the flow;
milliseconds after the submit, median of ``--runs`` sequential speed-cubes (NumPy, or
CuPy on a GPU worker) through the default runner on the README default.

``--dask-intervals`` puts Dask's own batched-stream intervals back (10 ms on the
runner's client, 2 ms on each worker) for comparison with the package's prompt ones
(``worker/stream.py``).

    python benchmarks/probes/task_hops.py --runs 30
    python benchmarks/probes/task_hops.py --runs 30 --dask-intervals
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import use_readme_default  # noqa: E402

use_readme_default("task-hops")

from prefect import flow, task  # noqa: E402
from prefect.context import FlowRunContext  # noqa: E402

from flows.speed_cube import default_size, speed_cube_expr  # noqa: E402
from prefect_gpu_dask import GPUDaskTaskRunner, compute_on_gpus, gpu_available  # noqa: E402

WRAPPED = {  # (module, function) -> label, timed in each worker
    ("prefect_gpu_dask.worker.taskrun", "run_task_run"): "entry",
    ("prefect_gpu_dask.worker.taskrun", "announce_end"): "end told",
}


def install() -> None:
    """In a worker: note when each hop starts and ends, into ``taskrun._hops``."""
    import contextlib
    import importlib

    from prefect_gpu_dask.worker import recycling, taskrun

    if hasattr(taskrun, "_hops"):
        return
    hops = taskrun._hops = []
    for (module_name, name), label in WRAPPED.items():
        module = importlib.import_module(module_name)
        inner = getattr(module, name)

        def timed(*args, _inner=inner, _label=label, **kwargs):
            hops.append((f"{_label} start", time.time()))
            try:
                return _inner(*args, **kwargs)
            finally:
                hops.append((f"{_label} end", time.time()))

        setattr(module, name, timed)
    heard = recycling.HeardFirst.__call__

    @contextlib.contextmanager
    def timed_heard(self):
        hops.append(("start notice sent", time.time()))
        with heard(self):
            hops.append(("start notice heard", time.time()))
            yield

    recycling.HeardFirst.__call__ = timed_heard


def collect() -> list:
    from prefect_gpu_dask.worker import taskrun

    hops = getattr(taskrun, "_hops", [])
    taken = list(hops)
    hops.clear()
    return taken


def dask_intervals(dask_worker=None) -> None:
    """Dask's own interval on a worker's stream to the scheduler."""
    dask_worker.batched_stream.interval = 0.002


@task(tags=["gpu"])
def cube(n: int, chunk: int) -> tuple[float, float]:
    gpu = gpu_available()
    random_state = None
    if gpu:
        import cupy

        random_state = cupy.random.RandomState
    began = time.time()
    compute_on_gpus(speed_cube_expr(n, chunk, random_state, 0))
    return began, time.time()


class SchedulerMarks:
    """In the scheduler: when the task's key reached the worker and came back in memory."""

    name = "task-hops-marks"

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []

    def transition(self, key, start, finish, *args, **kwargs) -> None:
        if finish in ("processing", "memory"):
            self.marks.append((f"scheduler: {finish}", time.time()))


@flow(task_runner=GPUDaskTaskRunner())
def hops(runs: int, restore: bool) -> dict[str, list[float]]:
    from distributed.diagnostics.plugin import SchedulerPlugin

    client = FlowRunContext.get().task_runner.client
    client.run(install)
    marks_plugin = type("Marks", (SchedulerMarks, SchedulerPlugin), {})()
    scheduler = getattr(getattr(FlowRunContext.get().task_runner, "_cluster", None), "scheduler", None)
    if scheduler is not None:  # a local cluster's scheduler runs in this process
        scheduler.add_plugin(marks_plugin)
    if restore:
        from prefect_gpu_dask import _compat

        _compat.send_promptly = lambda *args, **kwargs: False  # each submission would lower it again
        client.scheduler_comm.interval = 0.01
        client.run(dask_intervals)
    n, chunk = default_size(gpu_available())
    rows: dict[str, list[float]] = {}
    for run in range(runs + 3):  # three warm-up runs
        client.run(collect)
        marks_plugin.marks.clear()
        submitted = time.time()
        future = cube.submit(n, chunk)
        done: list[float] = []
        future.wrapped_future.add_done_callback(lambda _, done=done: done.append(time.time()))
        began, ended = future.result()
        returned = time.time()
        marks = {"body": began, "body end": ended, "result in the flow": returned}
        if done:
            marks["Dask future done"] = done[0]
        for label, at in marks_plugin.marks:
            marks.setdefault(label, at)
        for hop_list in client.run(collect).values():
            for label, at in hop_list:
                marks.setdefault(label, at)
        if run >= 3:
            for label, at in marks.items():
                rows.setdefault(label, []).append(1000 * (at - submitted))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--dask-intervals", action="store_true")
    args = parser.parse_args()
    rows = hops(args.runs, args.dask_intervals)
    intervals = "Dask's batched-stream intervals" if args.dask_intervals else "the package's prompt streams"
    print(f"# {args.runs} speed-cubes one after another, {intervals}; ms after the submit, median")
    for label, values in sorted(rows.items(), key=lambda item: statistics.median(item[1])):
        print(f"{label:24s} {statistics.median(values):9.2f}")


if __name__ == "__main__":
    main()
