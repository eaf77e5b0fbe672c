"""`delivery-record`: what happened to one record, from the Prefect UI, as `delivery attempts`
shows it.

The record's ledger row under the rule and every request its chains made (newest first), read in
one read-only transaction, published as a table artifact `record-RULE-ID` (one row per request)
whose description says what the ledger row says now. The run is named `record RULE/ID` and tagged
`rule:RULE`. An unknown rule or a record the rule's source has not mirrored fails the run with a
message naming it; nothing is written.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.artifacts import acreate_table_artifact
from prefect.client.schemas import State
from prefect.states import Completed, Failed
from pydantic import Field

from delivery import listings
from delivery.db import shared_engine
from delivery.errors import InputError
from delivery.settings import settings
from flows.chain_reporting import tag_this_run

Limit = Annotated[int, Field(ge=1, le=listings.MAX_ATTEMPTS)]

#: The artifact's columns.
COLUMNS = ("at", "verb", "request", "answer", "duration_ms", "outcome", "answer_excerpt", "chain_run_id")


def artifact_key(rule: str, record_id: str) -> str:
    """`record-RULE-ID`, in the characters Prefect allows in an artifact key."""
    slug = re.sub(r"[^a-z0-9-]+", "-", f"{rule}-{record_id}".lower()).strip("-")
    return "record-" + (slug or "record")[:200]


def describe(history: dict[str, Any]) -> str:
    """The artifact's description: the ledger row as it stands."""
    row = history["ledger"]
    head = f"**{history['rule']}** / **{history['external_id']}**: "
    if row is None:
        return head + "no ledger row: this rule has not settled the record yet."
    flags = " (delete in doubt)" if row["deleting"] else " (in doubt)" if row["in_doubt"] else ""
    lines = [
        head + f"`{row['status']}`{flags}, remote id `{row['remote_id'] or '-'}`, "
        f"{row['attempts']} attempt{'' if row['attempts'] == 1 else 's'} counted",
        f"next attempt: {row['next_attempt_at'].isoformat(timespec='seconds') if row['next_attempt_at'] else '-'}",
        f"last error: {row['last_error'] or '-'}",
        f"{len(history['attempts'])} request{'' if len(history['attempts']) == 1 else 's'} below, newest first "
        f"(kept {settings().attempts_keep_days:g} days)",
    ]
    return "  \n".join(lines)


def table(history: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [
        {
            "at": a["at"].isoformat(timespec="seconds"),
            "verb": a["verb"],
            "request": f"{a['method']} {a['path']}",
            "answer": a["status_code"] if a["status_code"] is not None else (a["error"] or "-"),
            "duration_ms": a["duration_ms"],
            "outcome": a["outcome"],
            "answer_excerpt": a["answer_excerpt"] or "",
            "chain_run_id": a["chain_run_id"] or "",
        }
        for a in history["attempts"]
    ]
    return rows or [{**dict.fromkeys(COLUMNS, ""), "request": "no requests recorded for this record"}]


@flow(name="delivery-record", flow_run_name="record {rule}/{record_id}", retries=0, log_prints=False)
async def delivery_record(rule: str, record_id: str, limit: Limit = listings.DEFAULT_ATTEMPTS) -> State[Any]:
    """What happened to one record: its ledger row under the rule and every request its chains
    made, newest first, as a table artifact. Nothing is sent and nothing is written.

    Args:
        rule: The delivery rule (its name, as delivery rules lists it).
        record_id: The record's id in the source (its external id, as delivery ledger shows it).
        limit: At most this many requests, newest first (1 to 10000).
    """
    logger = get_run_logger()
    try:
        with shared_engine().connect().execution_options(readonly=True) as conn:
            history = listings.record_history(conn, rule, record_id, limit)
    except InputError as exc:
        logger.error("record %s of %s refused: %s", record_id, rule, exc)
        await tag_this_run(f"fault:{type(exc).__name__}")
        return Failed(message=f"{type(exc).__name__}: {exc}")
    await acreate_table_artifact(table=table(history), key=artifact_key(rule, record_id), description=describe(history))
    row = history["ledger"]
    message = f"{rule}/{record_id}: {row['status'] if row else 'no ledger row'}, {len(history['attempts'])} requests"
    logger.info(message)
    return Completed(message=message)
