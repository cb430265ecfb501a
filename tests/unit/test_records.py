"""A task's record travels as a Dask worker event: plain data, and back the same."""

from __future__ import annotations

import msgpack

from prefect_gpu_dask.records import TaskRecord


def a_record() -> TaskRecord:
    return TaskRecord(
        task_run_id="0b5a", task_run_name="train-1a2", task_name="train", flow_run_id="f10",
        tags=("gpu", "nightly"), worker="tcp://127.0.0.1:1", worker_name="0", pid=42,
        gpu_index=0, gpu_uuid="GPU-0", before=1 << 20, after=1 << 21, peak=1 << 22,
        delta=1 << 20, allocator_delta=None, device_used=1 << 30, device_total=1 << 34,
        verdict="leak", restart_reason="leaked 1.00 MiB", duration_s=0.5, time=1.0e9,
        gpu_share=0.5, gpu_seconds=0.25, energy_j=1.5, throttle_reasons=("sw_power_cap",),
        flow_name="nightly",
    )  # fmt: skip


def test_a_record_travels_as_plain_data_and_comes_back_the_same():
    record = a_record()
    event = record.to_event()

    assert event["tags"] == ["gpu", "nightly"] and event["throttle_reasons"] == ["sw_power_cap"]
    travelled = msgpack.unpackb(msgpack.packb(event), strict_map_key=False)
    assert TaskRecord.from_event(travelled) == record


def test_changing_an_event_leaves_its_record_alone():
    record = a_record()
    event = record.to_event()
    event["tags"].append("changed")
    event["verdict"] = "clean"

    assert record.tags == ("gpu", "nightly") and record.verdict == "leak"
    assert record.to_event() != event
