"""What one guard reading costs, call by call, on this host's first GPU.

The guard samples twice per task; each sample is two NVML calls (device memory, the
compute-process list). This prints the median of each, and of CUDA's own
``cudaMemGetInfo`` for comparison, so a change to the guard's reads can be predicted
before it is measured end to end.
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")

from prefect_gpu_dask import nvml  # noqa: E402
from prefect_gpu_dask.worker.probe import open_probe  # noqa: E402


def median_us(fn, n=3000):
    for _ in range(100):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    import cupy

    cupy.zeros(1)  # a CUDA context, as a worker that ran a GPU task has
    probe = open_probe()
    handle = nvml.worker_device_handle()
    pid = os.getpid()
    rows = {
        "nvmlDeviceGetMemoryInfo": lambda: nvml.device_memory(handle),
        "compute-process list (v3, one call)": lambda: nvml.process_memory(handle, pid),
        "NvmlProbe.sample (both)": probe.sample,
        "cudaMemGetInfo": cupy.cuda.runtime.memGetInfo,
    }
    for name, fn in rows.items():
        print(f"{name:40s} {median_us(fn):8.1f} µs", flush=True)


if __name__ == "__main__":
    main()
