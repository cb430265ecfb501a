"""Whether the speed-cube on Dask's threads is bound by the GIL: raw Dask threads in one
process, alone and beside a thread that runs pure Python for a share of every 10 ms (as
a worker's background jobs do, in bursts), alternating over ``--rounds`` rounds of
``--runs`` runs. A GIL-bound cube slows by about the share; a GPU-bound one does not.

    python benchmarks/probes/gil_share.py --rounds 6 --runs 5 --shares 0.03,0.1
"""

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

PERIOD_S = 0.01


def busy(share: float, stop: threading.Event) -> None:
    """Python bytecode for ``share`` of every period, asleep for the rest."""
    while not stop.is_set():
        until = time.perf_counter() + share * PERIOD_S
        while time.perf_counter() < until:
            pass
        time.sleep(PERIOD_S * (1 - share))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--shares", default="0.03,0.1")
    args = parser.parse_args()

    from benchmarks.probes.worker_bisect import cube_times

    shares = [0.0] + [float(s) for s in args.shares.split(",")]
    times: dict[float, list[float]] = {s: [] for s in shares}
    cube_times(1)  # kernels, pools
    for round_ in range(args.rounds):
        for share in shares if round_ % 2 == 0 else reversed(shares):
            stop = threading.Event()
            burner = threading.Thread(target=busy, args=(share, stop), daemon=True)
            if share:
                burner.start()
            try:
                times[share].extend(cube_times(args.runs))
            finally:
                stop.set()
                if share:
                    burner.join()
    alone = statistics.median(times[0.0])
    print(f"# raw Dask threads; {args.rounds} rounds x {args.runs} runs, alternating; {os.cpu_count()} cores")
    for share, values in times.items():
        median = statistics.median(values)
        print(f"beside {share:4.0%} pure Python median {1000 * median:7.1f} ms  / alone {median / alone:.3f}")


if __name__ == "__main__":
    main()
