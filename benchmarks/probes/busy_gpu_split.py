"""The speed-cube through the runner on both GPUs of a two-GPU host while another
process keeps the second GPU busy (CuPy matrix products in a loop, as another
deployment's job would): how long one ``gpu`` task's ``compute_on_gpus`` takes when one
GPU is slower than the other. Run it against two packages in turn with
``benchmarks/ab.sh``; the default runner, the README's embedded server.

    python benchmarks/probes/busy_gpu_split.py --runs 12 [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

BUSY = """
import time, cupy
a = cupy.random.rand(8192, 8192, dtype=cupy.float32)
print("busy", flush=True)
while True:
    for _ in range(10):
        a @ a
    cupy.cuda.Device().synchronize()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--busy", type=int, default=1, help="the GPU the other process keeps busy")
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from benchmarks.sections.cube import cube_through_runner

    busy = subprocess.Popen(
        [sys.executable, "-c", BUSY],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": str(args.busy)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert busy.stdout.readline().strip() == "busy", "the busy process did not start"
        started = time.perf_counter()
        result = cube_through_runner(100_000, 10_000, args.runs, spread_of_runs=True)
        took = time.perf_counter() - started
    finally:
        busy.kill()
        busy.wait()
    print(
        f"speed-cube through the runner, both GPUs, GPU {args.busy} busy with another process,"
        f" {args.runs} warm runs: median {result['median_s']:.3f} s, p95 {result['p95_s']:.3f} s"
        f" (inside the task {result['inside_task']['median_s']:.3f} s); runs {result['runs_s']};"
        f" {took:.0f} s in all"
    )
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "busy-gpu-split.json"), "w") as f:
            json.dump(result | {"busy_gpu": args.busy}, f, indent=1)


if __name__ == "__main__":
    main()
