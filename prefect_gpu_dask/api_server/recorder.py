"""The task-run recorder of a SQLite server: each write takes every event that came
while the last ones ran, up to a batch, so an event waits for writes already running,
never for a timer.

Prefect's recorder writes one event a transaction by default; given a batch, it waits
for the batch to fill or for its flush interval, so on a quiet server a task run's
states reach the database a second late, and a client that reads them right after its
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

    ``add`` waits while ``batch_size`` events are queued (the broker's own queue holds
    the rest). ``retry_after_s``: the pause after a failed write. ``max_retries``: the
    failed writes an event survives. Two writers, as Prefect's recorder has (its broker
    consumer's two handlers each flush a full batch): one builds its rows while the
    other waits on the database.
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
        self._queue: asyncio.Queue[Pending[Event]] = asyncio.Queue(maxsize=batch_size)
        self._retrying: list[Pending[Event]] = []
        self._stopping = False

    async def add(self, event: Event) -> None:
        await self._queue.put(Pending(event))

    def queued(self) -> int:
        return self._queue.qsize() + len(self._retrying)

    async def run(self) -> None:
        """Write until cancelled by ``stop``; a batch in flight then goes back to the queue."""
        await asyncio.gather(*(self._write_continuously() for _ in range(self.writers)))

    async def _write_continuously(self) -> None:
        while True:
            batch = await self._next_batch()
            try:
                await self.write([pending.event for pending in batch])
            except asyncio.CancelledError:
                if self._stopping:
                    self._retrying[:0] = batch
                    raise
                # Database drivers can surface a lost connection as CancelledError.
                await self._failed(batch)
            except Exception:
                await self._failed(batch)

    async def stop(self, running: asyncio.Task[None]) -> None:
        """Stop ``running`` (this writer's ``run``) and write what is left."""
        self._stopping = True
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        while self.queued():
            batch = self._take_now(self._retrying[: self.batch_size])
            del self._retrying[: self.batch_size]
            try:
                await self.write([pending.event for pending in batch])
            except Exception:
                logger.exception("Could not write %d task-run events on the way out", len(batch))
                self._count_failure(batch, requeue=False)

    async def _next_batch(self) -> list[Pending[Event]]:
        batch = self._retrying[: self.batch_size]
        del self._retrying[: self.batch_size]
        if not batch:
            batch.append(await self._queue.get())
        return self._take_now(batch)

    def _take_now(self, batch: list[Pending[Event]]) -> list[Pending[Event]]:
        while len(batch) < self.batch_size and not self._queue.empty():
            batch.append(self._queue.get_nowait())
        return batch

    async def _failed(self, batch: list[Pending[Event]]) -> None:
        logger.error("Error writing %d task-run events", len(batch), exc_info=True)
        self._count_failure(batch, requeue=True)
        await asyncio.sleep(self.retry_after_s)

    def _count_failure(self, batch: list[Pending[Event]], requeue: bool) -> None:
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
        self._retrying[:0] = kept


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
