"""What each NVML call of the guard and the health check costs, on this host's first GPU.

Around a guarded task the guard reads this process's memory before and after (the
compute-process list, and the device's memory after), and the health check reads ECC,
row remapping, clock event reasons and the Xid event queue before each ``gpu`` task.
This prints the median and p95 of each call, of the batched field-value call that could
stand for several of them, and of CUDA's own ``cudaMemGetInfo`` for comparison, so a
change to the guard's reads can be predicted before it is measured end to end.

    python benchmarks/probes/nvml_reads.py [--out FILE.json]
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")

from prefect_gpu_dask import nvml  # noqa: E402
from prefect_gpu_dask.health import NvmlHealthReader  # noqa: E402
from prefect_gpu_dask.worker.probe import open_probe  # noqa: E402


def timings_us(fn, n=3000) -> tuple[float, float]:
    for _ in range(100):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return statistics.median(times) * 1e6, times[int(0.95 * n)] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    import cupy
    import pynvml

    cupy.zeros(1)  # a CUDA context, as a worker that ran a GPU task has
    probe = open_probe()
    handle = nvml.worker_device_handle()
    pid = os.getpid()
    health = NvmlHealthReader(handle)
    events = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, events)
    wait = getattr(pynvml, "nvmlEventSetWait_v2", None) or pynvml.nvmlEventSetWait

    def xid_poll() -> None:
        try:
            wait(events, 0)
        except pynvml.NVMLError:
            pass

    fields = [
        pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL,
        pynvml.NVML_FI_DEV_REMAPPED_PENDING,
        pynvml.NVML_FI_DEV_REMAPPED_FAILURE,
        pynvml.NVML_FI_DEV_RETIRED_PENDING,
    ]
    rows = {
        "memory: nvmlDeviceGetMemoryInfo": lambda: nvml.device_memory(handle),
        "memory: compute-process list (one call)": lambda: nvml.process_memory(handle, pid),
        "memory: NvmlProbe.sample (both)": probe.sample,
        "memory: cudaMemGetInfo": cupy.cuda.runtime.memGetInfo,
        "health: ECC volatile uncorrectable": lambda: nvml.ecc_volatile_uncorrectable(handle),
        "health: remapped rows": lambda: nvml.remapped_rows(handle),
        "health: clock event reasons": lambda: nvml.clock_event_reasons(handle),
        "health: Xid event poll (none waiting)": xid_poll,
        "health: NvmlHealthReader() (all of it)": health,
        "health: field values (ECC, remap x2, retired)": lambda: pynvml.nvmlDeviceGetFieldValues(
            handle, fields
        ),
        "activity: power": lambda: nvml.power_mw(handle),
        "activity: temperature": lambda: nvml.temperature_c(handle),
        "activity: utilisation rates": lambda: nvml.utilization_percent(handle),
    }
    figures = {}
    for name, fn in rows.items():
        try:
            median, p95 = timings_us(fn)
        except pynvml.NVMLError as error:
            print(f"{name:48s} {error}", flush=True)
            continue
        figures[name] = {"median_us": round(median, 2), "p95_us": round(p95, 2)}
        print(f"{name:48s} {median:8.1f} µs  (p95 {p95:7.1f})", flush=True)
    answer = pynvml.nvmlDeviceGetFieldValues(handle, fields)
    print("field values:", [(v.fieldId, v.nvmlReturn, v.value.ullVal) for v in answer])
    pynvml.nvmlEventSetFree(events)
    if args.out:
        device = nvml.device_name(handle)
        with open(args.out, "w") as out:
            json.dump({"device": device, "date": time.strftime("%Y-%m-%d"), "calls": figures}, out, indent=2)


if __name__ == "__main__":
    main()
