"""What a worker tells the scheduler goes out promptly.

Dask batches the messages of a worker's stream to the scheduler (and of a client's)
and, after each write, holds the next one back for a fixed interval: 2 ms on a
worker's stream, 10 ms on a client's. A task run's worker tells the scheduler how the
run ended (``recycling.announce_end``) just before the task finishes, and the flow
releases the previous result just before it submits its next task, so each task run
waited for one of those holds on its way in and again on its way out.

``PromptStream``, a small ``WorkerPlugin`` the runner registers on every cluster it
uses, lets the worker's stream write as soon as its last write is done; the runner does
the same to its own client's stream with each submission (``flow.submission``: a client
that reconnects gets a new stream). Messages that come while a write is under way still
leave together. The scheduler's own streams (5 ms to a worker, 2 ms to a client) are
left as Dask has them: lowering them too moved no hop (``docs/performance.md``, "Dask's
batched streams")."""

from __future__ import annotations

from typing import Any

from distributed import WorkerPlugin

from prefect_gpu_dask import _compat


class PromptStream(WorkerPlugin):
    name = "prefect-gpu-dask-prompt-stream"
    idempotent = True

    async def setup(self, worker: Any) -> None:
        _compat.send_promptly(getattr(worker, "batched_stream", None))
