"""How a tick ended, as an event of its own: `delivery.tick.completed` or `delivery.tick.failed`.

The tick alerts (automations/tick-missing.yaml, tick-failed.yaml) watch these instead of Prefect's
flow-run state events, because Prefect holds back the state events of a run its scheduler made: the
scheduler writes the run's Scheduled state without an event, each later state event names the one
before it as the event it follows, and Prefect's automations wait up to 15 minutes for an event's
predecessor before taking it (their causal ordering). Every state event of a scheduled tick reached
the alerts 15 minutes late: a three-minute no-tick alert fired three minutes after its install while
a tick completed every minute, and on the 15-minute window it named a tick long past as the last one.
These events follow nothing, so the alerts see them at once.

The resource is the tick run (`delivery.tick.<flow run id>`, named as the run), related to the
flow run and to the delivery-tick flow; the labels say the state's name and message.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect.client.schemas import State
from prefect.events import emit_event

log = logging.getLogger(__name__)

COMPLETED = "delivery.tick.completed"
FAILED = "delivery.tick.failed"


def tick_ended(state: State[Any], flow_run_id: str, flow_id: str, run_name: str) -> None:
    """Emit how the tick run ended: COMPLETED (whatever its name) as `delivery.tick.completed`,
    FAILED or CRASHED as `delivery.tick.failed`; a cancelled tick emits nothing."""
    if state.is_completed():
        event = COMPLETED
    elif state.is_failed() or state.is_crashed():
        event = FAILED
    else:
        return
    try:
        emit_event(
            event=event,
            resource={
                "prefect.resource.id": f"delivery.tick.{flow_run_id}",
                "prefect.resource.name": run_name,
                "delivery.state-name": state.name or state.type.value.title(),
                "delivery.state-message": (state.message or "")[:500],
            },
            related=[
                {"prefect.resource.id": f"prefect.flow-run.{flow_run_id}", "prefect.resource.role": "flow-run"},
                {"prefect.resource.id": f"prefect.flow.{flow_id}", "prefect.resource.role": "flow",
                 "prefect.resource.name": "delivery-tick"},
            ],
        )  # fmt: skip
    except Exception as exc:  # the tick did its work; a lost event is what the no-tick alert is for
        log.warning("could not emit %s: %s", event, exc)
