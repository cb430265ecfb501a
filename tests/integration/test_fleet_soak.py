"""A short fleet soak (``benchmarks/fleet_soak.py``): 32 flow runs against one cluster of
real worker processes, 12 back to back and 20 four at a time, with a leak, an
out-of-memory error, a hung task and a killed worker among them (each twice), on this
session's Prefect server.

Every task run ends as injected, none runs twice or is lost, no flow run hangs, and this
process's threads and open files do not grow after the warm-up.
"""

from __future__ import annotations

from benchmarks.fleet_soak import COUNT_SLACK, FAULTS, fleet, parse_args, soak

ARGS = [
    "--runs", "12",
    "--concurrent-runs", "20",
    "--concurrency", "4",
    "--fault-every", "4",
    "--short-tasks", "3",
    # The warm-up takes in three batches of four at once: the API client's connection
    # pool grows to what four concurrent runs use, and stays there.
    "--warmup", "16",
    "--sample-every", "8",
    "--run-timeout", "120",
    # A process this young is still filling its caches: its RSS is shown, not judged.
    "--rss-growth-limit", "1.0",
]  # fmt: skip


def test_a_short_fleet_soak_passes_every_check(tmp_path):
    args = parse_args(ARGS)
    with fleet(args, tmp_path, server=False) as (address, monitor, database):
        run, summary, failures = soak(args, address, tmp_path, monitor, database)

    problems = [f"run {r.index} ({r.phase}, {r.fault}): {p}" for r in run.rows for p in r.problems]
    print("\n".join(problems))  # in full: an assertion's message is cut short
    assert failures == [], (failures, problems)
    assert summary["runs_ended"] == 32 and summary["runs_hung"] == 0
    assert {fault: summary["faults"].get(fault) for fault in FAULTS} == dict.fromkeys(FAULTS, 2), summary
    assert summary["task_states"] == {
        "hung TimedOut": 2,
        "killed Crashed": 2,
        "leak Completed": 2,
        "oom Completed": 2,
        "short Completed": 32 * 3,
    }
    # Threads and open files of this (the flow) process, after the warm-up: the sample
    # after run 24 against the one after run 32, no flow run in flight at either.
    figures = summary["growth"]["figures"]
    assert (summary["growth"]["first"], summary["growth"]["last"]) == (24, 32)
    for name in ("threads", "threads_active", "fds"):  # growth, as the soak itself judges it
        first, last = figures[name]["first"], figures[name]["last"]
        assert last <= first * 1.10 or last - first <= COUNT_SLACK[name], (name, figures[name])
    assert figures["scheduler_runner_clients"]["last"] == 0
    assert figures["scheduler_subscribers_ours"]["last"] == 0


ONE_WORKER = [
    "--cluster", "cli",
    "--workers", "1",
    "--runs", "0",
    "--concurrent-runs", "16",
    "--concurrency", "2",
    "--fault-every", "2",
    "--warmup", "0",
    "--sample-every", "4",
    "--run-timeout", "60",
    "--rss-growth-limit", "1.0",
]  # fmt: skip


def test_a_leak_on_the_only_worker_waits_for_the_other_flow_runs_results(tmp_path):
    """Two flow runs at a time on a cluster of one worker: a leak recycles the worker
    while the other flow run holds results there, which no other worker can take. The
    worker serves that flow run until it has them, then restarts; nothing hangs."""
    args = parse_args(ONE_WORKER)
    with fleet(args, tmp_path, server=False) as (address, monitor, database):
        run, summary, failures = soak(args, address, tmp_path, monitor, database)

    problems = [f"run {r.index} ({r.phase}, {r.fault}): {p}" for r in run.rows for p in r.problems]
    print("\n".join(problems))
    assert summary["runs_ended"] == 16 and summary["runs_hung"] == 0, (summary, problems)
    assert problems == [] and summary["tasks_run_too_often"] == [] and summary["tasks_lost"] == [], summary
    assert summary["task_states"]["leak Completed"] == 2
    assert summary["restarts"] >= 1 and summary["restarts_lost"] == 0, summary
