"""What a library's first use leaves in a process's GPU memory, outside every allocator.

Each library runs in a fresh process (so its first use is really the first), on the
process's GPU: NVML's per-process figure before, after the first call, after the same
call again on the same thread, and after a first call on a new thread; CuPy's and
torch's pools are flushed before each reading, so what remains is the library's own.
Prints a table and writes JSON:

    python benchmarks/probes/library_first_use.py --out benchmarks/results/first-use.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading

WORK = {
    "cuda-context (cupy)": "import cupy; cupy.cuda.runtime.memGetInfo()",
    "cublas (cupy matmul)": "import cupy; a = cupy.ones((1024, 1024), cupy.float32); (a @ a).sum().item()",
    "cusolver (cupy svd)": (
        "import cupy; a = cupy.ones((2048, 256)); cupy.linalg.svd(a, full_matrices=False)[1].sum().item()"
    ),
    "cufft (cupy fft)": "import cupy; cupy.fft.fft(cupy.ones(1 << 20)).sum().item()",
    "curand (cupy random)": "import cupy; cupy.random.default_rng(0).standard_normal(1 << 20).sum().item()",
    "torch matmul": "import torch; a = torch.ones(1024, 1024, device='cuda'); (a @ a).sum().item()",
}


def measure(code: str) -> dict[str, int]:
    """In this (fresh) process: context first, then the library's first and later uses."""
    import os

    import cupy
    import pynvml

    from prefect_gpu_dask import nvml
    from prefect_gpu_dask.worker.guard import release_allocator_caches

    cupy.cuda.runtime.memGetInfo()  # the context is no library's cost (except the first row's)
    handle = nvml.worker_device_handle()

    def used() -> int:
        release_allocator_caches()
        return nvml.process_memory(handle, os.getpid())

    pynvml.nvmlInit()
    readings = {"context": used()}
    exec(code, {})
    readings["first"] = used()
    exec(code, {})
    readings["again_same_thread"] = used()
    thread = threading.Thread(target=exec, args=(code, {}))
    thread.start()
    thread.join()
    readings["first_on_new_thread"] = used()
    return readings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--one")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(WORK[args.one])))
        return
    rows = {}
    for name in WORK:
        done = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True)
        if done.returncode:
            rows[name] = {"error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        rows[name] = {
            "first_use_mib": round((r["first"] - r["context"]) / 2**20, 1),
            "again_same_thread_mib": round((r["again_same_thread"] - r["first"]) / 2**20, 1),
            "new_thread_mib": round((r["first_on_new_thread"] - r["again_same_thread"]) / 2**20, 1),
            "context_mib": round(r["context"] / 2**20, 1),
        }
    print(f"{'library':<24} {'first use':>10} {'again':>8} {'new thread':>11} {'context':>9}  (MiB)")
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:<24} error: {row['error']}")
        else:
            print(
                f"{name:<24} {row['first_use_mib']:>10} {row['again_same_thread_mib']:>8} "
                f"{row['new_thread_mib']:>11} {row['context_mib']:>9}"
            )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
