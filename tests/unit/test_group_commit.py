"""The SQLite server's task-run recorder writer (``api_server.recorder``): an event
that comes while nothing is written goes at once; what comes during a write goes in the
next one, together, up to the batch; a failed write is tried again, and an event past
its retries is dropped; on the way out nothing queued is left behind."""

from __future__ import annotations

import asyncio
import logging

import pytest

from prefect_gpu_dask.api_server.recorder import GroupCommitWriter, consumer


class ScriptedDatabase:
    """Records each write's events; a write takes ``hold`` (an event the test sets) and
    fails while ``failing`` is above 0."""

    def __init__(self) -> None:
        self.writes: list[list[int]] = []
        self.hold: asyncio.Event | None = None
        self.failing = 0
        self.entered = asyncio.Event()

    async def write(self, events):
        self.entered.set()
        if self.hold is not None:
            await self.hold.wait()
        if self.failing:
            self.failing -= 1
            raise RuntimeError("database is locked")
        self.writes.append(list(events))


async def until(condition, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


async def writing_first_event(batch_size: int):
    """One writer over a held database, event 1's write in flight."""
    db = ScriptedDatabase()
    db.hold = asyncio.Event()
    writer = GroupCommitWriter(db.write, batch_size=batch_size, retry_after_s=30, max_retries=5, writers=1)
    running = asyncio.create_task(writer.run())
    await writer.add(1)
    await db.entered.wait()
    return db, writer, running


async def stop_then_release(db, writer, running) -> None:
    """Stop while the write in flight still waits on the database, then let it go."""
    stopping = asyncio.create_task(writer.stop(running))
    await asyncio.sleep(0.01)
    db.hold.set()
    await stopping


def test_an_event_on_an_idle_writer_is_written_at_once_and_alone():
    async def scenario():
        db = ScriptedDatabase()
        writer = GroupCommitWriter(db.write, batch_size=100, retry_after_s=30, max_retries=5)
        running = asyncio.create_task(writer.run())
        await writer.add(1)
        await until(lambda: db.writes)
        await writer.stop(running)
        return db.writes

    assert asyncio.run(scenario()) == [[1]]


def test_events_that_come_during_a_write_go_together_in_the_next_up_to_the_batch():
    async def scenario():
        db, writer, running = await writing_first_event(batch_size=3)
        adding = asyncio.gather(*(writer.add(n) for n in range(2, 7)))
        await until(lambda: writer.queued() == 5)
        await asyncio.sleep(0.01)
        assert not adding.done()  # more than a batch queued: the adds wait
        db.hold.set()
        await adding
        await until(lambda: sum(map(len, db.writes)) == 6)
        await writer.stop(running)
        return db.writes

    assert asyncio.run(scenario()) == [[1], [2, 3, 4], [5, 6]]


def test_a_second_writer_writes_what_came_while_the_first_waits_on_the_database():
    async def scenario():
        slow = asyncio.Event()
        writes: list[list[int]] = []

        async def write(events):
            if 1 in events:
                await slow.wait()  # the first write waits on the database
            writes.append(list(events))

        writer = GroupCommitWriter(write, batch_size=10, retry_after_s=30, max_retries=5, writers=2)
        running = asyncio.create_task(writer.run())
        await writer.add(1)
        await asyncio.sleep(0.01)
        for n in (2, 3):
            await writer.add(n)
        await until(lambda: writes)  # written while the first still waits
        during = list(writes)
        slow.set()
        await until(lambda: len(writes) == len(during) + 1)
        await writer.stop(running)
        return during, writes

    during, writes = asyncio.run(scenario())
    assert during and 1 not in during[0], during
    assert sorted(e for w in writes for e in w) == [1, 2, 3]
    assert writes[-1] == [1]


def test_a_failed_write_is_tried_again_and_an_event_past_its_retries_is_dropped(caplog):
    async def scenario(failing, max_retries):
        db = ScriptedDatabase()
        db.failing = failing
        writer = GroupCommitWriter(db.write, batch_size=10, retry_after_s=0.01, max_retries=max_retries)
        running = asyncio.create_task(writer.run())
        await writer.add("e")
        await until(lambda: db.writes or (db.failing == 0 and writer.queued() == 0))
        await writer.stop(running)
        return db.writes

    with caplog.at_level(logging.ERROR):
        assert asyncio.run(scenario(failing=2, max_retries=2)) == [["e"]]
    assert "Dropping" not in caplog.text
    with caplog.at_level(logging.ERROR):
        assert asyncio.run(scenario(failing=3, max_retries=2)) == []
    assert "Dropping task-run event e after 3 failed writes" in caplog.text


def test_a_failed_write_is_tried_again_after_the_pause_by_its_own_writer():
    async def scenario():
        attempts: list[float] = []
        loop = asyncio.get_running_loop()

        async def write(events):
            attempts.append(loop.time())
            if len(attempts) == 1:
                raise RuntimeError("database is locked")

        writer = GroupCommitWriter(write, batch_size=10, retry_after_s=0.2, max_retries=5, writers=2)
        running = asyncio.create_task(writer.run())
        await writer.add("e")
        await until(lambda: len(attempts) == 2)
        await writer.stop(running)
        return attempts

    first, second = asyncio.run(scenario())
    assert second - first >= 0.19, second - first


def test_a_write_a_driver_cancels_is_tried_again_and_the_writers_go_on():
    async def scenario():
        written: list[list[str]] = []
        cancelled = []

        async def write(events):
            if not cancelled:
                cancelled.append(events)
                raise asyncio.CancelledError  # as a database driver losing its connection may
            written.append(list(events))

        writer = GroupCommitWriter(write, batch_size=10, retry_after_s=0.01, max_retries=5, writers=1)
        running = asyncio.create_task(writer.run())
        await writer.add("a")
        await until(lambda: written)
        await writer.add("b")
        await until(lambda: len(written) == 2)
        await writer.stop(running)
        return written

    assert asyncio.run(scenario()) == [["a"], ["b"]]


def test_an_add_cancelled_while_it_waits_for_room_has_queued_its_event():
    async def scenario():
        db, writer, running = await writing_first_event(batch_size=1)
        await writer.add(2)
        waiting = asyncio.create_task(writer.add(3))  # two queued, a batch is one: it waits
        await asyncio.sleep(0.01)
        assert not waiting.done()
        waiting.cancel()  # as the broker's handlers are, when the recorder stops
        await stop_then_release(db, writer, running)
        return sorted(event for write in db.writes for event in write)

    assert asyncio.run(scenario()) == [1, 2, 3]


def test_stopping_writes_the_batch_in_flight_and_everything_queued():
    async def scenario():
        db, writer, running = await writing_first_event(batch_size=2)
        await writer.add(2)
        await writer.add(3)
        await stop_then_release(db, writer, running)
        return db.writes

    assert asyncio.run(scenario()) == [[1, 2], [3]]


def test_the_consumer_records_only_what_the_filter_keeps():
    async def scenario():
        db = ScriptedDatabase()
        async with consumer(
            10, 1, 5, recorded=lambda message: message if message % 2 else None, write=db.write
        ) as handle:
            for message in range(6):
                await handle(message)
        return sorted(event for write in db.writes for event in write)

    assert asyncio.run(scenario()) == [1, 3, 5]


@pytest.mark.parametrize(
    "batch_size, retry_after_s, writers, named",
    [(0, 1.0, 2, "batch_size must be at least 1, not 0"), (10, -1.0, 2, "not -1.0"), (10, 1.0, 0, "writers")],
)
def test_bad_settings_are_named(batch_size, retry_after_s, writers, named):
    async def make():
        GroupCommitWriter(lambda events: None, batch_size, retry_after_s, 5, writers=writers)

    with pytest.raises(ValueError, match=named):
        asyncio.run(make())
