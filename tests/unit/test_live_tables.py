"""Which records the flow's publisher writes as a table each on their task run, and
which go out together as one table on the flow run."""

from __future__ import annotations

from prefect_gpu_dask.flow.reporting import ONE_BY_ONE_UP_TO, split_for_tables
from tests.unit.test_sizing_and_chart import record


def test_a_few_waiting_records_each_get_a_table_on_their_task_run():
    waiting = [record(f"etl{i}", 0) for i in range(ONE_BY_ONE_UP_TO)]

    assert split_for_tables(waiting) == (waiting, [])


def test_a_backlog_goes_out_together_but_a_leak_an_oom_and_a_restart_keep_their_own():
    clean = [record(f"etl{i}", 0) for i in range(ONE_BY_ONE_UP_TO + 3)]
    leak = record("leaky", 0, verdict="leak", restart_reason="leaked 1.00 GiB")
    oom = record("big", 0, verdict="oom")
    restarted = record("hung", 0, verdict="cached", restart_reason="stalled")
    waiting = [clean[0], leak, *clean[1:4], oom, *clean[4:], restarted]

    alone, together = split_for_tables(waiting)

    assert alone == [leak, oom, restarted]
    assert together == clean  # in the order they came
