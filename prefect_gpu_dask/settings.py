"""``RunnerSettings``: every GPU knob of the runner, validated once, frozen.

Built by the runner's constructor (so a bad value fails before anything runs, with a
``ValueError`` naming it), compared by ``__eq__`` and carried by ``duplicate()`` and
pickling, and sent as is to every worker inside the guard plugin. Nothing here imports
Prefect: a worker unpickling the plugin stays light.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal
from urllib.parse import urlsplit

from dask.utils import parse_bytes

from prefect_gpu_dask.resources import GPU_TAG, MEMORY_TAG, MODEL_TAG, Resources

OnMissingGPU = Literal["cpu", "error"]
GuardScope = Literal["gpu", "all", "off"]
RestartPolicy = Literal["worker", "cluster", "never"]
ON_MISSING_GPU: tuple[OnMissingGPU, ...] = ("cpu", "error")
GUARD_SCOPES: tuple[GuardScope, ...] = ("gpu", "all", "off")
RESTART_POLICIES: tuple[RestartPolicy, ...] = ("worker", "cluster", "never")
OnStall = Literal["warn", "fail"]
ON_STALL: tuple[OnStall, ...] = ("warn", "fail")


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def parse_threshold(value: int | float | str) -> int:
    """``"256MiB"`` or bytes -> bytes; anything else is a ValueError naming it."""
    if isinstance(value, bool):
        raise ValueError(f"leak_threshold {value!r} is not a size")
    try:
        parsed = parse_bytes(value) if isinstance(value, str) else int(value)
    except (ValueError, TypeError):
        raise ValueError(f"leak_threshold {value!r} is not a size (use bytes or e.g. '256MiB')") from None
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"leak_threshold {value!r} is not a whole number of bytes")
    if parsed <= 0:
        raise ValueError(f"leak_threshold {value!r} must be positive")
    return parsed


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
        if tag == GPU_TAG or tag.startswith((GPU_TAG + ":", MODEL_TAG + ":", MEMORY_TAG + ":")):
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


# Schemes distributed can speak; anything else is a typo refused up front.
KNOWN_SCHEMES = {"tcp", "tls", "ucx", "ucxx", "inproc", "ws", "wss"}
PLAINTEXT_SCHEMES = {"tcp", "ws", "ucx", "ucxx"}


def check_connection(address: str | None, security: Any, allow_insecure: bool) -> None:
    """The runner's ``address`` and ``security``: a ``distributed.Security`` or None, a
    known scheme, and no plaintext to a non-loopback host unless ``allow_insecure``."""
    import distributed

    if security is not None and not isinstance(security, distributed.Security):
        raise ValueError(f"security={security!r} is not a distributed.Security")
    if address:
        _check_address(
            address,
            secure=security is not None and bool(security.require_encryption or address.startswith("tls")),
            allow_insecure=allow_insecure,
        )


def _check_address(address: str, *, secure: bool, allow_insecure: bool) -> None:
    """Refuse unknown schemes, and plaintext to a non-loopback host unless opted in."""
    scheme, _, rest = address.rpartition("://")
    scheme = scheme or "tcp"
    if scheme not in KNOWN_SCHEMES:
        raise ValueError(
            f"address {address!r}: unknown scheme {scheme!r} "
            f"(expected one of {', '.join(sorted(KNOWN_SCHEMES))})"
        )
    host = urlsplit(f"//{rest}").hostname or ""
    if scheme in PLAINTEXT_SCHEMES and not secure and not allow_insecure and not is_loopback(host):
        raise ValueError(
            f"address {address!r}: refusing a plaintext {scheme}:// connection to a "
            "non-loopback host. Use tls:// with security=distributed.Security(...), "
            "or pass allow_insecure=True if the network is private and firewalled."
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


ProbeFactory = Callable[[], Any]


def _check_probe(value: str | ProbeFactory | None) -> None:
    if value is None or callable(value):
        return
    module, sep, name = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not (sep and module and name.isidentifier()):
        raise ValueError(
            f"memory_probe {value!r} is neither a callable nor an import path like 'package.module:factory'"
        )


# Cluster keywords dask-cuda no longer takes, and what to use instead. Left to the
# cluster, they reach each worker's constructor and fail there, after the cluster began.
REMOVED_CLUSTER_KWARGS = {
    "jit_unspill": "dask-cuda removed JIT-unspill (its proxy objects); "
    "use enable_cudf_spill=True (cuDF's own spilling, on the workers and in this process)",
}


def check_cluster_kwargs(cluster_kwargs: Mapping[str, Any] | None) -> None:
    """A ValueError naming a keyword the cluster no longer takes (``REMOVED_CLUSTER_KWARGS``)."""
    for name in cluster_kwargs or ():
        if cluster_kwargs is not None and name in REMOVED_CLUSTER_KWARGS:
            raise ValueError(
                f"cluster_kwargs {name}={cluster_kwargs[name]!r} is no longer an option: "
                f"{REMOVED_CLUSTER_KWARGS[name]}"
            )


@dataclass(frozen=True)
class RunnerSettings:
    """What the runner routes by and what the guard tolerates.

    Args:
        tag_resources: extra tag -> resources map, e.g. ``{"nvme": {"NVME": 1}}``.
        on_missing_gpu: ``"cpu"`` (run unrestricted, warn) or ``"error"`` (fail fast).
        guard: which tasks the GPU memory guard measures: ``"gpu"``, ``"all"``, ``"off"``.
        leak_threshold: bytes (or a size string) a task may leave on its GPU.
        memory_limit: fraction of GPU memory above which a worker is recycled, where
            its own memory takes the GPU there (judged after each guarded task, on a
            whole-GPU figure at most 1 s old, confirmed by a fresh reading).
        restart: ``"worker"`` (only the offending one), ``"cluster"`` or ``"never"``.
        restart_after_tasks: recycle a GPU worker after this many guarded tasks.
        memory_probe: what the guard reads memory through instead of NVML: a callable
            returning a ``MemoryProbe`` (or None for "no GPU here"), or its import path
            ``"package.module:factory"``, resolved on each worker.
        oom_retries: retries a ``gpu`` task run gets for CUDA out-of-memory errors, on
            top of its own ``retries`` (which keep counting its other failures).
        gpu_wait_s: on a cluster that can still grow, how long a task whose resources no
            worker offers waits for one to join before ``on_missing_gpu`` applies.
        health_check_s: seconds between a GPU worker's NVML health checks on a timer
            (each ``gpu`` task is also checked before it starts); None: no checks.
        host_gpu_lock: hold each GPU for one cluster at a time on its host, so flow runs
            that each start a cluster on the same GPUs take turns instead of sharing
            them blindly (``worker.host_gpu_lock``).
        host_cluster: with no ``address``, ``cluster``, ``cluster_class`` or
            ``cluster_kwargs``, join this user's host cluster (``prefect-gpu-dask cluster
            start``) where one runs, instead of starting a cluster of the flow run's own.
        stall_s: a guarded ``gpu`` task whose thread stays in one call, using no CPU,
            while its GPU does no work (no SM activity, no memory change) this long is
            stalled (``worker.stall``); None: never.
        on_stall: ``"warn"`` (a WARNING and a Prefect event) or ``"fail"`` (also ends the
            task run ``TimedOut`` and recycles its worker, as a hung timeout does).
        settle_s: how long the guard lets the driver settle before confirming a leak.
    """

    tag_resources: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    on_missing_gpu: OnMissingGPU = "cpu"
    guard: GuardScope = "gpu"
    leak_threshold: int = 256 * 2**20
    memory_limit: float = 0.9
    restart: RestartPolicy = "worker"
    restart_after_tasks: int | None = None
    memory_probe: str | ProbeFactory | None = None
    oom_retries: int = 0
    gpu_wait_s: float = 60.0
    health_check_s: float | None = 30.0
    host_gpu_lock: bool = True
    host_cluster: bool = True
    stall_s: float | None = None
    on_stall: OnStall = "warn"
    settle_s: float = 0.05

    def __post_init__(self) -> None:
        object.__setattr__(self, "tag_resources", validate_tag_resources(self.tag_resources))
        _choice("on_missing_gpu", self.on_missing_gpu, ON_MISSING_GPU)
        _choice("guard", self.guard, GUARD_SCOPES)
        _choice("restart", self.restart, RESTART_POLICIES)
        object.__setattr__(self, "leak_threshold", parse_threshold(self.leak_threshold))
        limit = self.memory_limit
        if (
            isinstance(limit, bool)
            or not isinstance(limit, (int, float))
            or not math.isfinite(limit)
            or not 0 < limit <= 1
        ):
            raise ValueError(f"memory_limit {limit!r} must be a fraction in (0, 1]")
        count = self.restart_after_tasks
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ValueError(f"restart_after_tasks {count!r} must be a whole number >= 1 or None")
        _check_probe(self.memory_probe)
        count = self.oom_retries
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"oom_retries {count!r} must be a whole number >= 0")
        wait = self.gpu_wait_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < math.inf:
            raise ValueError(f"gpu_wait_s {wait!r} must be a number of seconds >= 0")
        every = self.health_check_s
        if every is not None and (
            isinstance(every, bool) or not isinstance(every, (int, float)) or not 0 < every < math.inf
        ):
            raise ValueError(f"health_check_s {every!r} must be a number of seconds > 0, or None")
        if not isinstance(self.host_gpu_lock, bool):
            raise ValueError(f"host_gpu_lock {self.host_gpu_lock!r} must be True or False")
        if not isinstance(self.host_cluster, bool):
            raise ValueError(f"host_cluster {self.host_cluster!r} must be True or False")
        stall = self.stall_s
        if stall is not None and (
            isinstance(stall, bool) or not isinstance(stall, (int, float)) or not 0 < stall < math.inf
        ):
            raise ValueError(f"stall_s {stall!r} must be a number of seconds > 0, or None")
        _choice("on_stall", self.on_stall, ON_STALL)
        settle = self.settle_s
        if isinstance(settle, bool) or not isinstance(settle, (int, float)) or not 0 <= settle < 60:
            raise ValueError(f"settle_s {settle!r} must be a number of seconds in [0, 60)")

    __hash__ = None  # type: ignore[assignment]  # holds a mapping

    def arguments(self) -> dict[str, Any]:
        """The runner's constructor arguments these settings came from (validated form)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "settle_s"}
