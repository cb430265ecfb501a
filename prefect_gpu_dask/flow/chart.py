"""GPU memory over time, one panel per GPU, each guarded task marked: an SVG.

Pure functions of the records, drawn in the flow process at flow end. The summary
artifact embeds the SVG as a ``data:`` image, which the Prefect UI's markdown renders
like any image, with nothing to host. What is drawn is what the guard measured: each
task's worker memory when it started (``before``) and ended (``after``) joined as a
line, and a bar over the task's span up to its ``peak``.
"""

from __future__ import annotations

import base64
from collections import defaultdict
from collections.abc import Sequence
from html import escape

from prefect_gpu_dask.records import LEAK, OOM, TaskRecord, format_bytes

WIDTH = 960
PANEL_HEIGHT = 170
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 78, 16, 26, 30
LABELLED_TASKS = 24  # more tasks than this in a panel: bars without names
MAX_TASKS = 3000  # past this the picture says less than the table beside it
COLOURS = {LEAK: "#d62728", OOM: "#ff7f0e"}
TASK_COLOUR, LINE_COLOUR = "#1f77b4", "#333333"


def _line(x1: float, y1: float, x2: float, y2: float, colour: str, width: float = 1.0) -> str:
    ends = f'x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}"'
    return f'<line {ends} stroke="{colour}" stroke-width="{width}"/>'


def _text(x: float, y: float, text: str, size: int = 11, **attrs: str) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}"{extra}>{escape(text)}</text>'


def _swatch(x: float, y: float, colour: str, opacity: float = 1.0) -> str:
    return (
        f'<rect x="{x:.1f}" y="{y - 9:.1f}" width="10" height="10" fill="{colour}" fill-opacity="{opacity}"/>'
    )


def _gpu_of(record: TaskRecord) -> str:
    return f"GPU {record.gpu_index} ({record.gpu_uuid or 'unknown'})"


def _panel(
    gpu: str, records: list[TaskRecord], t0: float, span: float, top: float
) -> tuple[list[str], float]:
    """SVG elements of one GPU's panel, drawn at height ``top``; returns them and the next top."""
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = PANEL_HEIGHT - MARGIN_TOP - MARGIN_BOTTOM
    y_max = max(max(r.peak, r.after, r.before) for r in records) * 1.15 or 1

    def x(t: float) -> float:
        return MARGIN_LEFT + plot_w * (t - t0) / span

    def y(nbytes: float) -> float:
        return top + MARGIN_TOP + plot_h * (1 - nbytes / y_max)

    base = top + MARGIN_TOP + plot_h
    out = [
        _text(MARGIN_LEFT, top + 16, gpu, 13, font_weight="bold"),
        _line(MARGIN_LEFT, base, WIDTH - MARGIN_RIGHT, base, "#999"),
        _line(MARGIN_LEFT, top + MARGIN_TOP, MARGIN_LEFT, base, "#999"),
    ]
    for fraction in (0.5, 1.0):
        level = y_max / 1.15 * fraction
        out.append(_text(MARGIN_LEFT - 6, y(level) + 4, format_bytes(int(level)), text_anchor="end"))
    labelled = len(records) <= LABELLED_TASKS
    readings: dict[int, list[tuple[float, int]]] = defaultdict(list)  # per worker process
    for record in sorted(records, key=lambda r: r.time - r.duration_s):
        start, end = record.time - record.duration_s, record.time
        width = max(x(end) - x(start), 1.5)
        height = max(base - y(record.peak), 2.0)  # a task that added nothing still shows
        colour = COLOURS.get(record.verdict, TASK_COLOUR)
        name = record.task_run_name or record.task_name or "task"
        out.append(
            f'<rect x="{x(start):.1f}" y="{base - height:.1f}" width="{width:.1f}" '
            f'height="{height:.1f}" fill="{colour}" fill-opacity="0.35" stroke="{colour}">'
            f"<title>{escape(f'{name}: {record.verdict}, peak {format_bytes(record.peak)}')}</title></rect>"
        )
        if record.verdict in COLOURS or (labelled and width >= 6 * len(name)):
            out.append(_text(x(start) + 2, base - height - 3, name, 10, fill=colour))
        readings[record.pid] += [(start, record.before), (end, record.after)]
    for process in readings.values():  # a restarted worker's line ends; its replacement's begins
        points, held = [], None
        for t, nbytes in sorted(process):
            if held is not None:
                points.append(f"{x(t):.1f},{y(held):.1f}")
            points.append(f"{x(t):.1f},{y(nbytes):.1f}")
            held = nbytes
        out.append(
            f'<polyline points="{" ".join(points)}" fill="none" stroke="{LINE_COLOUR}" stroke-width="1.5"/>'
        )
    for seconds in (0.0, span / 2, span):
        out.append(_text(x(t0 + seconds), base + 16, f"{seconds:.1f} s", text_anchor="middle"))
    return out, top + PANEL_HEIGHT


def memory_timeline_svg(records: Sequence[TaskRecord]) -> str | None:
    """The picture of ``records``; None when there is nothing (or too much) to draw."""
    if not records or len(records) > MAX_TASKS:
        return None
    per_gpu: dict[str, list[TaskRecord]] = defaultdict(list)
    for record in records:
        per_gpu[_gpu_of(record)].append(record)
    t0 = min(r.time - r.duration_s for r in records)
    span = max(max(r.time for r in records) - t0, 1e-3)
    body, top = [], 0.0
    for gpu in sorted(per_gpu):
        elements, top = _panel(gpu, per_gpu[gpu], t0, span, top)
        body += elements
    legend_y = top + 14
    legend = [
        _swatch(MARGIN_LEFT, legend_y, TASK_COLOUR, 0.35),
        _text(MARGIN_LEFT + 14, legend_y, "a task: its span, up to its peak"),
        _swatch(MARGIN_LEFT + 230, legend_y, COLOURS[LEAK]),
        _text(MARGIN_LEFT + 244, legend_y, "leak"),
        _swatch(MARGIN_LEFT + 290, legend_y, COLOURS[OOM]),
        _text(MARGIN_LEFT + 304, legend_y, "oom"),
        _line(MARGIN_LEFT + 350, legend_y - 4, MARGIN_LEFT + 370, legend_y - 4, LINE_COLOUR, 1.5),
        _text(MARGIN_LEFT + 376, legend_y, "worker memory at each task's start and end"),
    ]
    height = top + 24
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0f}" '
        f'viewBox="0 0 {WIDTH} {height:.0f}" font-family="sans-serif">'
        f'<rect width="100%" height="100%" fill="white"/>{"".join(body + legend)}</svg>'
    )


def markdown_image(svg: str, alt: str = "GPU memory over time") -> str:
    encoded = base64.b64encode(svg.encode()).decode()
    return f"![{alt}](data:image/svg+xml;base64,{encoded})"
