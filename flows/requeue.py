"""`delivery-requeue`: put parked records back from the Prefect UI, as `delivery requeue` does.

The same selection, checked the same way (`Selection.of`: only exhausted, remote_gone and failed
rows), the same versioned write (`delivery.store.requeue.requeue`), and the same audit row in
`requeues`, which also names this flow run. What it changed (or, with `dry_run`, would change) is
published as a table artifact on the run, so the operator who pressed "Run" sees the records there.
An unknown rule, a status that cannot be requeued, a `by` longer than the audit row keeps (200)
or a NUL in any text fails the run with a message naming the parameter; nothing is written.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.client.schemas import State
from prefect.runtime import flow_run
from prefect.states import Completed, Failed

from delivery.clock import utcnow
from delivery.db import shared_engine
from delivery.errors import InputError
from delivery.settings import settings
from delivery.store import requeue as requeue_store

#: At most this many records are listed in the artifact; its description always gives the total.
ARTIFACT_ROWS = 500
#: How much of each last_error the artifact shows (the ledger keeps it whole; it is redacted there).
ERROR_EXCERPT = 200

#: What the UI offers for `statuses` (a list of choices, not free text).
RequeuableStatus = Literal["exhausted", "remote_gone", "failed"]


def artifact_key(rule: str) -> str:
    """`requeue-RULE`, in the characters Prefect allows in an artifact key."""
    return "requeue-" + (re.sub(r"[^a-z0-9-]+", "-", rule.lower()).strip("-") or "rule")


def _records(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "external_id": r["external_id"],
            "was": r["status"],
            "attempts": r["attempts"],
            "remote_id": r["remote_id"] or "",
            "last_error": (r["last_error"] or "")[:ERROR_EXCERPT],
        }
        for r in rows
    ]


def _publish(rule: str, rows: list[dict[str, Any]], selection: requeue_store.Selection, dry_run: bool, by: str) -> None:
    verb = "would requeue" if dry_run else "requeued"
    shown = "" if len(rows) <= ARTIFACT_ROWS else f" (the first {ARTIFACT_ROWS} are listed)"
    criteria = selection.as_json()
    description = (
        f"**{rule}**: {verb} {len(rows)} record(s){shown}, asked by `{by}`"
        + (" (dry run: nothing was changed)" if dry_run else "")
        + f"  \nstatuses: `{', '.join(criteria['statuses'])}`"
        + (f"  \nids: `{', '.join(criteria['external_ids'])}`" if criteria["external_ids"] else "")
        + (f"  \nerror contains: `{criteria['error_contains']}`" if criteria["error_contains"] else "")
        + (f"  \nparked since: `{criteria['since']}`" if criteria["since"] else "")
    )
    table = _records(rows[:ARTIFACT_ROWS]) or [
        {"external_id": "", "was": "", "attempts": "", "remote_id": "", "last_error": "no record matched"}
    ]
    create_table_artifact(table=table, key=artifact_key(rule), description=description)


@flow(name="delivery-requeue", retries=0, log_prints=False)
def delivery_requeue(
    rule: str,
    statuses: list[RequeuableStatus] | None = None,
    ids: list[str] | None = None,
    error_contains: str | None = None,
    since: datetime | None = None,
    dry_run: bool = False,
    by: str | None = None,
) -> State[Any]:
    """Put parked records of `rule` back: the selected rows become retries due now (attempts reset);
    a remote_gone row also loses its remote id, so the next chain creates the record again.

    statuses: exhausted, remote_gone, failed (default: exhausted and remote_gone). ids: only these
    external ids. error_contains: only rows whose last error contains this text. since: only rows
    parked at or after this time (UTC if no zone). dry_run: list what would be requeued, change
    nothing. by: who asks (recorded; default: this flow run's name)."""
    logger = get_run_logger()
    settings()  # a bad DELIVERY_* value fails the run here, naming the variable
    who = by or f"delivery-requeue run {flow_run.get_name() or flow_run.get_id()}"
    try:
        try:
            selection = requeue_store.Selection.of(statuses, ids, error_contains, since)
            requeue_store.check_request(rule, who)
        except requeue_store.RequeueInputError as exc:
            raise InputError(f"{exc.parameter}: {exc}") from None
        with shared_engine().begin() as conn:
            rows = requeue_store.requeue_or_preview(
                conn, rule, selection, who, utcnow(), dry_run=dry_run, flow_run_id=flow_run.get_id()
            )
    except InputError as exc:
        logger.error("requeue of %s refused: %s", rule, exc)
        return Failed(message=str(exc), name=type(exc).__name__)
    _publish(rule, rows, selection, dry_run, who)
    verb = "would requeue" if dry_run else "requeued"
    message = f"{verb} {len(rows)} record(s) of {rule}" + ("" if dry_run else f" (recorded as requested by {who})")
    logger.info(message)
    return Completed(
        message=message,
        data={"rule": rule, "dry_run": dry_run, "count": len(rows), "records": _records(rows)},
    )
