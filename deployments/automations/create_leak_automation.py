"""Create the leak automation of ``leak-notify.yaml`` from Python.

    python deployments/automations/create_leak_automation.py
    python deployments/automations/create_leak_automation.py --notify-block slack-webhook/gpu-alerts

It talks to the API in ``PREFECT_API_URL`` (or the active profile). Without
``--notify-block`` the automation's action is ``do-nothing``, exactly like the YAML: it
fires and records a ``prefect.automation.action.triggered`` event per leak. With
``--notify-block <block-type-slug>/<block-name>`` (any notification block: Slack,
Microsoft Teams, email, ...) it sends a message instead. ``--replace`` deletes an
automation of the same name first, so the script can be re-run.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from uuid import UUID

from prefect.automations import (
    Automation,
    DoNothing,
    EventTrigger,
    Posture,
    SendNotification,
)

from prefect_gpu_dask.flow.reporting import LEAK_EVENT

NAME = "prefect-gpu-dask-leak-notify"
SUBJECT = "GPU memory leak in {{ flow_run.name }}"
BODY = """\
Task run {{ event.payload.task_run_name }} left
{{ event.payload.delta }} bytes on {{ event.resource["prefect.resource.name"] }}.
Restart: {{ event.payload.restart_reason }}
Flow run: {{ flow_run|ui_url }}
"""


def leak_trigger() -> EventTrigger:
    """Fire once per ``prefect-gpu-dask.leak.detected`` event, on any GPU."""
    return EventTrigger(
        expect={LEAK_EVENT},
        match={"prefect.resource.id": "prefect-gpu-dask.gpu.*"},
        for_each={"prefect.resource.id"},
        posture=Posture.Reactive,
        threshold=1,
        within=timedelta(0),
    )


def leak_automation(notify_block_id: UUID | None = None, name: str = NAME) -> Automation:
    if notify_block_id is None:
        actions = [DoNothing()]
    else:
        actions = [SendNotification(block_document_id=notify_block_id, subject=SUBJECT, body=BODY)]
    return Automation(
        name=name,
        description=(
            "A guarded task left GPU memory behind (prefect-gpu-dask.leak.detected); the "
            "worker is recycled according to the runner's restart policy."
        ),
        enabled=True,
        tags=["prefect-gpu-dask"],
        trigger=leak_trigger(),
        actions=actions,
    )


def notification_block_id(slug: str) -> UUID:
    """``<block-type-slug>/<block-name>`` -> the block document's id."""
    from prefect.client.orchestration import get_client

    block_type, _, block_name = slug.partition("/")
    if not block_name:
        raise SystemExit(f"--notify-block {slug!r}: expected <block-type-slug>/<block-name>")
    with get_client(sync_client=True) as client:
        return client.read_block_document_by_name(block_name, block_type).id


def main(argv: list[str] | None = None) -> Automation:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default=NAME)
    parser.add_argument(
        "--notify-block",
        metavar="TYPE/NAME",
        help="a notification block, e.g. slack-webhook/gpu-alerts (default: do-nothing)",
    )
    parser.add_argument("--replace", action="store_true", help="delete an automation of this name first")
    args = parser.parse_args(argv)

    block_id = notification_block_id(args.notify_block) if args.notify_block else None
    if args.replace:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            for existing in client.read_automations_by_name(args.name):
                client.delete_automation(existing.id)
    automation = leak_automation(block_id, name=args.name).create()
    print(f"Created automation {automation.name!r} with id {automation.id}")
    return automation


if __name__ == "__main__":
    main()
