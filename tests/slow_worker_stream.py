"""Worker preload (``--preload tests.slow_worker_stream``): every message the worker's
batched stream to the scheduler carries leaves a second late, in order, as from a worker
whose event loop waits for the CPU on a busy host. What a task queues on the stream is
still unsent when the task's process dies a moment later."""

from __future__ import annotations

from typing import Any

DELAY_S = 1.0


def dask_setup(worker: Any) -> None:
    stream = worker.batched_stream
    send = stream.send

    def late(*msgs: Any) -> None:
        worker.loop.call_later(DELAY_S, send, *msgs)

    stream.send = late
