"""The `delivery-status` table artifact: what `delivery status` prints, one row per rule, so the
Prefect UI alone answers "is everything delivering?". Published at the end of every chain and of
every tick, so its latest version is never a tick behind: the chains a tick started show how they
ended as soon as they have, not five minutes later. A process running many chains may space the
chains' publishes out (`flows.chain_reporting.throttle_status`).

Each row starts with how the rule's last chain ended, as its run's state is named in the UI
(`CaughtUp`, `BreakerOpen`, `Failed: MissingWriter`, ..., `running`, `never ran`) and since when;
then the route, the target's breaker, the lag, the ledger counts, the retries due and the last
chain's message. The cells are the `delivery status` table's, in the same words.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from prefect.artifacts import acreate_table_artifact

from delivery.clock import utcnow
from delivery.db import shared_engine
from delivery.status import overview, plain_time, status_table

STATUS_ARTIFACT_KEY = "delivery-status"


def _rules_in_words(rows: list[dict[str, Any]]) -> str:
    """`3 rules: 2 CaughtUp, 1 Failed: MissingWriter`."""
    if not rows:
        return "no rules yet"
    endings = Counter(row["last_ending"] for row in rows)
    said = ", ".join(f"{n} {ending}" for ending, n in sorted(endings.items(), key=lambda item: (-item[1], item[0])))
    return f"{len(rows)} rule{'' if len(rows) == 1 else 's'}: {said}"


def describe(rows: list[dict[str, Any]], at: str, summary: str | None) -> str:
    """The artifact's description: when, the rules by how their last chain ended, what the tick
    did (when a tick publishes it), and how to read the columns."""
    tick = f" This tick: {summary}." if summary else ""
    return (
        f"**Delivery status** at {plain_time(at)}, {_rules_in_words(rows)}.{tick}\n\n"
        "*last chain*: how the rule's last chain ended, named as its run's state in the run list "
        "(`running` while one runs), and *since* when. *lag*: how old the oldest change not delivered "
        "yet is. *due retries*: failed records the next chain sends again first. Exhausted and remote "
        "gone records are parked: `delivery requeue` puts them back."
    )


async def publish_status(summary: str | None = None) -> None:
    """Publish the `delivery-status` artifact as the database has it now. `summary`: what the tick
    did, in words (the tick's own summary), said in the description; None at a chain's end.

    Call it from inside a flow (or task) run: Prefect deprecates artifacts made outside one (a
    FutureWarning). The artifact is listed on that run's Artifacts tab too; its latest version
    (Artifacts -> delivery-status) is always the newest status. Raises what the database or the
    Prefect API raise."""
    now = utcnow()
    with shared_engine().connect().execution_options(readonly=True) as conn:
        rows = overview(conn, now)
    await acreate_table_artifact(
        table=status_table(rows), key=STATUS_ARTIFACT_KEY, description=describe(rows, now.isoformat(), summary)
    )
