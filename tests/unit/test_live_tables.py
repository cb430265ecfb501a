"""Which records the flow's publisher writes as a table each on their task run, and
which go out together as one table on the flow run (the tables themselves reach a real
API in tests/integration/test_flow_run_report.py)."""

from __future__ import annotations

import logging
import time

from prefect_gpu_dask.flow import reporting
from prefect_gpu_dask.flow.reporting import ONE_BY_ONE_UP_TO, LivePublisher, split_for_tables
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


class Tables(LivePublisher):
    """The publisher, with the tables it would write kept here instead."""

    def __init__(self) -> None:
        self.written: list[tuple[list[str], bool]] = []
        super().__init__(logging.getLogger(__name__))

    def _table(self, records, description, first, on_task_run=True):
        self.written.append(([r.task_run_name for r in records], on_task_run))


def test_records_that_come_close_together_go_out_together_and_a_lone_one_alone(monkeypatch):
    monkeypatch.setattr(reporting, "GATHER_S", 5.0)  # however slow this machine is
    publisher = Tables()
    burst = [record(f"etl{i}", 0) for i in range(ONE_BY_ONE_UP_TO + 2)]
    for r in burst:
        publisher.publish(r)
    publisher.close(timeout=30)  # ends the gathering: the burst goes out at once

    assert publisher.written == [([r.task_run_name for r in burst], False)]

    monkeypatch.setattr(reporting, "GATHER_S", 0.0)
    publisher = Tables()
    lone = record("svd", 0)
    publisher.publish(lone)
    deadline = time.monotonic() + 30
    while not publisher.written:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    publisher.close(timeout=30)

    assert publisher.written == [([lone.task_run_name], True)]
