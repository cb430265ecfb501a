"""A big flow stays light: per task run, the default runner's flow process holds at most
1.5x what Prefect's ``ThreadPoolTaskRunner`` holds, and nothing per task run outlives
the flow run (``benchmarks.big_flow``, a smaller flow)."""

from __future__ import annotations

import os

from benchmarks.big_flow import compare, print_table

TASKS = 2000
MAX_RATIO = 1.5


def test_a_big_flow_holds_at_most_one_and_a_half_times_the_thread_pool_per_task_run(prefect_api):
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    report = compare(TASKS, top=10, env=env)
    print_table(report)
    threads, dask = report["runners"]["threads"], report["runners"]["dask"]
    assert report["held_ratio"] <= MAX_RATIO, (
        f"the default runner holds {dask['held_mib_per_1000']:.1f} MiB per 1,000 task runs, "
        f"the thread pool {threads['held_mib_per_1000']:.1f} ({report['held_ratio']:.2f}x)"
    )
    # Left after the flow run: one-time caches, not a part per task run.
    assert dask["kept_mib_per_1000"] <= max(1.5 * threads["kept_mib_per_1000"], 1.0), (dask, threads)
