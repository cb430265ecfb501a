"""Right-sizing hints, the memory-over-time picture and the table rows, on plain records."""

from __future__ import annotations

import base64
import json
import xml.etree.ElementTree as ET
from dataclasses import fields

import pytest

from prefect_gpu_dask.flow import chart, sizing
from prefect_gpu_dask.flow.reporting import TABLE_COLUMNS, summary_markdown, table_rows
from prefect_gpu_dask.records import TaskRecord

GiB = 2**30
H200 = 141 * GiB


def record(
    name: str, growth: int, share: float | None = 1.0, *, gpu: int = 0, end: float = 100.0, **kw
) -> TaskRecord:
    values = dict(
        task_run_id=f"id-{name}-{end}",
        task_run_name=f"{name}-0",
        task_name=name,
        flow_run_id="flow",
        tags=("gpu",),
        worker="tcp://127.0.0.1:1",
        worker_name=f"gpu-{gpu}",
        pid=4242,
        gpu_index=gpu,
        gpu_uuid=f"GPU-{gpu}",
        before=GiB,
        after=GiB,
        peak=GiB + growth,
        delta=0,
        allocator_delta=None,
        device_used=2 * GiB,
        device_total=H200,
        verdict="clean",
        restart_reason=None,
        duration_s=2.0,
        time=end,
        gpu_share=share,
    )
    return TaskRecord(**(values | kw))


def test_a_small_task_asking_for_a_whole_gpu_is_told_the_share_that_fits():
    records = [record("etl", int(9.1 * GiB))]
    [hint] = sizing.hints(records, sizing.worst_per_task(records))
    assert hint.fitting_share == 0.1 and hint.asked_share == 1.0 and not hint.tight
    assert hint.describe() == "peaks at 9.10 GiB of 141.00 GiB: `gpu:0.1` fits; it asked for `gpu`"


def test_a_peak_within_5_percent_of_its_share_is_flagged_and_one_past_the_margin_gets_more():
    share = 0.25
    near = int(0.96 * share * H200)
    records = [record("svd", near, share)]
    [hint] = sizing.hints(records, sizing.worst_per_task(records))
    assert hint.tight and hint.fitting_share == 0.5
    assert "within 5 % of its share" in hint.describe()
    [roomy] = sizing.hints(
        [record("svd", int(0.5 * share * H200), share)], {"svd": sizing.PeakHistory(H200, (GiB,))}
    )
    assert not roomy.tight


def test_the_hint_uses_the_worst_of_the_last_runs_and_forgets_older_ones():
    history: dict[str, sizing.PeakHistory] = {}
    for night in range(sizing.HISTORY_RUNS + 3):
        peak = 60 * GiB if night == 1 else 5 * GiB
        history = sizing.merged(history, sizing.worst_per_task([record("etl", peak, end=night)]))
        if night == 2:  # the big night is among the last runs
            [hint] = sizing.hints([record("etl", peak)], history)
            assert hint.worst_peak == 60 * GiB and hint.runs == 3 and hint.fitting_share == 1.0
    assert len(history["etl"].peaks) == sizing.HISTORY_RUNS
    [hint] = sizing.hints([record("etl", 5 * GiB)], history)
    assert hint.worst_peak == 5 * GiB and hint.fitting_share == 0.05  # the big night left the window


def test_the_variable_value_round_trips_and_stays_under_prefects_limit():
    history = {f"task-{i:03d}": sizing.PeakHistory(H200, tuple(range(GiB, GiB + 10))) for i in range(200)}
    value = sizing.to_value(history, newest=["task-000"])
    assert sizing.value_size(value) <= sizing.MAX_VALUE_CHARS
    assert len(value["task-000"]["peaks"]) == sizing.HISTORY_RUNS  # stale tasks went first
    squeezed = sizing.to_value(history, newest=list(history))  # all from this run: runs go first
    assert sizing.value_size(squeezed) <= sizing.MAX_VALUE_CHARS
    assert {len(v["peaks"]) for v in squeezed.values()} == {1} and len(squeezed) > 50
    back = sizing.from_value(value)
    assert back["task-000"].device_total == H200 and back["task-000"].peaks
    assert sizing.from_value("something a person typed") == {}
    assert sizing.from_value({"x": {"total": H200, "peaks": []}, "y": {"total": 0, "peaks": [1]}}) == {}
    name = sizing.variable_name("Nightly ETL / v2 (GPU)")
    assert name.startswith(sizing.VARIABLE_PREFIX) and name == name.lower()
    assert set(name) <= set("abcdefghijklmnopqrstuvwxyz0123456789_-")
    assert sizing.variable_name("a b") != sizing.variable_name("a_b")


def test_the_picture_has_a_panel_per_gpu_and_a_bar_per_task_coloured_by_verdict():
    records = [
        record("etl", GiB, gpu=0, end=10.0),
        record("leaky", 2 * GiB, gpu=0, end=12.0, verdict="leak", task_run_name="leaky <&> 1"),
        record("svd", 3 * GiB, gpu=1, end=11.0),
    ]
    svg = chart.memory_timeline_svg(records)
    root = ET.fromstring(svg)  # well-formed, names escaped
    ns = "{http://www.w3.org/2000/svg}"
    titles = [t.text for t in root.iter(f"{ns}title")]
    assert len(titles) == 3 and any("leaky <&> 1: leak" in t for t in titles)
    panels = [t.text for t in root.iter(f"{ns}text") if t.text and t.text.startswith("GPU ")]
    assert panels == ["GPU 0 (GPU-0)", "GPU 1 (GPU-1)"]
    leak_bars = [r for r in root.iter(f"{ns}rect") if r.get("stroke") == chart.COLOURS["leak"]]
    assert len(leak_bars) == 1
    assert chart.memory_timeline_svg([]) is None
    image = chart.markdown_image(svg)
    encoded = image.split("base64,", 1)[1].rstrip(")")
    assert base64.b64decode(encoded).decode() == svg


def test_the_summary_carries_the_hints_and_the_picture():
    records = [record("etl", int(9.1 * GiB))]
    text = summary_markdown(records, [], [], sizing.hints(records, sizing.worst_per_task(records)))
    assert "## Right-sizing" in text and "**etl** peaks at 9.10 GiB of 141.00 GiB: `gpu:0.1` fits" in text
    assert "## GPU memory over time" in text and "](data:image/svg+xml;base64," in text


@pytest.mark.parametrize("oom", [None, 2 * GiB])
def test_a_table_row_reads_back_as_the_record_it_came_from(oom):
    original = record(
        "etl",
        GiB,
        tags=("gpu", "nightly"),
        oom_requested=oom,
        throttle_reasons=("sw_power_cap",),
        energy_j=12.5,
    )
    [row] = json.loads(json.dumps(table_rows([original])))  # as the API stores it
    assert row["peak"] == "2.00 GiB" and row["peak_bytes"] == 2 * GiB
    assert TaskRecord.from_row(row) == original
    assert set(TABLE_COLUMNS) == {f.name for f in fields(TaskRecord)}  # every field has a column
