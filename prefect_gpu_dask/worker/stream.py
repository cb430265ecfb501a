"""What a worker tells the scheduler goes out promptly.

Dask batches the messages of a worker's stream to the scheduler (and of a client's)
and, after each write, holds the next one back for a fixed interval: 2 ms on a
worker's stream, 10 ms on a client's. A task run's worker tells the scheduler how the
run ended (``recycling.announce_end``) just before the task finishes, and the flow
releases the previous result just before it submits its next task, so each task run
waited for one of those intervals on its way in and again on its way out.
``PromptStream``, a small ``WorkerPlugin`` the runner registers on every cluster it
uses, shortens the worker's hold to half a millisecond; the runner does the same to
its own client's stream (``flow.cluster``). Messages that come together still leave in
one write.
"""

from __future__ import annotations

from typing import Any

from distributed import WorkerPlugin

from prefect_gpu_dask import _compat


class PromptStream(WorkerPlugin):
    name = "prefect-gpu-dask-prompt-stream"
    idempotent = True

    async def setup(self, worker: Any) -> None:
        _compat.send_promptly(getattr(worker, "batched_stream", None))
