"""Each GPU worker advertises what it has: ``GPU``, its model and its memory.

``GPULabels`` is a small ``WorkerPlugin``, registered by the runner on every cluster it
uses. In ``setup`` it reads this worker's GPU through the probe its guard reads too
(``probe.worker_probe``: NVML, or the runner's ``memory_probe``) and adds, as Dask
resources, ``GPU=1`` where the worker was started without it, ``GPU-<MODEL>`` (e.g.
``GPU-H200``) as much as its ``GPU``, and ``GPU-MEM``, its GPU's memory in bytes, so
that ``gpu:h200`` and ``gpu-mem:40GiB`` tags route with no ``--resources`` by hand. A
worker without a GPU is left as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from distributed import WorkerPlugin

from prefect_gpu_dask._compat import add_worker_resources
from prefect_gpu_dask.resources import GPU_RESOURCE, MEMORY_RESOURCE, model_resource, model_slug
from prefect_gpu_dask.settings import RunnerSettings
from prefect_gpu_dask.worker.probe import GPUIdentity, worker_probe

logger = logging.getLogger(__name__)


def labels_for(offered: Mapping[str, float], gpu: GPUIdentity) -> dict[str, float]:
    """The resources a worker with ``gpu`` should add to what it ``offered`` already."""
    share = offered.get(GPU_RESOURCE) or 1.0
    labels = {GPU_RESOURCE: share}
    if gpu.name:
        labels[model_resource(model_slug(gpu.name))] = share
    if gpu.memory_total:
        labels[MEMORY_RESOURCE] = float(gpu.memory_total)
    return {name: amount for name, amount in labels.items() if name not in offered}


class GPULabels(WorkerPlugin):
    name = "prefect-gpu-dask-labels"
    idempotent = True

    def __init__(self, settings: RunnerSettings | None = None):
        self.settings = settings if settings is not None else RunnerSettings()

    async def setup(self, worker: Any) -> None:
        try:
            probe = worker_probe(worker, self.settings.memory_probe)
        except Exception as exc:  # a plugin hook: NVML or a memory_probe unusable, no labels, worker fine
            logger.warning("Could not read the GPU of %s to label it: %r", worker.address, exc)
            return
        if probe is None:
            return
        labels = labels_for(worker.state.total_resources, probe.gpu)
        if labels:
            await add_worker_resources(worker, labels)
            logger.info("Worker %s advertises %s", worker.address, labels)
