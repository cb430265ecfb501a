"""The cluster's GPU metrics, on the scheduler's own ``/metrics`` (Dask's HTTP server).

``GPUMetrics`` is a small ``SchedulerPlugin``. Gauges are read from the scheduler's state
when Prometheus scrapes: GPU workers by model, ``GPU`` slots offered and in use, ``gpu``
tasks waiting for a slot. Counters come from what the workers already send the
scheduler (each guard's ``TaskRecord`` and each hung task, as Dask worker events) and
from the restarts it carries out: they live here, not on the workers, because a
recycled worker's process would take its counters with it, the leak that recycled it
included. Labels are bounded: worker name, GPU UUID and model, flow name, a verdict or a
reason kind; never a flow run or a task run.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

from distributed import SchedulerPlugin

from prefect_gpu_dask.records import HUNG_TOPIC, RECORD_TOPIC
from prefect_gpu_dask.resources import GPU_RESOURCE, MEMORY_RESOURCE

PREFIX = "prefect_gpu_dask"
# Where this scheduler's counts live: one collector per process, read at each scrape.
_counts: Counts | None = None
_lock = threading.RLock()


class Counts:
    """What the cluster's GPU workers did, by (worker name, GPU UUID)."""

    def __init__(self) -> None:
        self.reset(None)

    def reset(self, scheduler: Any) -> None:
        """Count for ``scheduler`` from zero (a new scheduler is a new scrape target)."""
        self.scheduler: Any = scheduler
        self.verdicts: Counter[tuple[str, str, str]] = Counter()  # (worker, gpu, verdict)
        self.ooms: Counter[tuple[str, str]] = Counter()
        self.hung: Counter[tuple[str, str]] = Counter()  # (worker, gpu: "" where unknown)
        self.stalled: Counter[tuple[str, str]] = Counter()
        # (worker, gpu, flow name)
        self.gpu_seconds: defaultdict[tuple[str, str, str], float] = defaultdict(float)
        self.energy_joules: defaultdict[tuple[str, str, str], float] = defaultdict(float)
        self.restarts: Counter[str] = Counter()  # by reason kind: leak, oom, memory limit, recycle, hung

    def record(self, event: dict[str, Any]) -> None:
        where = (str(event.get("worker_name")), str(event.get("gpu_uuid")))
        verdict = (*where, str(event.get("verdict")))
        self.verdicts[verdict] += 1
        if event.get("verdict") == "oom":
            self.ooms[where] += 1
        per_flow = (*where, str(event.get("flow_name") or "unknown"))
        self.gpu_seconds[per_flow] += float(event.get("gpu_seconds") or 0.0)
        # The whole GPU's energy over the task, times the task's share of the GPU.
        share = event.get("gpu_share") or 1.0
        self.energy_joules[per_flow] += float(event.get("energy_j") or 0.0) * float(share)

    def collect(self) -> Iterator[Any]:
        yield from self._gauges()
        yield from self._counters()

    def _gauges(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        workers = list(self.scheduler.workers.values()) if self.scheduler is not None else []
        by_model: Counter[str] = Counter()
        offered: float = 0.0
        used: float = 0.0
        for ws in workers:
            if not ws.resources.get(GPU_RESOURCE):
                continue
            by_model[_model(ws.resources)] += 1
            offered += ws.resources[GPU_RESOURCE]
            used += ws.used_resources.get(GPU_RESOURCE, 0.0)
        gpu_workers = GaugeMetricFamily(f"{PREFIX}_gpu_workers", GPU_WORKERS_DOC, labels=["model"])
        for model, count in sorted(by_model.items()):
            gpu_workers.add_metric([model], count)
        yield gpu_workers
        slots = GaugeMetricFamily(f"{PREFIX}_gpu_slots", SLOTS_DOC, labels=["state"])
        slots.add_metric(["offered"], offered)
        slots.add_metric(["in_use"], used)
        yield slots
        unrunnable = self.scheduler.unrunnable if self.scheduler is not None else ()
        waiting = sum(1 for ts in unrunnable if GPU_RESOURCE in (ts.resource_restrictions or {}))
        yield GaugeMetricFamily(f"{PREFIX}_gpu_tasks_waiting", WAITING_DOC, value=waiting)

    def _counters(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        with _lock:
            verdicts = CounterMetricFamily(
                f"{PREFIX}_task_verdicts", VERDICTS_DOC, labels=["worker", "gpu", "verdict"]
            )
            for labels, count in sorted(self.verdicts.items()):
                verdicts.add_metric(list(labels), count)
            yield verdicts
            for name, doc, counts, label_names in (
                ("task_ooms", OOMS_DOC, self.ooms, ["worker", "gpu"]),
                ("tasks_hung", HUNG_DOC, self.hung, ["worker", "gpu"]),
                ("tasks_stalled", STALLED_DOC, self.stalled, ["worker", "gpu"]),
                ("gpu_seconds", GPU_SECONDS_DOC, self.gpu_seconds, ["worker", "gpu", "flow"]),
                ("gpu_energy_joules", ENERGY_DOC, self.energy_joules, ["worker", "gpu", "flow"]),
            ):
                metric = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=label_names)
                for key, value in sorted(counts.items()):
                    metric.add_metric(list(key), value)
                yield metric
            restarts = CounterMetricFamily(f"{PREFIX}_worker_restarts", RESTARTS_DOC, labels=["reason"])
            for reason, count in sorted(self.restarts.items()):
                restarts.add_metric([reason], count)
            yield restarts


def _model(resources: dict[str, float]) -> str:
    """A worker's GPU model, from the ``GPU-<MODEL>`` resource its labels added."""
    prefix = f"{GPU_RESOURCE}-"
    models = [
        name[len(prefix) :] for name in resources if name.startswith(prefix) and name != MEMORY_RESOURCE
    ]
    return models[0] if models else "unknown"


GPU_WORKERS_DOC = "Workers offering a GPU slot, by GPU model"
SLOTS_DOC = "GPU slots the workers offer, and those in use"
WAITING_DOC = "Tasks waiting for a free GPU slot"
VERDICTS_DOC = "Guarded task runs by verdict"
OOMS_DOC = "Task runs that ran out of GPU memory"
HUNG_DOC = "Task runs stuck past their timeout outside Python"
STALLED_DOC = "Task runs stalled: in one call, with no CPU and no GPU work, for stall_s"
GPU_SECONDS_DOC = "Task run seconds times their share of a GPU"
ENERGY_DOC = "GPU energy over task runs, times their share of the GPU"
RESTARTS_DOC = "GPU workers restarted, by reason"


def counts() -> Counts:
    """This scheduler's counts, registered with ``prometheus_client`` on first use."""
    global _counts
    with _lock:
        if _counts is None:
            _counts = Counts()
            try:
                from prometheus_client import REGISTRY

                REGISTRY.register(_counts)
            except ImportError:  # no prometheus_client: Dask serves no /metrics either
                pass
        return _counts


def count_restart(reason: str) -> None:
    """A worker restart carried out on this scheduler, by the kind of its reason."""
    kind = reason.split(":", 1)[0].strip() or "unknown"
    with _lock:
        counts().restarts[kind] += 1


class GPUMetrics(SchedulerPlugin):
    """Counts what GPU workers report, and serves the GPU metrics at ``/metrics``."""

    name = "prefect-gpu-dask-metrics"
    idempotent = True

    async def start(self, scheduler: Any) -> None:
        # One collector per process, as Dask's own: it serves the latest scheduler
        # started here (local clusters in one process follow one another).
        with _lock:
            if counts().scheduler is not scheduler:
                counts().reset(scheduler)

    def log_event(self, topic: str, msg: Any) -> None:
        if not isinstance(msg, dict):
            return
        if topic == RECORD_TOPIC:
            with _lock:
                counts().record(msg)
        elif topic == HUNG_TOPIC:
            with _lock:
                which = counts().stalled if msg.get("stalled") else counts().hung
                which[(str(msg.get("worker_name")), "")] += 1
