"""A GPU worker's gauges, on the worker's own ``/metrics`` (Dask's HTTP server: no new port).

Read through the guard's probe when Prometheus scrapes (NVML, or the runner's
``memory_probe``): GPU memory used and total, SM utilisation, power, temperature, and
whether the GPU is quarantined. Labelled with the GPU's index, UUID and model. The
counters (verdicts, OOMs, restarts, GPU-seconds, energy) are the scheduler's
(``scheduler.metrics``): they must outlive a recycled worker.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

from prefect_gpu_dask import nvml

logger = logging.getLogger(__name__)
PREFIX = "prefect_gpu_dask"
_collector: GPUGauges | None = None
_lock = threading.Lock()


class GPUGauges:
    """``prometheus_client`` collector over this process's guard."""

    def __init__(self) -> None:
        self.guard: Any = None

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        guard = self.guard
        probe = getattr(guard, "probe", None)
        if probe is None:
            return
        gpu = probe.gpu
        names = ["gpu", "uuid", "model"]
        labels = [str(gpu.index), gpu.uuid, gpu.name or "unknown"]

        def gauge(name: str, doc: str, value: float | None) -> Any:
            metric = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=names)
            if value is not None:
                metric.add_metric(labels, value)
            return metric

        try:
            sample = probe.sample()
            used, total = sample.device_used, sample.device_total or gpu.memory_total
        except nvml.READ_ERRORS as exc:  # a scrape must never fail for one reading
            logger.debug("GPU memory not readable for /metrics: %r", exc)
            used, total = None, gpu.memory_total or None
        yield gauge("gpu_memory_used_bytes", "GPU memory in use on this worker's GPU", used)
        yield gauge("gpu_memory_total_bytes", "This worker's GPU memory", total)
        activity = guard.activity
        utilization = power = temperature = None
        if activity is not None:
            try:
                source = activity.reader
                instant = source.instant()
                percent = source.device_utilization()
                utilization = None if percent is None else percent / 100
                power = None if instant.power_mw is None else instant.power_mw / 1000
                temperature = instant.temperature_c
            except nvml.READ_ERRORS as exc:
                logger.debug("GPU activity not readable for /metrics: %r", exc)
        yield gauge("gpu_sm_utilization_ratio", "Share of the GPU's time its SMs were busy", utilization)
        yield gauge("gpu_power_watts", "The GPU's power draw", power)
        yield gauge("gpu_temperature_celsius", "The GPU's temperature", temperature)
        health = getattr(guard, "health", None)
        quarantined = 1.0 if health is not None and health.quarantine is not None else 0.0
        yield gauge("gpu_quarantined", "1 once the worker's health checks quarantined its GPU", quarantined)


def serve_gauges(guard: Any) -> None:
    """Publish ``guard``'s GPU on this process's ``/metrics`` (once per process; a
    later guard, after a plugin re-registration, takes the place of the earlier)."""
    global _collector
    with _lock:
        if _collector is None:
            try:
                from prometheus_client import REGISTRY
            except ImportError:  # no prometheus_client: Dask serves no /metrics either
                return
            _collector = GPUGauges()
            REGISTRY.register(_collector)
        _collector.guard = guard
