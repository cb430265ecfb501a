"""Prefect task tags -> Dask resource annotations.

``gpu`` asks for one ``GPU`` slot, ``gpu:N`` for N slots (``gpu:0.5`` lets two tasks
share a GPU), and a user map turns any tag into any resources. Everything is validated
up front so a typo fails at construction or submission, never as a task that waits
forever for a resource nobody has.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from functools import lru_cache

GPU_RESOURCE = "GPU"
GPU_TAG = "gpu"

Resources = dict[str, float]


def _amount(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: resource amount {value!r} is not a number")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: resource amount {value!r} must be a positive number")
    return float(value)


def validate_tag_resources(tag_resources: Mapping[str, Mapping[str, float]] | None) -> dict:
    """Check a user tag map like ``{"nvme": {"NVME": 1}}``; return a clean copy."""
    if tag_resources is None:
        return {}
    if not isinstance(tag_resources, Mapping):
        raise ValueError(f"tag_resources must be a mapping of tag -> resources, got {tag_resources!r}")
    clean: dict[str, Resources] = {}
    for tag, resources in tag_resources.items():
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"tag_resources: tag {tag!r} must be a non-empty string")
        if tag == GPU_TAG or tag.startswith(GPU_TAG + ":"):
            raise ValueError(f"tag_resources: tag {tag!r} is reserved for GPU routing")
        if not isinstance(resources, Mapping) or not resources:
            raise ValueError(
                f"tag_resources[{tag!r}]: {resources!r} must be a non-empty mapping "
                "of resource name -> amount"
            )
        clean[tag] = {}
        for name, amount in resources.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"tag_resources[{tag!r}]: resource name {name!r} is invalid")
            clean[tag][name] = _amount(amount, f"tag_resources[{tag!r}][{name!r}]")
    return clean


def parse_gpu_tag(tag: str) -> float | None:
    """``"gpu"`` -> 1.0, ``"gpu:0.5"`` -> 0.5, other tags -> None; malformed -> ValueError."""
    if tag == GPU_TAG:
        return 1.0
    if not tag.startswith(GPU_TAG + ":"):
        return None
    text = tag[len(GPU_TAG) + 1 :]
    try:
        amount = float(text)
    except ValueError:
        raise ValueError(f"malformed GPU tag {tag!r}: {text!r} is not a number") from None
    if not math.isfinite(amount) or amount <= 0:
        raise ValueError(f"malformed GPU tag {tag!r}: the amount must be a positive number")
    return amount


class TagRouter:
    """Turns a task's tags into the Dask resources it must hold while it runs."""

    def __init__(self, tag_resources: Mapping[str, Mapping[str, float]] | None = None):
        self.tag_resources = validate_tag_resources(tag_resources)
        # Tag sets repeat across thousands of submits; resolve each distinct set once.
        self.resources_for = lru_cache(maxsize=1024)(self._resources_for)

    def __reduce__(self):
        # The per-instance cache is not picklable; rebuild it on the other side.
        return (type(self), (self.tag_resources,))

    def _resources_for(self, tags: frozenset[str]) -> Resources:
        resources: Resources = {}
        for tag in sorted(tags):
            gpu = parse_gpu_tag(tag)
            wanted = {GPU_RESOURCE: gpu} if gpu is not None else self.tag_resources.get(tag, {})
            for name, amount in wanted.items():
                # Two tags asking for the same resource: the larger request wins.
                resources[name] = max(resources.get(name, 0.0), amount)
        return resources

    def resources_for_tags(self, tags: Iterable[str]) -> Resources:
        return self.resources_for(frozenset(tags))


def uses_gpu(resources: Mapping[str, float]) -> bool:
    return resources.get(GPU_RESOURCE, 0) > 0


def satisfiable(resources: Mapping[str, float], workers: Iterable[Mapping[str, float]]) -> bool:
    """Does at least one worker advertise every resource in the amounts asked?"""
    return any(
        all(offered.get(name, 0) >= amount for name, amount in resources.items()) for offered in workers
    )
