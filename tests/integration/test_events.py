"""The runner's Prefect events, read back from a real API server, and the example
automation (deployments/automations/) created from its YAML with the Prefect CLI.

The harness server (conftest's ``prefect_api``) runs Prefect's event persister,
triggers and actions services, so the test also sees the automation fire on the leak.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from uuid import UUID

import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect.events.schemas.automations import AutomationCore
from prefect.server.events.schemas.automations import EventTrigger as ServerEventTrigger
from prefect.server.events.schemas.events import ReceivedEvent as ServerReceivedEvent
from prefect.variables import Variable

from prefect_gpu_dask import read_flow_run_gpu_report
from prefect_gpu_dask.flow import sizing
from prefect_gpu_dask.flow.reporting import LEAK_EVENT, RESTART_EVENT
from tests.scripted_probe import FakeDeviceProbe
from tests.ui_helpers import LEAK_BYTES, read_events, run_leaking_flow, start_guarded_cluster

ROOT = Path(__file__).resolve().parents[2]
AUTOMATIONS = ROOT / "deployments" / "automations"
YAML_FILE = AUTOMATIONS / "leak-notify.yaml"
GPU_RESOURCE = f"prefect-gpu-dask.gpu.{FakeDeviceProbe.gpu.uuid}"


def python_form():
    spec = importlib.util.spec_from_file_location(
        "create_leak_automation", AUTOMATIONS / "create_leak_automation.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def create_from_yaml(api_url: str) -> UUID:
    """``prefect automation create --from-file leak-notify.yaml`` against ``api_url``."""
    env = {
        **os.environ,
        "PREFECT_API_URL": api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "COLUMNS": "200",
    }
    done = subprocess.run(
        [sys.executable, "-m", "prefect", "automation", "create", "--from-file", str(YAML_FILE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    match = re.search(r"with id\s+([0-9a-f-]{36})", output)
    assert match, output
    return UUID(match.group(1))


def labels(event) -> dict[str, str]:
    """``{resource id: role}`` of an event's related resources."""
    return {r.id: r.role for r in event.related}


@pytest.fixture
def leak_automation_id(prefect_api) -> UUID:
    automation_id = create_from_yaml(prefect_api)
    yield automation_id
    with get_client(sync_client=True) as client:
        client.delete_automation(automation_id)


def test_example_automation_python_form_equals_yaml():
    from_yaml = AutomationCore.model_validate(yaml.safe_load(YAML_FILE.read_text()))
    automation = python_form().leak_automation()
    from_python = AutomationCore(**automation.model_dump(exclude={"id"}))
    assert from_python.model_dump(mode="json") == from_yaml.model_dump(mode="json")
    assert from_yaml.trigger.expect == {LEAK_EVENT}
    assert [a.type for a in from_yaml.actions] == ["do-nothing"]


