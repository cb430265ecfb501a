"""What the Prefect UI shows: table and markdown artifacts, and events for automations.

Each guarded task's record becomes a table artifact on its own task run within moments
of the flow hearing of it (``LivePublisher``), so a flow that runs for hours, or dies,
still shows what every finished task did to its GPU; records of task runs that end close
together (hundreds of short ones) go out as one table on the flow run instead. The
flow-wide table and summary come when the flow ends.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any
from uuid import UUID

from prefect_gpu_dask.flow import chart, sizing
from prefect_gpu_dask.flow.prefect_api import API_ERRORS
from prefect_gpu_dask.records import (
    BYTE_FIELDS,
    LEAK,
    OOM,
    VERDICTS,
    GPUQuarantine,
    HungTask,
    RestartRecord,
    TaskRecord,
    format_bytes,
)

TABLE_KEY = "gpu-memory"
SUMMARY_KEY = "gpu-memory-summary"
RESTARTS_KEY = "gpu-restarts"
LEAK_EVENT = "prefect-gpu-dask.leak.detected"
RESTART_EVENT = "prefect-gpu-dask.worker.restarted"
UNHEALTHY_EVENT = "prefect-gpu-dask.gpu.unhealthy"
STALLED_EVENT = "prefect-gpu-dask.task-run.stalled"
TABLE_COLUMNS = (
    "task_run_name",
    "verdict",
    "before",
    "after",
    "peak",
    "delta",
    "allocator_delta",
    "allocator",
    "duration_s",
    "gpu_index",
    "gpu_uuid",
    "worker",
    "tags",
    "task_run_id",
    "flow_run_id",
    "restart_reason",
    "oom_requested",
    "gpu_share",
    "gpu_seconds",
    "sm_util_mean",
    "sm_util_peak",
    "util_scope",
    "energy_j",
    "temperature_peak_c",
    "throttle_reasons",
    "task_name",
    "worker_name",
    "pid",
    "device_used",
    "device_total",
    "oom_library",
    "time",
    "flow_name",
)
TASK_TABLE_DESCRIPTION = "GPU memory of this task run"
BATCH_TABLE_DESCRIPTION = "GPU memory of task runs that ended together"
# Up to this many clean records gathered together still get a table each on their task
# runs; more than that, and task runs end faster than the API takes artifacts one by one.
ONE_BY_ONE_UP_TO = 4
GATHER_S = 0.25  # how long the publisher gathers records after the first it takes
MOST_GATHERED = 200  # items taken at once: a table that fails to be written loses no more


Described = TaskRecord | RestartRecord | GPUQuarantine | HungTask
OnGPU = TaskRecord | RestartRecord | GPUQuarantine  # what names the GPU it happened on


def _related(record: Described) -> list[dict[str, str]]:
    related = []
    if record.flow_run_id:
        related.append(
            {
                "prefect.resource.id": f"prefect.flow-run.{record.flow_run_id}",
                "prefect.resource.role": "flow-run",
            }
        )
    if record.task_run_id:
        related.append(
            {
                "prefect.resource.id": f"prefect.task-run.{record.task_run_id}",
                "prefect.resource.role": "task-run",
            }
        )
    return related


def _uuid(run_id: str | None) -> UUID | None:
    return UUID(run_id) if run_id else None


def _gpu_resource(record: OnGPU) -> dict[str, str]:
    return {
        "prefect.resource.id": f"prefect-gpu-dask.gpu.{record.gpu_uuid or 'unknown'}",
        "prefect.resource.name": f"GPU {record.gpu_index} on {record.worker}",
        "prefect-gpu-dask.worker": str(record.worker),
    }


def _emit(event: str, record: OnGPU, payload: dict[str, Any]) -> None:
    from prefect.events import emit_event

    emit_event(event=event, resource=_gpu_resource(record), related=_related(record), payload=payload)


def emit_leak_event(record: TaskRecord) -> None:
    _emit(LEAK_EVENT, record, record.to_event())


def emit_restart_event(restart: RestartRecord) -> None:
    _emit(RESTART_EVENT, restart, restart.to_payload())


def emit_unhealthy_event(quarantine: GPUQuarantine) -> None:
    _emit(UNHEALTHY_EVENT, quarantine, quarantine.to_event())


def emit_stalled_event(hung: HungTask) -> None:
    from prefect.events import emit_event

    resource = {
        "prefect.resource.id": f"prefect.task-run.{hung.task_run_id}",
        "prefect.resource.name": hung.task_run_name,
        "prefect-gpu-dask.worker": hung.worker,
    }
    flow_run = [r for r in _related(hung) if r["prefect.resource.role"] == "flow-run"]
    emit_event(event=STALLED_EVENT, resource=resource, related=flow_run, payload=hung.to_event())


def table_rows(records: Sequence[TaskRecord]) -> list[dict[str, Any]]:
    """One row per record: sizes readable (``before``) and as numbers (``before_bytes``)."""
    rows = []
    for record in records:
        values = asdict(record)
        row = {column: values[column] for column in TABLE_COLUMNS}
        for column in BYTE_FIELDS:
            row[column] = "n/a" if values[column] is None else format_bytes(values[column])
        row.update({f"{column}_bytes": values[column] for column in BYTE_FIELDS})
        row["tags"] = ", ".join(record.tags)
        rows.append(row)
    return rows


class LivePublisher:
    """Publishes the records as table artifacts (on their task runs, or several together
    on the flow run), a leak as an event, and each quarantined GPU as an event, in the
    background.

    Built in the flow's thread (whose context reaches the flow's API); records arrive
    on Dask's event loop, which must not wait for the API. The embedded server takes an
    artifact as a transaction of its own, in milliseconds, beside the task runs' own
    writes: when more than ``ONE_BY_ONE_UP_TO`` clean records come within ``GATHER_S``
    (or wait), they go out as one table on the flow run, so however many task runs end,
    the server takes at most that many tables per ``GATHER_S``, and the flow run's end,
    which waits for the backlog, stays short. A leak, an OOM or a restart keeps its own
    table on its task run.
    """

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self._records: queue.Queue[TaskRecord | GPUQuarantine | None] = queue.Queue()
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._run,), name="gpu-records", daemon=True
        )
        self._thread.start()

    def publish(self, record: TaskRecord) -> None:
        self._records.put(record)

    def quarantined(self, quarantine: GPUQuarantine) -> None:
        """Log a GPU found sick, and emit its event."""
        if quarantine.withdrawn:
            self.logger.error(
                "Quarantined %s. Its gpu tasks go to the %d other GPU worker(s)",
                quarantine.describe(),
                quarantine.healthy_gpu_workers,
            )
        else:
            self.logger.error(
                "Quarantined %s. No healthy GPU is left: gpu tasks fail with UnhealthyGPUError",
                quarantine.describe(),
            )
        self._records.put(quarantine)

    def close(self, timeout: float = 30.0) -> None:
        """Publish what is queued (up to ``timeout``), then stop."""
        self._records.put(None)
        self._thread.join(timeout)

    def _gathered(self) -> tuple[list[TaskRecord | GPUQuarantine], bool]:
        """The next item and those that come within ``GATHER_S`` of it (all that wait,
        when the publisher is behind); whether the end was among them."""
        items = [self._records.get()]
        until = time.monotonic() + GATHER_S
        while items[-1] is not None and len(items) < MOST_GATHERED:
            try:
                items.append(self._records.get(timeout=max(0.0, until - time.monotonic())))
            except queue.Empty:
                break
        ended = items[-1] is None
        return [item for item in items if item is not None], ended

    def _run(self) -> None:
        ended = False
        while not ended:
            items, ended = self._gathered()
            records = [item for item in items if isinstance(item, TaskRecord)]
            for quarantine in (item for item in items if isinstance(item, GPUQuarantine)):
                try:
                    emit_unhealthy_event(quarantine)
                except API_ERRORS as exc:
                    self.logger.warning("Could not emit the event of %s: %s", quarantine.describe(), exc)
            for leak in (record for record in records if record.verdict == LEAK):
                try:
                    emit_leak_event(leak)
                except API_ERRORS as exc:
                    self.logger.warning("Could not emit the leak event of %s: %s", leak.task_run_name, exc)
            self._tables([record for record in records if record.task_run_id is not None])

    def _tables(self, records: list[TaskRecord]) -> None:
        alone, together = split_for_tables(records)
        for record in alone:
            self._table([record], f"{TASK_TABLE_DESCRIPTION}: {record.verdict}", record)
        per_flow_run: dict[str | None, list[TaskRecord]] = defaultdict(list)
        for record in together:
            per_flow_run[record.flow_run_id].append(record)
        for batch in per_flow_run.values():
            self._table(batch, BATCH_TABLE_DESCRIPTION, batch[0], on_task_run=False)

    def _table(
        self, records: list[TaskRecord], description: str, first: TaskRecord, on_task_run: bool = True
    ) -> None:
        from prefect.artifacts import TableArtifact

        try:
            TableArtifact(
                table=table_rows(records),
                description=f"{description} (prefect-gpu-dask)",
                task_run_id=_uuid(first.task_run_id) if on_task_run else None,
                flow_run_id=_uuid(first.flow_run_id),
            ).create(_sync=True)  # type: ignore[call-arg]  # async_dispatch's own keyword: this thread runs in an async flow's context too
        except (
            Exception
        ) as exc:  # a report, never to fail a task's reporting: the flow-end table still has them
            names = ", ".join(str(record.task_run_name) for record in records[:3])
            self.logger.warning("Could not publish the records of %s (%d): %s", names, len(records), exc)


def needs_a_look(record: TaskRecord) -> bool:
    """A record that keeps its own table on its task run, however busy the publisher."""
    return record.verdict in (LEAK, OOM) or record.restart_reason is not None


def split_for_tables(records: Sequence[TaskRecord]) -> tuple[list[TaskRecord], list[TaskRecord]]:
    """The records gathered for publishing: those that get a table each on their task
    run, and those that go out together as one table on the flow run."""
    clean = [r for r in records if not needs_a_look(r)]
    if len(clean) <= ONE_BY_ONE_UP_TO:
        return list(records), []
    return [r for r in records if needs_a_look(r)], clean


def summary_markdown(
    records: Sequence[TaskRecord],
    restarts: Sequence[RestartRecord],
    quarantines: Sequence[GPUQuarantine] = (),
    hints: Sequence[sizing.SizingHint] = (),
) -> str:
    per_gpu: dict[str, Counter] = defaultdict(Counter)
    for record in records:
        per_gpu[f"GPU {record.gpu_index} ({record.gpu_uuid})"][record.verdict] += 1
    leaks = [r for r in records if r.verdict == LEAK]
    # Rank by what each task itself added at its peak, not the process-wide figure.
    top = sorted(records, key=lambda r: r.growth, reverse=True)[:5]
    lines = [
        "# GPU memory summary",
        "",
        f"{len(records)} guarded task(s) on {len(per_gpu)} GPU(s).",
        "",
    ]
    lines += [
        "## Tasks per GPU",
        "",
        "| GPU | tasks | " + " | ".join(VERDICTS) + " |",
        "|---|---:|" + "---:|" * len(VERDICTS),
    ]
    for gpu, counts in sorted(per_gpu.items()):
        cells = " | ".join(str(counts[verdict]) for verdict in VERDICTS)
        lines.append(f"| {gpu} | {sum(counts.values())} | {cells} |")
    lines += ["", "## Leaks", ""]
    lines += [
        f"- **{r.task_run_name}** left {format_bytes(r.delta)} on GPU {r.gpu_index} ({r.worker})"
        for r in leaks
    ] or ["None."]
    lines += ["", "## Worker restarts", ""]
    lines += [
        f"- {r.worker} -> {r.new_worker}: {r.reason} ("
        + ("" if r.memory_free_s is None else f"memory free after {r.memory_free_s:.2f} s, ")
        + f"replacement serving after {r.serving_s:.2f} s)"
        for r in restarts
    ] or ["None."]
    lines += ["", "## Quarantined GPUs", ""]
    lines += [
        f"- {q.describe()} ("
        + ("its gpu tasks went to healthy GPUs" if q.withdrawn else "no healthy GPU was left")
        + ")"
        for q in quarantines
    ] or ["None."]
    lines += [
        "",
        "## Top memory consumers",
        "",
        "| task run | peak growth | delta |",
        "|---|---:|---:|",
    ]
    scale = max((r.growth for r in top), default=0) or 1
    for r in top:
        bar = "█" * round(20 * r.growth / scale)
        lines.append(f"| {r.task_run_name} | {format_bytes(r.growth)} {bar} | {format_bytes(r.delta)} |")
    if hints:
        lines += [
            "",
            "## Right-sizing",
            "",
            "What each task added to its GPU at its peak, the worst of its recent runs:",
            "",
        ]
        lines += [f"- **{hint.task_name}** {hint.describe()}" for hint in hints]
    if (svg := chart.memory_timeline_svg(records)) is not None:
        lines += ["", "## GPU memory over time", "", chart.markdown_image(svg)]
    return "\n".join(lines) + "\n"


def publish_artifacts(
    flow_run_id: str,
    records: Sequence[TaskRecord],
    restarts: Sequence[RestartRecord],
    quarantines: Sequence[GPUQuarantine] = (),
    flow_name: str | None = None,
    logger: logging.Logger | None = None,
) -> None:
    """Attach the records to the flow run as a table and a markdown summary.

    With ``flow_name``, this run's peaks join the flow's sizing history first, so the
    summary's right-sizing hints speak of its recent runs.
    """
    from prefect.artifacts import MarkdownArtifact, TableArtifact

    history = sizing.worst_per_task(records)
    if flow_name and history:
        try:
            history = sizing.remember(flow_name, history)
        except API_ERRORS as exc:  # the Variable not kept: the hint then speaks of this run alone
            (logger or logging.getLogger(__name__)).warning("Could not keep the GPU sizing history: %r", exc)

    with warnings.catch_warnings():
        # The task runner closes after the flow run context; we name the run explicitly.
        warnings.simplefilter("ignore", FutureWarning)
        TableArtifact(
            key=TABLE_KEY,
            table=table_rows(records),
            description="GPU memory per guarded task (prefect-gpu-dask)",
            flow_run_id=_uuid(flow_run_id),
        ).create(_sync=True)  # type: ignore[call-arg]  # async_dispatch's own keyword
        MarkdownArtifact(
            key=SUMMARY_KEY,
            markdown=summary_markdown(records, restarts, quarantines, sizing.hints(records, history)),
            description="GPUs used, leaks, restarts, quarantined GPUs (prefect-gpu-dask)",
            flow_run_id=_uuid(flow_run_id),
        ).create(_sync=True)  # type: ignore[call-arg]  # async_dispatch's own keyword
        if restarts:
            # Readable as soon as the flow run returns; the restart events reach the API later.
            TableArtifact(
                key=RESTARTS_KEY,
                table=[restart.to_payload() for restart in restarts],
                description="Worker restarts (prefect-gpu-dask)",
                flow_run_id=_uuid(flow_run_id),
            ).create(_sync=True)  # type: ignore[call-arg]  # async_dispatch's own keyword
