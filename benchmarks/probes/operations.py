"""The operator's commands on a real host, for docs/operations.md: a host cluster, a
flow run on it whose task leaks 512 MiB of GPU memory, then ``cluster status``,
``report``, ``doctor``, ``cluster stop``. Prints each command and its output.

    python benchmarks/probes/operations.py          # CPU: workers labelled GPU=1, scripted GPU
    python benchmarks/probes/operations.py --gpu    # a GPU host: NVML, CuPy, LocalCUDACluster
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
LEAK_BYTES = 512 * 2**20
KEPT: list = []


def command(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "prefect_gpu_dask", *args], capture_output=True, text=True)
    print(
        f"$ prefect-gpu-dask {' '.join(args)}\n{done.stdout}{done.stderr}(exit {done.returncode})\n",
        flush=True,
    )


def leak_on_gpu(nbytes: int) -> int:
    import cupy

    KEPT.append(cupy.ones(nbytes // 8))
    return nbytes


def small_on_gpu(i: int) -> int:
    import cupy

    return int(cupy.arange(1000).sum()) + i


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--gpu", action="store_true")
    args = parser.parse_args()
    os.environ["PREFECT_GPU_DASK_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="operations-")
    from benchmarks.servers import prefect_server

    with prefect_server() as api:
        os.environ["PREFECT_API_URL"] = api
        start = ["cluster", "start", "--dashboard-address", "127.0.0.1:0"]
        command(
            *start,
            *([] if args.gpu else ["--workers", "2", "--threads-per-worker", "2", "--resources", "GPU=1"]),
        )
        try:
            from prefect import flow, task
            from prefect.context import FlowRunContext

            from prefect_gpu_dask import GPUDaskTaskRunner

            if args.gpu:
                # By name, not from __main__: a task from __main__ travels by value, its KEPT with it.
                from benchmarks.probes.operations import leak_on_gpu, small_on_gpu

                clean = task(small_on_gpu, name="clean", tags=["gpu"], task_run_name="clean-{i}")
                leaky = task(leak_on_gpu, name="leaky", tags=["gpu"], task_run_name="leaky-{nbytes}")
                runner = GPUDaskTaskRunner()
            else:
                from tests.scripted_probe import FAKE_PROBE
                from tests.ui_helpers import clean, leaky

                runner = GPUDaskTaskRunner(memory_probe=FAKE_PROBE)

            @flow(name="nightly-etl", task_runner=runner)
            def nightly_etl() -> str:
                for i in range(3):
                    clean.submit(i).result()
                leaky.submit(LEAK_BYTES).wait()
                restarts, i = FlowRunContext.get().task_runner, 3
                while not restarts.restarts and i < 100:
                    clean.submit(i).result()
                    i += 1
                    time.sleep(0.1)
                return str(FlowRunContext.get().flow_run.id)

            flow_run_id = nightly_etl()
            command("cluster", "status")
            command("report", flow_run_id)
            command("doctor")
        finally:
            command("cluster", "stop")


if __name__ == "__main__":
    main()
