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
    leak = record("leaky", 0, verdict="leak")  # recycling off: no restart
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


def test_four_clean_records_beside_a_leak_still_get_a_table_each():
    clean = [record(f"etl{i}", 0) for i in range(ONE_BY_ONE_UP_TO)]
    leak = record("leaky", 0, verdict="leak")

    assert split_for_tables([leak, *clean]) == ([leak, *clean], [])


def published_within(publisher: Tables, timeout: float = 30) -> list[tuple[list[str], bool]]:
    deadline = time.monotonic() + timeout
    while not publisher.written:
        assert time.monotonic() < deadline, "nothing was published"
        time.sleep(0.01)
    return publisher.written


def test_records_that_come_close_together_go_out_together(monkeypatch):
    monkeypatch.setattr(reporting, "GATHER_S", 3.0)  # longer than the gaps, on any machine
    publisher = Tables()
    burst = [record(f"etl{i}", 0) for i in range(ONE_BY_ONE_UP_TO + 2)]
    for r in burst:  # one at a time: the publisher has taken the first before the rest come
        publisher.publish(r)
        time.sleep(0.05)

    assert published_within(publisher) == [([r.task_run_name for r in burst], False)]
    publisher.close(timeout=30)


def test_a_lone_record_goes_out_alone_once_the_gathering_ends(monkeypatch):
    monkeypatch.setattr(reporting, "GATHER_S", 0.2)
    publisher = Tables()
    lone = record("svd", 0)
    publisher.publish(lone)

    assert published_within(publisher) == [([lone.task_run_name], True)]  # not held until close
    publisher.close(timeout=30)


def test_the_end_cuts_the_gathering_short_and_publishes_what_came(monkeypatch):
    monkeypatch.setattr(reporting, "GATHER_S", 600.0)
    publisher = Tables()
    records = [record("svd", 0), record("etl", 0, flow_run_id=None, task_run_id=None)]
    for r in records:
        publisher.publish(r)
    started = time.monotonic()
    publisher.close(timeout=30)

    assert time.monotonic() - started < 10
    assert publisher.written == [(["svd-0"], True)]  # a record without a task run has no table
