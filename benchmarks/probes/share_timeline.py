"""Where a ``gpu`` task's ``compute_on_gpus`` time goes on two or more GPUs, on the
package's own path: the calling worker's steps (the graph optimised, split, the shares
sent straight to their workers, the head start, its own share, each answer, the join)
and each serving worker's (its share's start, compute and end), on one wall clock.
The probe wraps ``worker/compute.py``'s functions in every worker for the run; the
package itself times nothing. On a GPU host, the default runner's cluster:

    python benchmarks/probes/share_timeline.py --runs 10
    python benchmarks/probes/share_timeline.py --cpu --n 4000 --chunk 500   # no GPU: NumPy chunks

``--switch-interval 0.001`` sets the workers' GIL switch interval (Python's is 5 ms).
``--sync`` also waits, after each share's Python returns, for its GPU to finish what it
queued ("… GPU idle"): CuPy's kernels run behind the thread that launched them.
Each step's thread CPU time and the garbage collections' pauses are listed after the
timeline: a step whose wall time is well above its CPU time waited (for the GIL, a lock).
"""

import argparse
import inspect
import json
import os
import statistics
import threading
import time

# Before Prefect is imported, as the seed flows do: the embedded server may start slowly.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from prefect import flow, task  # noqa: E402
from prefect.context import FlowRunContext  # noqa: E402

from prefect_gpu_dask import GPUDaskTaskRunner, compute_on_gpus  # noqa: E402

SYNC_VARIABLE = "SHARE_TIMELINE_SYNC"  # read in the workers, which inherit it
SWITCH_VARIABLE = "SHARE_TIMELINE_SWITCH_INTERVAL_S"  # the workers' GIL switch interval, where set
WRAPPED = {  # (module, function) -> label
    ("prefect_gpu_dask._compat", "finalized_graph"): "optimise",
    ("prefect_gpu_dask.worker.compute", "split_graph"): "split",
    ("prefect_gpu_dask.worker.compute", "_ask"): "send",
    ("prefect_gpu_dask.worker.compute", "_head_start"): "head start",
    ("prefect_gpu_dask.worker.compute", "_compute_part"): "share",
    ("prefect_gpu_dask.worker.compute", "_answered"): "answer",
    ("prefect_gpu_dask.worker.compute", "_run_part"): "served share",
    # The answer's way back: read by the calling worker's event loop, its values made
    # again on the calling GPU, the pieces joined there.
    ("prefect_gpu_dask._compat", "ask_worker"): "sent and answered",
    ("prefect_gpu_dask.worker.compute", "_share_values"): "answer's values",
    ("dask", "get"): "join",
}


def install(dask_worker=None) -> None:
    """In a worker: time each function of ``WRAPPED`` into ``compute._probe_events``."""
    import functools
    import importlib

    from prefect_gpu_dask.worker import compute

    if hasattr(compute, "_probe_events"):
        return
    if interval := os.environ.get(SWITCH_VARIABLE):
        import sys

        sys.setswitchinterval(float(interval))
    compute._probe_events = []
    for (module_name, name), label in WRAPPED.items():
        module = importlib.import_module(module_name)
        inner = getattr(module, name)
        if inspect.iscoroutinefunction(inner):
            setattr(module, name, functools.wraps(inner)(_timed_coroutine(inner, label)))
            continue

        def timed(*args, _inner=inner, _label=label, **kwargs):
            thread = threading.current_thread().name
            if _label == "answer":  # when the event loop hands the answer to this thread
                args[0].add_done_callback(
                    lambda _: compute._probe_events.append(
                        ("answer handed over", "end", time.time(), threading.current_thread().name)
                    )
                )
            compute._probe_events.append((_label, "start", time.time(), thread))
            cpu = time.thread_time()
            try:
                return _inner(*args, **kwargs)
            finally:
                compute._probe_events.append((_label, "end", time.time(), thread))
                compute._probe_events.append((_label, "cpu", time.thread_time() - cpu, thread))
                if _label == "share" and os.environ.get(SYNC_VARIABLE):
                    import cupy

                    cupy.cuda.Device().synchronize()
                    compute._probe_events.append(("share's GPU idle", "end", time.time(), thread))

        setattr(module, name, functools.wraps(inner)(timed))
    _time_share_handler(dask_worker)
    _time_collections()


