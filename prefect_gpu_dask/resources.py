"""The Dask resources GPU work asks for and workers offer, by name, and what the
scheduler says each worker offers.

A ``gpu`` task asks for ``GPU``; a GPU worker offers ``GPU``, ``GPU-<MODEL>`` (e.g.
``GPU-H200``) and ``GPU-MEM`` (its GPU's memory in bytes). The flow routes by these
names, a worker labels itself with them and the scheduler withdraws them from a sick
GPU; the tags that ask for them (``gpu``, ``gpu:<share>``, ``gpu-model:``, ``gpu-mem:``)
are read on the flow side (``flow.routing``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

GPU_RESOURCE = "GPU"
MEMORY_RESOURCE = "GPU-MEM"  # bytes of GPU memory a task asks for; a worker offers its GPU's total
GPU_TAG = "gpu"
MODEL_TAG = "gpu-model"
MEMORY_TAG = "gpu-mem"

Resources = dict[str, float]


def model_resource(model: str) -> str:
    """The resource a GPU worker of ``model`` offers: ``"h200"`` -> ``"GPU-H200"``."""
    return f"{GPU_RESOURCE}-{model.upper()}"


def model_slug(device_name: str) -> str:
    """NVML's device name -> the model tags use: ``"NVIDIA H200"`` -> ``"h200"``,
    ``"NVIDIA A100-SXM4-80GB"`` -> ``"a100"``, ``"NVIDIA GeForce RTX 4090"`` -> ``"rtx-4090"``."""
    words = [
        w for w in device_name.lower().replace("_", " ").split() if w not in {"nvidia", "tesla", "geforce"}
    ]
    if not words:
        return "unknown"
    first = words[0].split("-")[0]
    if first in {"rtx", "gtx", "titan", "quadro"} and len(words) > 1:
        return f"{first}-{words[1].split('-')[0]}"
    return first


def uses_gpu(resources: Mapping[str, float]) -> bool:
    return resources.get(GPU_RESOURCE, 0) > 0


def satisfiable(resources: Mapping[str, float], workers: Iterable[Mapping[str, float]]) -> bool:
    """Does at least one worker advertise every resource in the amounts asked?"""
    return any(
        all(offered.get(name, 0) >= amount for name, amount in resources.items()) for offered in workers
    )


def scheduler_identity(client: Any) -> dict[str, Any]:
    """The scheduler's identity with every worker, asked now (sync clients).

    Not ``Client.scheduler_info()``: that returns a cache which the client's own
    periodic refresh overwrites with an answer that lists no workers, so a read racing
    the refresh finds an empty cluster.
    """
    return client.sync(client.scheduler.identity, n_workers=-1)


def resources_of(scheduler_identity: Mapping[str, Any]) -> list[Resources]:
    """What each worker advertises, from the scheduler's ``identity`` answer."""
    return [w.get("resources") or {} for w in scheduler_identity["workers"].values()]
