"""A target's breaker opening and closing again, as Prefect events and lines in the chain's run log.

`delivery.breaker.opened` when the breaker trips (closed → open), `delivery.breaker.closed` when a
trial call closes it again (half-open → closed). A failed trial (half-open → open) is the same
outage going on, and emits nothing: one page per outage, not one per cooldown. Each change is
emitted once, by the process whose write changed the shared state (see `BreakerListener`); the
automations in `automations/breaker-*.yaml` turn these events into notifications.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

from prefect.events import emit_event

from delivery.breaker import OPEN, BreakerListener, Outage, TargetBreaker, outage_change
from flows import metrics

log = logging.getLogger(__name__)

OPENED = "delivery.breaker.opened"
CLOSED = "delivery.breaker.closed"


_EVENTS = {Outage.BEGAN: OPENED, Outage.ENDED: CLOSED}


def breaker_event(old: str, new: str) -> str | None:
    """The event a change of the stored state makes, if any (`delivery.breaker.outage_change`)."""
    change = outage_change(old, new)
    return None if change is None else _EVENTS[change]


def connection_resource(target: str) -> dict[str, str]:
    return {"prefect.resource.id": f"delivery.connection.{target}", "prefect.resource.name": target}


class RunBreakerListener(BreakerListener):
    """Tells the chain's run log of every change, and emits the events above.

    Made in the flow, called from the chain's worker threads, which carry no context of their own:
    each call runs in a copy of the flow's context, so Prefect's settings (which API, and so where
    the log lines and events go) are the run's. Without it the first worker to log or emit would
    start Prefect's log or event worker against the default API (a temporary server of its own
    when PREFECT_API_URL is unset) and the run's lines would go there."""

    def __init__(self, rule: str, flow_run_id: str | None, logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
        self.rule = rule
        self.flow_run_id = flow_run_id
        self.logger = logger
        self._context = contextvars.copy_context()

    def changed(self, breaker: TargetBreaker, old: str, new: str) -> None:
        # A copy per call: one context cannot be entered by two threads at once.
        self._context.copy().run(self._tell, breaker, old, new)

    def _tell(self, breaker: TargetBreaker, old: str, new: str) -> None:
        metrics.BREAKER_OPEN.labels(target=breaker.target).set(1 if new == OPEN else 0)
        event = breaker_event(old, new)
        if new == OPEN:
            self.logger.warning(
                "rule %s: the breaker of target %s opened (%s -> %s) after %d consecutive failures; "
                "this chain sends nothing more, and no chain sends to %s for %.0f s",
                self.rule, breaker.target, old, new, breaker.fail_max, breaker.target, breaker.reset_timeout,
            )  # fmt: skip
        else:
            self.logger.info("rule %s: the breaker of target %s is %s (was %s)", self.rule, breaker.target, new, old)
        if event is None:
            return
        related = []
        if self.flow_run_id:
            run = f"prefect.flow-run.{self.flow_run_id}"
            related.append({"prefect.resource.id": run, "prefect.resource.role": "flow-run"})
        try:
            emit_event(
                event=event,
                resource=connection_resource(breaker.target),
                related=related,
                payload={"rule": self.rule, "from": old, "to": new, "reset_seconds": breaker.reset_timeout},
            )
        except Exception as exc:  # an alert lost is no reason to fail a record's delivery
            log.warning("could not emit %s for target %s: %s", event, breaker.target, exc)