def _time_collections() -> None:
    """Each garbage collection's pause, as two events: a thread holds the GIL for it."""
    import gc

    from prefect_gpu_dask.worker import compute

    def noted(phase: str, info: dict) -> None:
        label = f"gc gen{info['generation']}"
        edge = "gc start" if phase == "start" else "gc end"
        compute._probe_events.append((label, edge, time.time(), threading.current_thread().name))

    gc.callbacks.append(noted)


def _timed_coroutine(inner, label):
    from prefect_gpu_dask.worker import compute

    async def timed(*args, **kwargs):
        thread = threading.current_thread().name
        compute._probe_events.append((label, "start", time.time(), thread))
        try:
            return await inner(*args, **kwargs)
        finally:
            compute._probe_events.append((label, "end", time.time(), thread))

    return timed


def _time_share_handler(worker) -> None:
    """The serving worker's handler, already registered: its end is when the answer
    goes out, after the share's thread hands its values back to the event loop."""
    import functools

    from prefect_gpu_dask.worker import compute

    handlers = worker.handlers
    if (serve := handlers.get(compute.SHARE_OP)) is not None:
        handlers[compute.SHARE_OP] = functools.wraps(serve)(_timed_coroutine(serve, "served answer"))


def collect() -> list:
    from prefect_gpu_dask.worker import compute

    events, compute._probe_events[:] = list(compute._probe_events), []
    return events


def the_cube(n: int, chunk: int, gpu: bool):
    import dask.array as da

    if gpu:
        import cupy

        random = da.random.RandomState(RandomState=cupy.random.RandomState)
    else:
        random = da.random.RandomState()
    x = random.normal(10, 1, (n, n), chunks=chunk)
    return (x[::2, ::2] + 1).mean()


def cube_body(n: int, chunk: int, gpu: bool) -> float:
    from prefect_gpu_dask.worker import compute

    events = compute._probe_events
    events.append(("task", "start", time.time(), threading.current_thread().name))
    (mean,) = compute_on_gpus(the_cube(n, chunk, gpu))
    events.append(("compute_on_gpus", "end", time.time(), threading.current_thread().name))
    mean = float(mean)
    events.append(("task", "end", time.time(), threading.current_thread().name))
    assert abs(mean - 11) < 0.01, mean
    return mean


def alone(n: int, chunk: int, gpu: bool) -> float:
    """The cube on this worker's GPU alone, as ``compute_on_gpus`` runs a share: the
    threads scheduler with the worker's thread count."""
    import dask
    from distributed import get_worker

    start = time.perf_counter()
    (mean,) = dask.compute(
        the_cube(n, chunk, gpu), scheduler="threads", num_workers=get_worker().state.nthreads
    )
    assert abs(float(mean) - 11) < 0.01, mean
    return time.perf_counter() - start


@task(tags=["gpu"])
def cube(n: int, chunk: int, gpu: bool = True) -> float:
    return cube_body(n, chunk, gpu)


def visible_gpu() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "cpu").split(",")[0]


@flow(task_runner=GPUDaskTaskRunner())
def timelines(runs: int, n: int, chunk: int, gpu: bool) -> tuple[list[dict[str, list]], dict[str, dict]]:
    client = FlowRunContext.get().task_runner.client
    client.run(install)
    cube.submit(n, chunk, gpu).result()  # warm, on one of the workers
    client.run(collect)
    out = []
    for _ in range(runs):
        cube.submit(n, chunk, gpu).result()
        out.append(client.run(collect))
    # Each GPU alone, then the same call from a plain Dask task pinned to each worker.
    per_gpu: dict[str, dict] = {}
    for worker, name in sorted(client.run(visible_gpu).items(), key=lambda item: item[1]):

        def on(fn, worker=worker):
            return client.submit(fn, n, chunk, gpu, workers=[worker], pure=False).result()

        on(alone)
        times = [on(alone) for _ in range(runs)]
        pinned = []
        for _ in range(runs):
            on(cube_body)
            pinned.append(steps(client.run(collect)))
        per_gpu[name] = {"alone_s": times, "calling": pinned}
    return out, per_gpu


