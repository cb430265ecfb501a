"""Where a LocalCUDACluster worker's start goes after its fork: what the fork server has
imported (timed here, in this fresh process, as the server does it), then the worker's
own steps up to its CUDA context: importing dask-cuda and its ``initialize`` preload,
distributed's check for an existing context, and the context itself (what
``dask_cuda.initialize`` does with ``--create-cuda-context``). One GPU per process:

    for i in 1 2 3; do CUDA_VISIBLE_DEVICES=0 python benchmarks/probes/worker_cuda_start.py; done
    CUDA_VISIBLE_DEVICES=0 python benchmarks/probes/worker_cuda_start.py &
    CUDA_VISIBLE_DEVICES=1 python benchmarks/probes/worker_cuda_start.py; wait
"""

import importlib
import os
import time

steps: list[tuple[str, float]] = []


def timed(name: str, fn) -> None:
    start = time.perf_counter()
    fn()
    steps.append((name, time.perf_counter() - start))


if __name__ == "__main__":
    from prefect_gpu_dask.forkserver import WORKER_PRELOAD

    timed("the fork server's imports", lambda: [importlib.import_module(m) for m in WORKER_PRELOAD])
    timed("import dask_cuda", lambda: importlib.import_module("dask_cuda"))
    timed("import dask_cuda.initialize", lambda: importlib.import_module("dask_cuda.initialize"))
    from distributed.diagnostics.nvml import has_cuda_context

    timed("has_cuda_context (NVML init, process list)", has_cuda_context)
    from cuda.core import Device

    timed("cuda.core Device()", Device)
    timed("Device().set_current() (cuInit, primary context)", lambda: Device().set_current())
    timed("has_cuda_context again", has_cuda_context)
    total = sum(seconds for _, seconds in steps)
    print(f"# pid {os.getpid()} CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}")
    for name, seconds in steps:
        print(f"{seconds * 1000:9.1f} ms  {name}")
    print(f"{total * 1000:9.1f} ms  in all")
