"""What each NVML reading a per-task activity record needs costs, on this GPU.

    python benchmarks/probes/nvml_activity_cost.py [--out FILE.json]

A thread of this process keeps the GPU busy with matmuls meanwhile. Prints a table
(median and p95 microseconds per call over 2,000 calls, and whether the call is
supported here) and writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import pynvml


def timed(call, n: int = 2000) -> dict:
    times, error = [], None
    for _ in range(n):
        start = time.perf_counter()
        try:
            call()
        except pynvml.NVMLError as exc:
            error = str(exc)
            if "Not Supported" in error:
                break
        times.append(time.perf_counter() - start)
    times.sort()
    return {
        "median_us": 1e6 * statistics.median(times) if times else None,
        "p95_us": 1e6 * times[int(0.95 * (len(times) - 1))] if times else None,
        "error": error,
    }


def keep_gpu_busy(started: threading.Event) -> None:
    import cupy

    a = cupy.random.random((4096, 4096), dtype=cupy.float32)
    while True:
        a @ a
        cupy.cuda.Device().synchronize()
        started.set()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    pynvml.nvmlInit()
    busy = threading.Event()
    threading.Thread(target=keep_gpu_busy, args=(busy,), daemon=True).start()
    busy.wait(60)  # this process runs kernels: per-process samples exist
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    since = int(time.time() * 1e6) - 1_000_000
    calls = {
        "energy (nvmlDeviceGetTotalEnergyConsumption)": lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(
            handle
        ),
        "power (nvmlDeviceGetPowerUsage)": lambda: pynvml.nvmlDeviceGetPowerUsage(handle),
        "temperature (nvmlDeviceGetTemperature)": lambda: pynvml.nvmlDeviceGetTemperature(
            handle, pynvml.NVML_TEMPERATURE_GPU
        ),
        "clock event reasons": lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle),
        "utilization rates (device, now)": lambda: pynvml.nvmlDeviceGetUtilizationRates(handle),
        "process utilization samples (last 1 s)": lambda: pynvml.nvmlDeviceGetProcessUtilization(
            handle, since
        ),
        "GPU utilization samples (device, last 1 s)": lambda: pynvml.nvmlDeviceGetSamples(
            handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, since
        ),
        "compute processes (memory, for reference)": lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(
            handle
        ),
    }
    name = pynvml.nvmlDeviceGetName(handle)
    results = {label: timed(call) for label, call in calls.items()}
    print(f"# {name}; {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
    print(f"{'reading':<48} {'median µs':>10} {'p95 µs':>10}  note")
    for label, r in results.items():
        med = "-" if r["median_us"] is None else f"{r['median_us']:.1f}"
        p95 = "-" if r["p95_us"] is None else f"{r['p95_us']:.1f}"
        print(f"{label:<48} {med:>10} {p95:>10}  {r['error'] or ''}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": str(name), "readings": results}, fh, indent=1)


if __name__ == "__main__":
    main()