def steps(run: dict[str, list]) -> dict[str, float]:
    """Each step's start and end, seconds after the task's own start."""
    caller = next(w for w, events in run.items() if any(e[0] == "task" for e in events))
    t0 = next(t for label, edge, t, _ in run[caller] if (label, edge) == ("task", "start"))
    out: dict[str, float] = {}
    for worker, events in run.items():
        side = "caller" if worker == caller else "server"
        collecting: dict[str, float] = {}
        for label, edge, t, thread in events:
            if edge == "cpu":  # the step's thread CPU seconds, summed over its calls
                key = f"cpu: {side}: {label} (ms)"
                out[key] = out.get(key, 0.0) + t * 1e3
                continue
            if edge == "gc start":
                collecting[thread] = t
                continue
            if edge == "gc end":
                began = collecting.pop(thread, t)
                if began >= t0:  # within the task
                    key = f"gc: {side}: {label} pauses (ms)"
                    out[key] = out.get(key, 0.0) + (t - began) * 1e3
                    late = f"gc: {side}: {label} pauses after +0.25 s (ms)"
                    if began - t0 > 0.25:
                        out[late] = out.get(late, 0.0) + (t - began) * 1e3
                continue
            if thread.startswith("gpu-share"):  # a share served for another worker's task
                served = {"share": "served share's compute", "share's GPU idle": "served share's GPU idle"}
                label = served.get(label, label)
            key = f"{side}: {label} {edge}"
            # the first start and the last end of a step taken more than once
            if edge == "start":
                out[key] = min(out.get(key, t - t0), t - t0)
            else:
                out[key] = max(out.get(key, t - t0), t - t0)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--chunk", type=int, default=10_000)
    parser.add_argument("--cpu", action="store_true", help="NumPy chunks: to try the probe without a GPU")
    parser.add_argument("--sync", action="store_true", help="also time each share's GPU to its last kernel")
    parser.add_argument("--switch-interval", type=float, help="the workers' GIL switch interval, seconds")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.sync:
        os.environ[SYNC_VARIABLE] = "1"  # before the cluster starts: its workers inherit it
    if args.switch_interval:
        os.environ[SWITCH_VARIABLE] = str(args.switch_interval)
    runs, per_gpu = timelines(args.runs, args.n, args.chunk, not args.cpu)
    runs = [steps(run) for run in runs]

    def when(key: str) -> float:
        return statistics.median(run.get(key, 0.0) for run in runs)

    seen = {key for run in runs for key in run}
    keys = sorted((key for key in seen if not key.startswith(("cpu: ", "gc: "))), key=when)
    print(f"# {args.runs} runs of the speed-cube {args.n}², {args.chunk}² chunks; s after the task's start")
    print(f"{'step':45s} {'median':>8s} {'min':>8s} {'max':>8s}")
    for key in keys:
        values = [run[key] for run in runs if key in run]
        print(f"{key:45s} {statistics.median(values):8.4f} {min(values):8.4f} {max(values):8.4f}")
    print("# each step's thread CPU time, and collections' pauses within the task (ms; runs with none: 0)")
    for key in sorted(key for key in seen if key.startswith(("cpu: ", "gc: "))):
        values = [run.get(key, 0.0) for run in runs]
        name = key[key.index(" ") + 1 :]
        print(f"{name:60s} {statistics.median(values):8.2f} {min(values):8.2f} {max(values):8.2f}")
    print("# each GPU: the cube alone on it (threads scheduler, the worker's threads), and its share's")
    print("# compute when a plain Dask task pinned to its worker calls compute_on_gpus, against the other's")
    for name, seen in per_gpu.items():
        own = [r["caller: share end"] - r["caller: share start"] for r in seen["calling"]]
        served = [
            r["server: served share's compute end"] - r["server: served share's compute start"]
            for r in seen["calling"]
        ]
        print(
            f"GPU {name}: alone {statistics.median(seen['alone_s']):.4f} s; calling: its own share"
            f" {statistics.median(own):.4f} s, the other GPU's served share {statistics.median(served):.4f} s"
        )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "share-timeline.json"), "w") as f:
            json.dump({"n": args.n, "chunk": args.chunk, "runs": runs, "per_gpu": per_gpu}, f, indent=1)
