"""Cluster classes for tests, importable by name as a ``cluster_class`` string."""

from __future__ import annotations

from typing import Any

from distributed import LocalCluster


class AsyncAdaptCluster(LocalCluster):
    """A ``LocalCluster`` whose ``adapt`` is a coroutine, as a cluster class built on an
    async API may have."""

    adapted_with: dict[str, Any] | None = None

    async def adapt(self, **kwargs: Any) -> Any:  # type: ignore[override]
        self.adapted_with = kwargs
        return super().adapt(**kwargs)
