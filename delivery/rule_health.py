"""Alert once per change of a rule's health, not once per failing chain: a misconfigured rule fails
every 5 minutes until fixed, and paging on each of those would teach people to ignore the page."""

from __future__ import annotations

import enum

from delivery.domain import ChainEnd


class Transition(enum.StrEnum):
    FAILING = "delivery.rule.failing"
    RECOVERED = "delivery.rule.recovered"


#: The chain ends that say something about the rule itself. A superseded, disabled or cancelled
#: chain (stopped by a person or by Prefect), a closed route or an open breaker (not a rule fault,
#: ADR-0029) neither fails nor clears a rule.
TELLING = frozenset({ChainEnd.CAUGHT_UP, ChainEnd.RULE_FAULT})


def transition(previous: str | None, current: ChainEnd) -> Transition | None:
    """A rule is failing while its chains end by a rule fault, and recovered once a chain catches
    up again. `previous` is how the last telling chain before this one ended."""
    if current not in TELLING:
        return None
    was_failing = previous == ChainEnd.RULE_FAULT.value
    is_failing = current is ChainEnd.RULE_FAULT
    if is_failing and not was_failing:
        return Transition.FAILING
    if was_failing and not is_failing:
        return Transition.RECOVERED
    return None
