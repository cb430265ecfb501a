"""The task-run recorder of a SQLite server: each write takes every event that came
while the last ones ran, up to a batch, so an event waits for writes already running,
never for a timer.

Prefect's recorder writes one event a transaction by default; given a batch, it waits
for the batch to fill or for its flush interval, so on a quiet server a task run's
states reach the database up to a second late, and a client that reads them right after its
flow run ended finds them missing. Here a write starts as soon as an event comes and a
writer is free; events that come meanwhile queue up and go in the next write,
together. An idle server records an event at once; under a burst, the writes grow to
the batch and the server commits as seldom as a timed batch would.

A failed write keeps Prefect's accounting: each event is tried again, up to its limit,
after the flush interval; an event past it is dropped and logged. On the way out what
is queued is written, as Prefect's recorder does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

logger = logging.getLogger("prefect.server.services.task_run_recorder")

Event = TypeVar("Event")


@dataclass
class Pending(Generic[Event]):
    """An event not yet written, and how many writes of it failed."""

    event: Event
    failed_writes: int = 0


class GroupCommitWriter(Generic[Event]):
    """Writes events with ``write`` as they come: at most ``writers`` writes at a time,
    each taking what queued while the others ran, at most ``batch_size``.

    ``add`` queues its event, then waits while more than ``batch_size`` are queued (the
    broker's own queue holds the rest): an ``add`` cancelled while it waits has already
    queued its event. ``retry_after_s``: the pause before a failed write is tried again,
    by the writer whose write failed. ``max_retries``: the failed writes an event
    survives. Two writers, as Prefect's recorder has (its broker consumer's two handlers
    each flush a full batch): one builds its rows while the other waits on the database.
    """

    def __init__(
        self,
        write: Callable[[Sequence[Event]], Awaitable[Any]],
        batch_size: int,
        retry_after_s: float,
        max_retries: int,
        writers: int = 2,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size!r}")
        if retry_after_s < 0:
            raise ValueError(f"retry_after_s must not be negative, not {retry_after_s!r}")
        if writers < 1:
            raise ValueError(f"writers must be at least 1, not {writers!r}")
        self.write = write
        self.batch_size = batch_size
        self.retry_after_s = retry_after_s
        self.max_retries = max_retries
        self.writers = writers
        self._queue: asyncio.Queue[Pending[Event]] = asyncio.Queue()
        self._room = asyncio.Event()
        self._unfinished: list[Pending[Event]] = []  # batches a stop interrupted
        self._stopping = False

    async def add(self, event: Event) -> None:
        self._queue.put_nowait(Pending(event))
        while self._queue.qsize() > self.batch_size:
            self._room.clear()
            await self._room.wait()

    def queued(self) -> int:
        return self._queue.qsize() + len(self._unfinished)

    async def run(self) -> None:
        """Write until cancelled by ``stop``; a batch in flight then waits for ``stop``."""
        writers = [asyncio.ensure_future(self._write_continuously()) for _ in range(self.writers)]
        try:
            await asyncio.gather(*writers)
        finally:
            for writer in writers:  # one that failed leaves none behind
                writer.cancel()
            await asyncio.wait(writers)

    async def _write_continuously(self) -> None:
        batch: list[Pending[Event]] = []
        while True:
            if not batch:
                batch = await self._next_batch()
            try:
                await self.write([pending.event for pending in batch])
                batch = []
            except asyncio.CancelledError:
                if self._asked_to_stop():
                    self._unfinished[:0] = batch
                    raise
                # Database drivers can surface a lost connection as CancelledError.
                batch = await self._failed(batch)
            except Exception:
                batch = await self._failed(batch)

    def _asked_to_stop(self) -> bool:
        """Whether a CancelledError here means stop: ``stop`` was called, or (Python 3.11+)
        this task was cancelled, as the event loop's shutdown cancels every task; one a
        database driver raises without a cancel does not."""
        cancelling = getattr(asyncio.current_task(), "cancelling", None)
        return self._stopping or (cancelling is not None and cancelling() > 0)

    async def stop(self, running: asyncio.Task[None]) -> None:
        """Stop ``running`` (this writer's ``run``) and write what is left."""
        self._stopping = True
        running.cancel()
        await asyncio.wait([running])
        if not running.cancelled() and running.exception() is not None:
            logger.error("The task-run event writers failed", exc_info=running.exception())
        while self.queued():
            batch = self._take_now(self._unfinished[: self.batch_size])
            del self._unfinished[: self.batch_size]
            try:
                await self.write([pending.event for pending in batch])
            except Exception:
                logger.exception("Could not write %d task-run events on the way out", len(batch))
                self._count_failure(batch, requeue=False)

    async def _next_batch(self) -> list[Pending[Event]]:
        return self._take_now([await self._queue.get()])

    def _take_now(self, batch: list[Pending[Event]]) -> list[Pending[Event]]:
        while len(batch) < self.batch_size and not self._queue.empty():
            batch.append(self._queue.get_nowait())
        self._room.set()
        return batch

    async def _failed(self, batch: list[Pending[Event]]) -> list[Pending[Event]]:
        """What of ``batch`` to write again, after the pause."""
        logger.error("Error writing %d task-run events", len(batch), exc_info=True)
        kept = self._count_failure(batch, requeue=True)
        try:
            await asyncio.sleep(self.retry_after_s)
        except asyncio.CancelledError:
            self._unfinished[:0] = kept
            raise
        return kept

    def _count_failure(self, batch: list[Pending[Event]], requeue: bool) -> list[Pending[Event]]:
        kept = []
        for pending in batch:
            pending.failed_writes += 1
            if requeue and pending.failed_writes <= self.max_retries:
                kept.append(pending)
            else:
                logger.error(
                    "Dropping task-run event %s after %d failed writes",
                    getattr(pending.event, "id", pending.event),
                    pending.failed_writes,
                )
        return kept


@contextlib.asynccontextmanager
async def consumer(
    write_batch_size: int,
    flush_every: float,
    max_persist_retries: int,
    recorded: Callable[[Any], Any | None],
    write: Callable[[Sequence[Any]], Awaitable[Any]],
) -> AsyncIterator[Callable[[Any], Awaitable[None]]]:
    """What Prefect's ``task_run_recorder.consumer`` yields, a message handler, writing
    with a ``GroupCommitWriter``. ``recorded(message)``: the event the recorder records
    from a broker message, else None (Prefect's own filter)."""
    logger.info(
        "Creating TaskRunRecorder consumer writing events as they come, up to %d a transaction",
        write_batch_size,
    )
    writer: GroupCommitWriter[Any] = GroupCommitWriter(
        write, write_batch_size, flush_every, max_persist_retries
    )

    async def message_handler(message: Any) -> None:
        event = recorded(message)
        if event is not None:
            await writer.add(event)

    running = asyncio.create_task(writer.run())
    try:
        yield message_handler
    finally:
        await writer.stop(running)
