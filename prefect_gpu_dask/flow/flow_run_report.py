"""What a flow run did to its GPUs, read back from the Prefect API once it is over.

The records come from the table artifacts the runner publishes (one per task run as
each task finishes, or one for several that ended together, and the flow-wide table at
flow end), so a flow run that crashed
still has the records of every task that finished; the restarts come from the
``gpu-restarts`` table the runner publishes before the flow run returns, and from the
``prefect-gpu-dask.worker.restarted`` events related to the flow run (which a crashed
flow run still sent, but which the API may store a few seconds after the run ends). No runner,
cluster or GPU is needed to read them: any process that reaches the API can.

Example:
    ```python
    from prefect_gpu_dask import read_flow_run_gpu_report

    report = read_flow_run_gpu_report("4b7c...-flow-run-id")
    for record in report.leaks:
        print(record.task_run_name, record.delta, record.worker)
    for restart in report.restarts:
        print(restart.worker_name, restart.reason, restart.memory_free_s, restart.serving_s)
    ```
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from prefect_gpu_dask.flow.reporting import (
    BATCH_TABLE_DESCRIPTION,
    RESTART_EVENT,
    RESTARTS_KEY,
    TABLE_KEY,
    TASK_TABLE_DESCRIPTION,
    UNHEALTHY_EVENT,
)
from prefect_gpu_dask.records import LEAK, GPUQuarantine, RestartRecord, TaskRecord

PAGE = 200  # the API's default page limit for artifacts
EVENTS_PAGE = 50  # and its most events per page


@dataclass(frozen=True)
class FlowRunGPUReport:
    """The guard's records, the runner's restarts and the GPUs quarantined of one flow
    run, oldest first."""

    flow_run_id: str
    records: tuple[TaskRecord, ...]
    restarts: tuple[RestartRecord, ...]
    quarantines: tuple[GPUQuarantine, ...] = ()  # GPUs found sick while the flow run used them

    @property
    def leaks(self) -> tuple[TaskRecord, ...]:
        return tuple(r for r in self.records if r.verdict == LEAK)

    def for_task_run(self, task_run_id: str | UUID) -> tuple[TaskRecord, ...]:
        """A task run's records: one per attempt (an OOM retry adds one)."""
        return tuple(r for r in self.records if r.task_run_id == str(task_run_id))


def _rows(data: Any) -> list[dict[str, Any]]:
    rows = json.loads(data) if isinstance(data, str) else data
    return [row for row in rows or () if isinstance(row, dict)]


def _records(artifacts: Iterable[Any]) -> tuple[TaskRecord, ...]:
    seen: dict[tuple[Any, ...], TaskRecord] = {}
    for artifact in artifacts:
        live = (artifact.description or "").startswith((TASK_TABLE_DESCRIPTION, BATCH_TABLE_DESCRIPTION))
        ours = artifact.key == TABLE_KEY or live
        if not ours:  # the API filter already asked for tables
            continue
        for row in _rows(artifact.data):
            try:
                record = TaskRecord.from_row(row)
            except (TypeError, ValueError, KeyError):
                continue  # a table of an older release, or someone else's under our key
            # The flow-end table repeats what the live tables said.
            seen[(record.task_run_id, record.pid, record.time)] = record
    return tuple(sorted(seen.values(), key=lambda r: r.time))


def _restarts(artifacts: Iterable[Any], events: Iterable[Any]) -> tuple[RestartRecord, ...]:
    payloads = [row for a in artifacts if a.key == RESTARTS_KEY for row in _rows(a.data)]
    payloads += [e.payload for e in events if e.event == RESTART_EVENT]
    seen: dict[tuple[Any, ...], RestartRecord] = {}  # each restart is in the table and an event
    for payload in payloads:
        try:
            restart = RestartRecord.from_payload(payload)
        except (TypeError, ValueError):
            continue
        seen[(restart.worker, restart.requested_at)] = restart
    return tuple(sorted(seen.values(), key=lambda r: r.requested_at))


def _quarantines(events: Iterable[Any]) -> tuple[GPUQuarantine, ...]:
    seen: dict[tuple[Any, ...], GPUQuarantine] = {}
    for event in events:
        if event.event != UNHEALTHY_EVENT:
            continue
        try:
            quarantine = GPUQuarantine.from_event(event.payload)
        except (TypeError, ValueError, KeyError):
            continue
        seen[(quarantine.gpu_uuid, quarantine.worker, quarantine.time)] = quarantine
    return tuple(sorted(seen.values(), key=lambda q: q.time))


def _filters(flow_run_id: str) -> tuple[Any, Any]:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType
    from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

    artifacts = ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run_id)]),
        type=ArtifactFilterType(any_=["table"]),
    )
    events = EventFilter(
        event=EventNameFilter(name=[RESTART_EVENT, UNHEALTHY_EVENT]),
        related=EventRelatedFilter(id=[f"prefect.flow-run.{flow_run_id}"]),
    )
    return artifacts, events


def read_flow_run_gpu_report(flow_run_id: str | UUID) -> FlowRunGPUReport:
    """The records, restarts and quarantines of ``flow_run_id``, from the current Prefect API."""
    from prefect.utilities.asyncutils import run_coro_as_sync

    return run_coro_as_sync(aread_flow_run_gpu_report(flow_run_id))


async def aread_flow_run_gpu_report(flow_run_id: str | UUID) -> FlowRunGPUReport:
    """``read_flow_run_gpu_report`` for async code."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import ArtifactSort

    flow_run_id = str(UUID(str(flow_run_id)))
    artifact_filter, event_filter = _filters(flow_run_id)
    artifacts: list[Any] = []
    async with get_client() as client:
        # Newest first: one published while this reads pushes the rest a place down, so a
        # row is read twice (and de-duplicated), never skipped.
        while page := await client.read_artifacts(
            artifact_filter=artifact_filter, sort=ArtifactSort.CREATED_DESC, limit=PAGE, offset=len(artifacts)
        ):
            artifacts += page
            if len(page) < PAGE:
                break
        events_page = await client.read_events(filter=event_filter, limit=EVENTS_PAGE)
        events = list(events_page.events)
        while events_page.next_page is not None:
            events_page = await client.read_events_page(str(events_page.next_page))
            events += events_page.events
    return FlowRunGPUReport(
        flow_run_id, _records(artifacts), _restarts(artifacts, events), _quarantines(events)
    )
