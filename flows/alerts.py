"""The alert hook: two Prefect automations that notify through a notification block an operator
chose, once when a rule starts failing and once when it recovers (events from `deliver-rule`)."""

from __future__ import annotations

from uuid import UUID

from prefect import get_client
from prefect.automations import Automation
from prefect.events.actions import SendNotification
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
from prefect.exceptions import ObjectNotFound

from delivery.alerts import Transition
from delivery.errors import InputError

NAMES = {
    Transition.FAILING: "delivery: rule failing",
    Transition.RECOVERED: "delivery: rule recovered",
}
BODIES = {
    Transition.FAILING: (
        "Delivery rule {{ event.resource.name }} is failing: {{ event.payload.message }}\n"
        "Every chain of it will fail until the rule or its target is fixed."
    ),
    Transition.RECOVERED: "Delivery rule {{ event.resource.name }} recovered: {{ event.payload.ended_by }}.",
}


def automations(block_document_id: UUID, enabled: bool) -> list[Automation]:
    return [
        Automation(
            name=NAMES[change],
            description="Installed by `delivery alerts install`; fires once per change of a rule's health.",
            enabled=enabled,
            trigger=EventTrigger(
                expect={change.value},
                match={"prefect.resource.id": "delivery.rule.*"},
                posture=Posture.Reactive,
                threshold=1,
            ),
            actions=[
                SendNotification(
                    block_document_id=block_document_id,
                    subject=f"[delivery] {NAMES[change]}: {{{{ event.resource.name }}}}",
                    body=BODIES[change],
                )
            ],
        )
        for change in Transition
    ]


async def install(block: str, enabled: bool) -> list[str]:
    """(Re)create both automations for notification block `TYPE/NAME` (e.g. slack-webhook/ops)."""
    block_type, _, name = block.partition("/")
    if not block_type or not name:
        raise InputError(f"--block: {block!r} must be BLOCK-TYPE/NAME, e.g. slack-webhook/delivery-alerts")
    async with get_client() as client:
        try:
            document = await client.read_block_document_by_name(name, block_type)
        except ObjectNotFound as exc:
            raise InputError(f"--block: no notification block {block!r} exists; create it in the UI first") from exc
        existing = {a.name: a for a in await client.read_automations()}
        for wanted in NAMES.values():
            if wanted in existing:
                await client.delete_automation(existing[wanted].id)
        created = []
        for automation in automations(document.id, enabled):
            # The client sends the model whole, and the API refuses its empty "id".
            await client.create_automation(AutomationCore(**automation.model_dump(exclude={"id"})))
            created.append(automation.name)
    return created
