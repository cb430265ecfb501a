"""How a ``compute_on_gpus`` share reaches another worker and comes back: as a Dask task
(through the scheduler both ways) or sent straight to a worker that serves shares
(``ShareServer``). CPU only: sleeps stand for GPU kernels.

1. Round trip of a no-op share, from a task on one worker to the other and back.
2. A 64-chunk cube whose chunks each sleep ``--chunk-ms`` on two workers of one thread
   (one "GPU" each): ``compute_on_gpus`` from a task, on a cluster whose workers serve
   shares and on one whose workers do not, alternating.

    python benchmarks/probes/share_paths.py --calls 40 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import dask.array as da
from distributed import Client, LocalCluster, worker_client
from distributed.protocol import pickle

from prefect_gpu_dask import compute_on_gpus
from prefect_gpu_dask.resources import scheduler_identity
from prefect_gpu_dask.worker import compute


def p95(values: list[float]) -> float:
    return sorted(values)[int(0.95 * len(values))]


def round_trips(other: str, n: int) -> tuple[list[float], list[float]]:
    """From a task: a no-op share on ``other`` as a task, then sent straight, ``n`` times each."""
    part, outputs = pickle.dumps({}), []
    as_task, straight = [], []
    with worker_client() as client:
        for _ in range(n):
            start = time.perf_counter()
            client.submit(compute._run_part, part, outputs, workers=[other], pure=False).result()
            as_task.append(time.perf_counter() - start)
            start = time.perf_counter()
            answer, _ = compute._ask(other, part, outputs)
            assert compute._answered(answer) is not compute._NOT_SERVED
            straight.append(time.perf_counter() - start)
    return as_task, straight


def slow_cube(seed: int, chunk_s: float):
    def kernel(block):
        time.sleep(chunk_s)
        return block

    x = da.random.RandomState(seed).normal(10, 1, size=(800, 800), chunks=(100, 100))
    return (x.map_blocks(kernel)[::2, ::2] + 1).mean()


def timed_cube(seed: int, chunk_s: float) -> float:
    start = time.perf_counter()
    compute_on_gpus(slow_cube(seed, chunk_s))
    return time.perf_counter() - start


def serving(client: Client) -> None:
    client.register_plugin(compute.ShareServer(), name=compute.ShareServer.name)
    while len(compute.serving_shares(scheduler_identity(client)["workers"])) < 2:
        time.sleep(0.1)


def cube_calls(serve: bool, calls: int, chunk_s: float) -> list[float]:
    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address="127.0.0.1:0") as cluster:
        with Client(cluster) as client:
            if serve:
                serving(client)
            runs = [client.submit(timed_cube, i, chunk_s, pure=False).result() for i in range(calls + 2)]
    return runs[2:]  # after two warm-up calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trips", type=int, default=200)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunk-ms", type=float, default=5.0)
    args = parser.parse_args()
    with LocalCluster(n_workers=2, threads_per_worker=2, dashboard_address="127.0.0.1:0") as cluster:
        with Client(cluster) as client:
            serving(client)
            here, other = sorted(scheduler_identity(client)["workers"])
            trips = client.submit(round_trips, other, args.trips, workers=[here], pure=False).result()
    print(f"no-op share round trip, {args.trips} each (ms): median, p95")
    labels = ("as a task (scheduler both ways)", "sent straight (ShareServer)")
    for label, values in zip(labels, trips, strict=True):
        print(f"  {label:34s}{statistics.median(values) * 1e3:7.2f} {p95(values) * 1e3:7.2f}")
    chunk_s = args.chunk_ms / 1e3
    print(f"64-chunk cube, {args.chunk_ms:g} ms a chunk, two one-thread workers, {args.calls} calls (s):")
    print("  median, p95")
    for round_ in range(args.rounds):
        for serve in (False, True):
            runs = cube_calls(serve, args.calls, chunk_s)
            label = "sent straight" if serve else "as tasks     "
            print(f"  round {round_ + 1}, {label}   {statistics.median(runs):.4f} {p95(runs):.4f}")


if __name__ == "__main__":
    main()
