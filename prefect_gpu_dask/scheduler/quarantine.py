"""The scheduler's part of a quarantine: a sick GPU's worker stops offering its GPU.

``withdraw`` runs on the scheduler's event loop, sent by the worker that found its GPU
sick (``worker.quarantine.HealthWatch``).
"""

from __future__ import annotations

from typing import Any

from prefect_gpu_dask.resources import GPU_RESOURCE


def withdraw(dask_scheduler: Any, worker: str) -> dict[str, Any]:
    """Set ``worker``'s GPU resources to 0 unless no other worker offers a GPU.

    Runs on the scheduler's event loop, so two GPUs found sick at once cannot both
    give theirs up and leave ``gpu`` tasks waiting forever.
    """
    from prefect_gpu_dask._compat import set_worker_resources

    if worker not in dask_scheduler.workers:
        return {"withdrawn": False, "others": 0, "known": False}
    others = sum(
        1
        for address, amount in dask_scheduler.resources.get(GPU_RESOURCE, {}).items()
        if address != worker and amount > 0
    )
    if others:
        ws = dask_scheduler.workers[worker]
        gpu_names = [name for name in ws.resources if name == GPU_RESOURCE or name.startswith("GPU-")]
        set_worker_resources(dask_scheduler, worker, dict.fromkeys(gpu_names, 0))
    return {"withdrawn": bool(others), "others": others, "known": True}
