"""The host cluster's costs: how long the default runner takes to join it against starting
a cluster of its own, and what its TLS costs per task against a plaintext cluster of the
same shape. Prints a table and writes JSON (``--out``).

    python benchmarks/probes/host_cluster.py --out host-cluster.json

The host cluster is started as an operator would (``prefect-gpu-dask cluster start``, in
a private runtime directory); the plaintext one is a ``LocalCluster`` with the same
workers, threads and resources. Tasks are flow runs of ``--tasks`` trivial tasks
(untagged: the slot writes of ``gpu`` tags on SQLite are another benchmark's subject),
each ``--repeat`` times, against ``prefect server start`` on SQLite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def trivial(i: int) -> int:
    return i


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefect_gpu_dask", *args], capture_output=True, text=True, check=True
    )


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median_s": round(statistics.median(ordered), 4),
        "p95_s": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 4),
        "runs": [round(v, 4) for v in values],
    }


def client_time(**kwargs) -> float:
    from prefect_gpu_dask import GPUDaskTaskRunner

    runner = GPUDaskTaskRunner(**kwargs)
    with runner:
        began = time.perf_counter()
        runner.client  # noqa: B018
        return time.perf_counter() - began


def cold_client_time(join: str, api: str) -> float:
    """``client_time`` in a new Python process (imports done before the clock starts)."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from benchmarks.probes.host_cluster import client_time; "
        "print(client_time(host_cluster=sys.argv[2] == 'True'))"
    )
    env = {**os.environ, "PREFECT_API_URL": api}
    command = [sys.executable, "-c", code, str(ROOT), join]
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


def tasks_time(n: int, **kwargs) -> float:
    from prefect import flow, task
    from prefect.futures import wait

    from prefect_gpu_dask import GPUDaskTaskRunner

    work = task(trivial, name="trivial")

    @flow(task_runner=GPUDaskTaskRunner(**kwargs))
    def many() -> None:
        work.submit(-1).result()  # workers warm before the clock starts
        began = time.perf_counter()
        wait([work.submit(i) for i in range(n)])
        return time.perf_counter() - began

    return many()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--joins", type=int, default=20)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ["PREFECT_GPU_DASK_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="host-cluster-probe-")
    from benchmarks.servers import using_prefect_server

    shape = {"n_workers": args.workers, "threads_per_worker": 2, "resources": {"GPU": 1}}
    cli("cluster", "start", "--workers", str(args.workers), "--threads-per-worker", "2",
        "--resources", "GPU=1", "--dashboard-address", "127.0.0.1:0")  # fmt: skip
    try:
        with using_prefect_server() as api:
            from distributed import LocalCluster

            joins = [client_time() for _ in range(args.joins)]
            # Each in a new process, as each flow run of a process work pool is: cold.
            joins_cold = [cold_client_time("True", api) for _ in range(args.starts)]
            starts = [cold_client_time("False", api) for _ in range(args.starts)]
            tls = [tasks_time(args.tasks) for _ in range(args.repeat)]
            with LocalCluster(host="127.0.0.1", dashboard_address=":0", **shape) as plain:
                tcp = [tasks_time(args.tasks, address=plain.scheduler_address) for _ in range(args.repeat)]
    finally:
        cli("cluster", "stop", "--force")
    result = {
        "probe": "host_cluster",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "shape": shape,
        "join_host_cluster": summary(joins),
        "join_host_cluster_new_process": summary(joins_cold),
        "start_own_cluster_new_process": summary(starts),
        f"{args.tasks}_tasks_tls_host_cluster": summary(tls),
        f"{args.tasks}_tasks_tcp_local_cluster": summary(tcp),
        "tls_over_tcp": round(statistics.median(tls) / statistics.median(tcp), 3),
    }
    print(f"{'seconds':34}{'median':>10}{'p95':>10}")
    for name, value in result.items():
        if isinstance(value, dict) and "median_s" in value:
            print(f"{name:34}{value['median_s']:>10.3f}{value['p95_s']:>10.3f}")
    print(f"TLS / plaintext, {args.tasks} tasks (medians): {result['tls_over_tcp']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
