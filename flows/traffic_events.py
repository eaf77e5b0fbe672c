"""A target paused by its Retry-After, and resumed, as Prefect events and lines in the chain's run log.

`delivery.target.paused` when a 429 or 503 with Retry-After pauses every send to a target (emitted
once, by the process whose write paused it: a pause extended by a later answer is the same pause),
and `delivery.target.resumed` when the pause is over (emitted by the process that found it over
first, as it sends again). An automation can page on the first and close on the second, as the
breaker's events allow (`flows/breaker_events.py`).
"""

from __future__ import annotations

import contextvars
import logging
from datetime import UTC, datetime
from typing import Any

from prefect.events import emit_event

from delivery.traffic import TrafficListener
from flows import metrics
from flows.breaker_events import connection_resource

log = logging.getLogger(__name__)

PAUSED = "delivery.target.paused"
RESUMED = "delivery.target.resumed"


class RunTrafficListener(TrafficListener):
    """Tells the chain's run log of a pause and its end, and emits the events above. Called from
    the chain's worker threads: each call runs in a copy of the flow's context (see
    `RunBreakerListener` for why)."""

    def __init__(self, rule: str, flow_run_id: str | None, logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
        self.rule = rule
        self.flow_run_id = flow_run_id
        self.logger = logger
        self._context = contextvars.copy_context()

    def paused(self, target: str, until: datetime, reason: str) -> None:
        self._context.copy().run(self._paused, target, until, reason)

    def resumed(self, target: str, paused_at: datetime | None, until: datetime | None) -> None:
        self._context.copy().run(self._resumed, target, paused_at, until)

    def waiting(self, target: str, until: datetime, what: str) -> None:
        self._context.copy().run(self._waiting, target, until, what)

    def _waiting(self, target: str, until: datetime, what: str) -> None:
        # One line, said as the wait begins, so a chain held for minutes says why at once.
        self.logger.info(
            "waiting until %s UTC for target %s's %s", until.astimezone(UTC).strftime("%H:%M:%S"), target,
            what.removeprefix("its "),
        )  # fmt: skip

    def _paused(self, target: str, until: datetime, reason: str) -> None:
        metrics.TARGET_PAUSED.labels(target=target).set(1)
        when = until.isoformat(timespec="seconds")
        self.logger.warning(
            "rule %s: target %s asked for a pause (%s): no rule sends to it until %s", self.rule, target, reason, when
        )
        self._emit(PAUSED, target, {"rule": self.rule, "until": when, "reason": reason})

    def _resumed(self, target: str, paused_at: datetime | None, until: datetime | None) -> None:
        metrics.TARGET_PAUSED.labels(target=target).set(0)
        self.logger.info("rule %s: target %s: its pause is over; sending again", self.rule, target)
        payload = {
            "rule": self.rule,
            "paused_at": paused_at.isoformat(timespec="seconds") if paused_at else None,
            "until": until.isoformat(timespec="seconds") if until else None,
        }
        self._emit(RESUMED, target, payload)

    def _emit(self, event: str, target: str, payload: dict[str, Any]) -> None:
        emit(event, target, payload, self.flow_run_id)


def emit(event: str, target: str, payload: dict[str, Any], flow_run_id: str | None = None) -> None:
    """Emit `event` about connection `target` (related to the flow run, if any); a failure to emit
    is logged, never raised: an alert lost is no reason to fail anything else."""
    related = []
    if flow_run_id:
        run = f"prefect.flow-run.{flow_run_id}"
        related.append({"prefect.resource.id": run, "prefect.resource.role": "flow-run"})
    try:
        emit_event(event=event, resource=connection_resource(target), related=related, payload=payload)
    except Exception as exc:
        log.warning("could not emit %s for target %s: %s", event, target, exc)
