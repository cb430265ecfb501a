"""What the Prefect UI shows: table and markdown artifacts, and events for automations."""

from __future__ import annotations

import warnings
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from prefect_gpu_dask.records import LEAK, VERDICTS, RestartRecord, TaskRecord, format_bytes

TABLE_KEY = "gpu-memory"
SUMMARY_KEY = "gpu-memory-summary"
LEAK_EVENT = "prefect-gpu-dask.leak.detected"
RESTART_EVENT = "prefect-gpu-dask.worker.restarted"
TABLE_COLUMNS = (
    "task_run_name",
    "verdict",
    "before",
    "after",
    "peak",
    "delta",
    "allocator_delta",
    "duration_s",
    "gpu_index",
    "gpu_uuid",
    "worker",
    "tags",
    "task_run_id",
    "restart_reason",
    "oom_requested",
)


def _related(record: TaskRecord | RestartRecord) -> list[dict[str, str]]:
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


def _gpu_resource(record: TaskRecord | RestartRecord) -> dict[str, str]:
    return {
        "prefect.resource.id": f"prefect-gpu-dask.gpu.{record.gpu_uuid or 'unknown'}",
        "prefect.resource.name": f"GPU {record.gpu_index} on {record.worker}",
        "prefect-gpu-dask.worker": str(record.worker),
    }


def emit_leak_event(record: TaskRecord) -> None:
    from prefect.events import emit_event

    payload = asdict(record)
    emit_event(
        event=LEAK_EVENT,
        resource=_gpu_resource(record),
        related=_related(record),
        payload={k: payload[k] for k in TABLE_COLUMNS} | {"tags": list(record.tags)},
    )


def emit_restart_event(restart: RestartRecord) -> None:
    from prefect.events import emit_event

    emit_event(
        event=RESTART_EVENT,
        resource=_gpu_resource(restart),
        related=_related(restart),
        payload=restart.to_payload(),
    )


def table_rows(records: Sequence[TaskRecord]) -> list[dict[str, Any]]:
    rows = []
    for record in records:
        values = asdict(record)
        row = {column: values[column] for column in TABLE_COLUMNS}
        for column in ("before", "after", "peak", "delta", "allocator_delta"):
            row[column] = "n/a" if values[column] is None else format_bytes(values[column])
        row["tags"] = ", ".join(record.tags)
        rows.append(row)
    return rows


def summary_markdown(records: Sequence[TaskRecord], restarts: Sequence[RestartRecord]) -> str:
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
    return "\n".join(lines) + "\n"


def publish_artifacts(
    flow_run_id: str, records: Sequence[TaskRecord], restarts: Sequence[RestartRecord]
) -> None:
    """Attach the records to the flow run as a table and a markdown summary."""
    from prefect.artifacts import MarkdownArtifact, TableArtifact

    with warnings.catch_warnings():
        # The task runner closes after the flow run context; we name the run explicitly.
        warnings.simplefilter("ignore", FutureWarning)
        TableArtifact(
            key=TABLE_KEY,
            table=table_rows(records),
            description="GPU memory per guarded task (prefect-gpu-dask)",
            flow_run_id=flow_run_id,
        ).create()
        MarkdownArtifact(
            key=SUMMARY_KEY,
            markdown=summary_markdown(records, restarts),
            description="GPUs used, leaks, restarts (prefect-gpu-dask)",
            flow_run_id=flow_run_id,
        ).create()
