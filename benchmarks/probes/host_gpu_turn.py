"""What a ``gpu`` task run pays for its cluster's turn on its GPU when nobody else wants
it: ``HostGPUClaim.acquire`` + ``release`` in one thread, the first call (which opens
the files) apart. Prints a line and writes JSON (``--out``).

    python benchmarks/probes/host_gpu_turn.py --out turn.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from prefect_gpu_dask.worker.host_gpu_lock import HostGPUClaim


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="gpu-turns-"))
    claim = HostGPUClaim("GPU-probe", "tcp://127.0.0.1:1", directory=directory)
    first = time.perf_counter()
    claim.acquire()
    claim.release()
    first_s = time.perf_counter() - first
    took = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        claim.acquire()
        claim.release()
        took.append(time.perf_counter() - started)
    took.sort()
    result = {
        "probe": "host_gpu_turn",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "rounds": args.rounds,
        "first_us": round(first_s * 1e6, 1),
        "median_us": round(statistics.median(took) * 1e6, 1),
        "p95_us": round(took[int(0.95 * len(took))] * 1e6, 1),
    }
    print(" ".join(f"{k}={v}" for k, v in result.items()))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
