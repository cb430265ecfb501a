"""``prefect-gpu-dask report``: a flow run's GPU report as terminal tables or JSON."""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime
from typing import Any

from dask.utils import format_bytes

from prefect_gpu_dask.cli.tables import table
from prefect_gpu_dask.flow.flow_run_report import FlowRunGPUReport


def to_dict(report: FlowRunGPUReport) -> dict[str, Any]:
    return {
        "flow_run_id": report.flow_run_id,
        "records": [asdict(r) for r in report.records],
        "restarts": [asdict(r) for r in report.restarts],
        "quarantines": [asdict(q) for q in report.quarantines],
    }


def _or_dash(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def render(report: FlowRunGPUReport) -> str:
    lines = [f"Flow run {report.flow_run_id}"]
    records = report.records
    leaks = len(report.leaks)
    lines.append(f"Task runs measured: {len(records)} ({leaks} leak(s))")
    if records:
        rows: list[tuple[str, ...]] = [
            (
                r.task_run_name or r.task_name or "-",
                f"{r.gpu_index} {r.worker_name}",
                r.verdict,
                format_bytes(r.peak),
                ("+" if r.delta > 0 else "") + format_bytes(r.delta) if r.delta else "0 B",
                _or_dash(r.sm_util_mean, "{:.0f}"),
                _or_dash(r.energy_j, "{:.1f}"),
                _or_dash(r.gpu_seconds, "{:.2f}"),
                f"{r.duration_s:.2f}",
            )
            for r in records
        ]
        header = (
            "TASK RUN",
            "GPU WORKER",
            "VERDICT",
            "PEAK",
            "DELTA",
            "SM %",
            "ENERGY J",
            "GPU-S",
            "SECONDS",
        )
        lines += table(header, rows)
    lines.append(f"Restarts: {len(report.restarts)}")
    if report.restarts:
        rows = [
            (
                datetime.fromtimestamp(r.requested_at).strftime("%H:%M:%S"),
                r.worker_name,
                r.outcome,
                _or_dash(r.serving_s, "{:.2f}"),
                r.reason if r.outcome != "lost" else f"{r.reason}; lost: {r.lost_reason}",
            )
            for r in report.restarts
        ]
        lines += table(("AT", "WORKER", "OUTCOME", "SERVING S", "REASON"), rows)
    lines.append(f"Quarantined GPUs: {len(report.quarantines)}")
    if report.quarantines:
        rows = [
            (
                datetime.fromtimestamp(q.time).strftime("%H:%M:%S"),
                f"{q.gpu_index} {q.gpu_uuid}",
                q.worker_name,
                "yes" if q.withdrawn else "no",
                "; ".join(q.reasons),
            )
            for q in report.quarantines
        ]
        lines += table(("AT", "GPU", "WORKER", "WITHDRAWN", "REASONS"), rows)
    return "\n".join(lines)
