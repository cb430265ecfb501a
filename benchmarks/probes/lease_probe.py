"""How long Prefect's tag-concurrency acquisition takes from 8 worker processes vs 8 threads."""

import time
from concurrent.futures import ThreadPoolExecutor


def acquire_many(n):
    from prefect.concurrency._sync import acquire_concurrency_slots_with_lease

    out = []
    for _ in range(n):
        s = time.perf_counter()
        acquire_concurrency_slots_with_lease(["tag:other"], 1, lease_duration=60, suppress_warnings=True)
        out.append(time.perf_counter() - s)
    return out


def summary(name, times):
    times = sorted(times)
    print(
        name,
        "n",
        len(times),
        f"median {times[len(times) // 2] * 1e3:.1f} ms p99 {times[int(0.99 * len(times))] * 1e3:.1f} ms",
        f"max {times[-1] * 1e3:.1f} ms total {sum(times):.1f} s",
        flush=True,
    )


if __name__ == "__main__":
    from distributed import Client, LocalCluster
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        with ThreadPoolExecutor(8) as pool:
            summary("8 threads", [t for ts in pool.map(acquire_many, [30] * 8) for t in ts])
        import os

        from prefect.settings import PREFECT_API_URL

        url = PREFECT_API_URL.value()
        with LocalCluster(n_workers=8, threads_per_worker=1) as cl, Client(cl) as c:
            c.run(lambda: os.environ.__setitem__("PREFECT_API_URL", url))
            c.run(acquire_many, 1)
            s = time.perf_counter()
            res = c.gather(
                [c.submit(acquire_many, 30, pure=False, workers=[w]) for w in c.scheduler_info()["workers"]]
            )
            summary("8 processes", [t for ts in res for t in ts])
            print("wall %.1f s" % (time.perf_counter() - s))
