"""The flow runs' shared blobs on the scheduler (``payload.SharedRef``): dropped as a
flow run ends. Runs on the scheduler, which need not have Prefect installed."""

from __future__ import annotations

from typing import Any

from prefect_gpu_dask.payload import SHARED_METADATA


def forget_namespace(namespace: str, dask_scheduler: Any = None) -> None:
    """Drop one flow run's blobs (``flow.submission.TaskSubmitter.close``)."""
    dask_scheduler.task_metadata.get(SHARED_METADATA, {}).pop(namespace, None)
