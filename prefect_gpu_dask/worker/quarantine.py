"""Sick GPUs: checked on their worker, quarantined once, and their ``gpu`` tasks moved on.

What runs on the worker, and what it starts elsewhere:

- worker: ``HealthWatch``, held by the worker's guard, judges its GPU through
  ``health.HealthMonitor`` on a timer and, through ``screen``, right before each task
  that asked for a GPU. The first unhealthy verdict quarantines the GPU, once; the
  worker is never restarted onto it (the recycler leaves it alone) and reports a
  ``GPUQuarantine`` to the flow.
- scheduler (``scheduler.quarantine``): ``withdraw`` sets the worker's GPU resources
  to 0, so no ``gpu`` task is sent there again, unless no other worker offers a GPU:
  then the worker keeps them, so ``gpu`` tasks still reach it and fail at once instead
  of waiting for a GPU that will not come.
- worker, per task (``worker.taskrun.run_task_run``): a ``gpu`` task on a quarantined
  GPU goes back to the scheduler (``distributed.Reschedule``) before Prefect's engine
  starts, to run on a healthy GPU, or, with none left, fails with ``UnhealthyGPUError``.
- flow: the ``Recycler`` leaves the worker alone; ``reporting`` logs each
  ``GPUQuarantine``, emits ``prefect-gpu-dask.gpu.unhealthy`` and lists it in the summary.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from prefect_gpu_dask.errors import UnhealthyGPUError
from prefect_gpu_dask.health import HealthMonitor, HealthVerdict
from prefect_gpu_dask.records import UNHEALTHY_TOPIC, GPUQuarantine
from prefect_gpu_dask.resources import GPU_RESOURCE
from prefect_gpu_dask.scheduler.quarantine import withdraw
from prefect_gpu_dask.worker.taskwrap import refused

logger = logging.getLogger(__name__)
TIMER_NAME = "prefect-gpu-dask-health"


class HealthWatch:
    """One GPU worker's health checks and, once it is sick, its quarantine."""

    def __init__(self, monitor: HealthMonitor, worker: Any, gpu: Any, interval_s: float):
        self.monitor = monitor
        self.worker = worker
        self.gpu = gpu
        self.interval_s = interval_s
        self.quarantine: GPUQuarantine | None = None
        self._verdict: HealthVerdict | None = None
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._withdrawing: asyncio.Future | None = None

    def start(self) -> None:
        """On the worker's event loop: check now, then every ``interval_s``."""
        for limit in self.monitor.limits:
            logger.info("GPU health on %s: %s", self.worker.address, limit)
        self._set_timer()
        self.worker.loop.add_callback(self._tick)

    def _set_timer(self) -> None:
        from tornado.ioloop import PeriodicCallback

        if (old := self.worker.periodic_callbacks.pop(TIMER_NAME, None)) is not None:
            old.stop()
        timer = PeriodicCallback(self._tick, self.interval_s * 1000)
        self.worker.periodic_callbacks[TIMER_NAME] = timer
        timer.start()

    def tighten(self, interval_s: float) -> None:
        """Check every ``interval_s`` from now on, if that is more often: flow runs
        sharing this GPU may ask for different intervals, and the strictest applies."""
        if interval_s >= self.interval_s:
            return
        logger.warning(  # another flow run's setting now applies to this one's GPU too
            "GPU health checks on %s every %g s, the shortest interval a flow run using it "
            "asked for (was %g s)",
            self.worker.address,
            interval_s,
            self.interval_s,
        )
        self.interval_s = interval_s
        self.worker.loop.add_callback(self._set_timer)

    def close(self) -> None:
        timer = self.worker.periodic_callbacks.pop(TIMER_NAME, None)
        if timer is not None:
            timer.stop()
        self.monitor.close()

    def check(self, before_task: bool = False) -> HealthVerdict | None:
        """Judge the GPU now (``before_task``: as ``HealthMonitor.screen`` does); the
        unhealthy verdict is kept (a quarantine never lifts)."""
        with self._lock:
            if self._verdict is not None:
                return self._verdict
            verdict = self.monitor.screen() if before_task else self.monitor.check()
            for warning in set(verdict.warnings) - self._warned:
                self._warned.add(warning)
                logger.warning("GPU %s on %s: %s", self.gpu.uuid, self.worker.address, warning)
            if verdict.healthy:
                return None
            self._verdict = verdict
            return verdict

    async def _tick(self) -> None:
        try:
            if self.check() is not None and (self.quarantine is None or not self.quarantine.withdrawn):
                await self.withdraw()
        except Exception:  # a failing check must never break the worker
            logger.exception("GPU health check failed on %s", self.worker.address)

    async def withdraw(self) -> GPUQuarantine:
        """Quarantine this worker's GPU (once), or retry giving its GPU up to others."""
        if self._withdrawing is None or self._withdrawing.done():
            self._withdrawing = asyncio.ensure_future(self._withdraw())
        return await asyncio.shield(self._withdrawing)

    async def _withdraw(self) -> GPUQuarantine:
        from prefect_gpu_dask._compat import run_on_scheduler_from_worker

        verdict = self._verdict
        assert verdict is not None
        try:
            answer = await run_on_scheduler_from_worker(self.worker, withdraw, worker=self.worker.address)
        # The scheduler gone, or without this package there: keep the GPU, refuse its tasks.
        except (OSError, TimeoutError, ImportError, AttributeError, TypeError, RuntimeError) as exc:
            logger.warning("Could not withdraw the GPU of %s on the scheduler: %r", self.worker.address, exc)
            answer = {"withdrawn": False, "others": 0}
        kept = self.quarantine
        record = GPUQuarantine(
            worker=self.worker.address,
            worker_name=str(self.worker.name),
            pid=os.getpid(),
            gpu_index=self.gpu.index,
            gpu_uuid=self.gpu.uuid,
            reasons=verdict.reasons,
            warnings=verdict.warnings,
            withdrawn=answer["withdrawn"],
            healthy_gpu_workers=answer["others"],
            time=time.time() if kept is None else kept.time,
        )
        if kept is None or record.withdrawn != kept.withdrawn:
            self.quarantine = kept = record
            self.worker.log_event(UNHEALTHY_TOPIC, record.to_event())
            logger.error(
                "Quarantined %s: %s",
                record.describe(),
                "its gpu tasks go to healthy GPUs"
                if record.withdrawn
                else "no healthy GPU is left, gpu tasks sent here fail",
            )
        return kept

    def screen(self) -> GPUQuarantine | None:
        """In a worker thread, before a ``gpu`` task: this GPU's quarantine, if it is sick."""
        if self.check(before_task=True) is None:
            return None
        if self.quarantine is None or not self.quarantine.withdrawn:
            from distributed.utils import sync

            sync(self.worker.loop, self.withdraw)  # a healthy GPU may have joined since
        return self.quarantine


def screen(
    task: Any, restrictions: Mapping[str, float] | None, health: Callable[[], HealthWatch | None]
) -> Any:
    """Before a task run starts on this worker: the task to run. ``health``: this
    worker's health checks (None: its GPU is not checked), asked for a ``gpu`` task only.

    A task that asked for a GPU, on a quarantined one, goes back to the scheduler
    (``distributed.Reschedule``) where a healthy GPU took over, or is cloned to fail
    with ``UnhealthyGPUError`` where none is left. Anything else runs as it is.
    """
    if not restrictions or restrictions.get(GPU_RESOURCE, 0) <= 0:
        return task
    watch = health()
    quarantine = watch.screen() if watch is not None else None
    if quarantine is None:
        return task
    if quarantine.withdrawn:
        import distributed

        logger.warning("%s goes back to the scheduler: quarantined %s", task.name, quarantine.describe())
        raise distributed.Reschedule()  # Prefect's engine never saw it start
    return refused(
        task,
        UnhealthyGPUError(
            f"Quarantined {quarantine.describe()}. No healthy GPU is left in the cluster, so "
            "this gpu task was not run."
        ),
    )
