"""Whether another process's idle CUDA context on the same GPU slows the speed-cube: raw
Dask threads in a plain spawned process, alone on the GPU and beside a process that
holds a context (and a few GiB in CuPy's pool) but runs nothing, alternating over
``--rounds`` rounds of ``--runs`` runs; and which processes hold a context on the GPU
while a ``gpu`` task of the default runner runs (NVML's compute processes).

    python benchmarks/probes/gpu_neighbour.py --rounds 6 --runs 5
"""

import argparse
import concurrent.futures
import multiprocessing
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import use_readme_default  # noqa: E402
from benchmarks.probes.worker_bisect import cube_times  # noqa: E402

use_readme_default("gpu-neighbour")

# A context with 4 GiB left in CuPy's pool, then idle until its stdin closes.
HOLD = "import cupy, sys; x = cupy.ones(2**29); del x; print('ready', flush=True); sys.stdin.read()"


def compute_processes() -> list[str]:
    """Each process holding a context on GPU 0: its pid, command and memory."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    rows = []
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        try:
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode()[:90]
        except OSError:
            command = "?"
        who = "this" if p.pid == os.getpid() else "other"
        rows.append(f"pid {p.pid} ({who}), {p.usedGpuMemory} B: {command}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    from prefect import flow, task

    from prefect_gpu_dask import GPUDaskTaskRunner, gpu_available

    if not gpu_available():
        sys.exit("gpu_neighbour.py needs a GPU and CuPy")

    @flow(task_runner=GPUDaskTaskRunner())
    def listing() -> list[str]:
        return task(tags=["gpu"])(compute_processes).submit().result()

    print("# processes with a context on GPU 0 during a gpu task of the default runner")
    for row in listing():
        print(" ", row)

    spawn = multiprocessing.get_context("spawn")
    times: dict[str, list[float]] = {"alone": [], "beside an idle context": []}
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as child:
        for round_ in range(args.rounds):
            for name in times if round_ % 2 == 0 else reversed(list(times)):
                if name == "alone":
                    times[name].extend(child.submit(cube_times, args.runs).result())
                    continue
                with subprocess.Popen(
                    [sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
                ) as holder:
                    assert holder.stdout.readline().strip() == "ready"
                    times[name].extend(child.submit(cube_times, args.runs).result())
                    holder.stdin.close()
    print(f"# raw Dask threads, a plain process; {args.rounds} rounds x {args.runs} runs, alternating; ms")
    alone = statistics.median(times["alone"])
    for name, values in times.items():
        median = statistics.median(values)
        least = 1000 * min(values)
        print(f"{name:28s} median {1000 * median:7.1f}  min {least:7.1f}  / alone {median / alone:.3f}")


if __name__ == "__main__":
    main()
