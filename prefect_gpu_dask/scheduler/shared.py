"""The flow runs' shared blobs on the scheduler (``payload.SharedRef``): kept across a
whole-cluster restart, dropped as their flow run ends. Runs on the scheduler, which
need not have Prefect installed."""

from __future__ import annotations

from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from prefect_gpu_dask.payload import SHARED_METADATA


class SharedBlobs(SchedulerPlugin):
    """Keeps the flow runs' blobs (``Client.set_metadata`` under ``SHARED_METADATA``)
    through ``Scheduler.restart``, which clears the scheduler's metadata: whichever flow
    run or user restarts a shared cluster, the other flow runs' task runs still find
    theirs. The restart hook runs after the clear; the blobs' dict, held here, outlives
    it."""

    name = "prefect-gpu-dask-shared-blobs"
    idempotent = True  # registered again by each flow run: the first one stays

    def __init__(self) -> None:
        self.blobs: dict[str, Any] = {}

    async def start(self, scheduler: Any) -> None:
        # The same dict for every flow run: one registering later keeps the earlier ones'.
        self.blobs = scheduler.task_metadata.setdefault(SHARED_METADATA, {})

    def restart(self, scheduler: Any) -> None:
        scheduler.task_metadata.setdefault(SHARED_METADATA, self.blobs)


def forget_namespace(namespace: str, dask_scheduler: Any = None) -> None:
    """Drop one flow run's blobs (``flow.submission.TaskSubmitter.close``)."""
    dask_scheduler.task_metadata.get(SHARED_METADATA, {}).pop(namespace, None)