def run_script(api_url: str, *args: str) -> UUID:
    env = {
        **os.environ,
        "PREFECT_API_URL": api_url,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    script = AUTOMATIONS / "create_leak_automation.py"
    done = subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return UUID(re.search(r"with id ([0-9a-f-]{36})", done.stdout).group(1))


def test_python_form_creates_the_automation_with_a_notification_block(prefect_api):
    from prefect.blocks.notifications import SlackWebhook

    name = "prefect-gpu-dask-leak-notify-script-test"
    block_id = SlackWebhook(url="https://hooks.slack.invalid/services/T0/B0/x").save(
        "gpu-alerts-test", overwrite=True
    )
    created = [
        run_script(prefect_api, "--name", name),
        run_script(prefect_api, "--name", name, "--replace"),  # re-runnable
        run_script(
            prefect_api, "--name", name, "--replace", "--notify-block", "slack-webhook/gpu-alerts-test"
        ),
    ]
    try:
        with get_client(sync_client=True) as client:
            [stored] = client.read_automations_by_name(name)
        assert stored.id == created[-1]
        from_yaml = AutomationCore.model_validate(yaml.safe_load(YAML_FILE.read_text()))
        assert stored.trigger == from_yaml.trigger
        [action] = stored.actions
        assert action.type == "send-notification" and action.block_document_id == block_id
        assert "{{ event.payload.task_run_name }}" in action.body
    finally:
        with get_client(sync_client=True) as client:
            for automation in client.read_automations_by_name(name):
                client.delete_automation(automation.id)


def test_leak_and_restart_events_reach_the_api_and_fire_the_automation(dask_processes, leak_automation_id):
    with get_client(sync_client=True) as client:
        stored = client.read_automation(leak_automation_id)
    assert stored is not None and stored.name == "prefect-gpu-dask-leak-notify"

    address = start_guarded_cluster(dask_processes)
    out = run_leaking_flow(address)
    flow_run = f"prefect.flow-run.{out['flow_run_id']}"
    task_run = f"prefect.task-run.{out['leaky_task_run_id']}"
    assert len(out["restarts"]) == 1, out

    # -- both events arrive, tied to the flow run and the leaking task run ----------
    events = read_events(
        [],
        prefix=["prefect-gpu-dask."],
        related=flow_run,
        until=lambda evs: {LEAK_EVENT, RESTART_EVENT} <= {e.event for e in evs},
    )
    by_name = {}
    for event in events:
        by_name.setdefault(event.event, []).append(event)
    assert set(by_name) == {LEAK_EVENT, RESTART_EVENT}, [e.event for e in events]
    [leak] = by_name[LEAK_EVENT]
    [restart] = by_name[RESTART_EVENT]

    for event in (leak, restart):
        assert event.resource.id == GPU_RESOURCE
        assert event.resource["prefect-gpu-dask.worker"] == out["restarts"][0].worker
        assert labels(event)[flow_run] == "flow-run"
        assert labels(event)[task_run] == "task-run"

    assert leak.payload["verdict"] == "leak"
    assert leak.payload["delta"] == LEAK_BYTES
    assert leak.payload["task_run_id"] == out["leaky_task_run_id"]
    assert leak.payload["task_run_name"] == f"leaky-{LEAK_BYTES}"
    assert leak.payload["restart_reason"].startswith("leak: task left 512.00 MiB")
    assert restart.payload["reason"] == leak.payload["restart_reason"]
    assert restart.payload["new_pid"] != restart.payload["old_pid"]
    assert restart.payload["memory_after"] == 0
    assert restart.occurred >= leak.occurred

    # -- read back as types, and the flow's sizing history kept in a Prefect Variable ---
    report = read_flow_run_gpu_report(out["flow_run_id"])
    assert report.restarts == tuple(out["restarts"])
    [leaked] = report.leaks
    assert leaked.task_run_id == out["leaky_task_run_id"] and leaked.delta == LEAK_BYTES
    history = Variable.get(sizing.variable_name("gpu-leak-demo"))
    assert LEAK_BYTES in history["leaky"]["peaks"], history

    # -- the automation's trigger, as the server stores it, matches the leak only ---
    with get_client(sync_client=True) as client:
        stored = client.read_automation(leak_automation_id)
    trigger = ServerEventTrigger.model_validate(stored.trigger.model_dump())
    assert trigger.immediate  # Reactive, threshold 1, within 0: one leak, one firing
    assert trigger.covers(ServerReceivedEvent.model_validate(leak.model_dump()))
    assert not trigger.covers(ServerReceivedEvent.model_validate(restart.model_dump()))

    # -- and the server's triggers service fired it on this very leak event ----------
    automation = f"prefect.automation.{leak_automation_id}"

    def fired_on_leak(evs) -> bool:
        return any(labels(e).get(f"prefect.event.{leak.id}") == "triggering-event" for e in evs)

    fired = read_events(
        ["prefect.automation.action.triggered", "prefect.automation.action.executed"],
        resource=automation,
        until=lambda evs: fired_on_leak(evs) and len({e.event for e in evs}) == 2,
    )
    names = sorted(e.event for e in fired)
    assert names == ["prefect.automation.action.executed", "prefect.automation.action.triggered"]
    assert all(labels(e).get(f"prefect.event.{leak.id}") == "triggering-event" for e in fired)
    assert all(e.payload["action_type"] == "do-nothing" for e in fired)
