"""`delivery-preview`: what the next chain of a rule would do now, from the Prefect UI, as
`delivery preview` shows it.

The same preview (`delivery.preview`, one read-only transaction: nothing sent, nothing written),
published as a table artifact `preview-RULE` (one row per record: the due retries first, then the
scan's first changes) whose description gives the counts per action and the line saying when the
chain would not start. The run is named `preview RULE` and tagged `rule:RULE` and `target:TARGET`.
An unknown rule or a limit out of range fails the run with a message naming it; nothing is written.
"""

from __future__ import annotations

import re
from typing import Annotated, Any
from uuid import UUID

from prefect import flow, get_client, get_run_logger
from prefect.artifacts import acreate_table_artifact
from prefect.client.schemas import State
from prefect.runtime import flow_run
from prefect.states import Completed, Failed
from pydantic import Field

from delivery.db import shared_engine
from delivery.errors import InputError
from delivery.preview import DEFAULT_LIMIT, MAX_LIMIT, Preview, limit_problem, preview
from delivery.settings import settings
from flows.chain_reporting import tag_this_run

#: The UI's form takes only a limit in range (the parameter schema's minimum and maximum).
Limit = Annotated[int, Field(ge=1, le=MAX_LIMIT)]

#: The artifact's columns, as `delivery preview` prints them.
COLUMNS = ("phase", "external_id", "action", "reason", "status", "attempts", "changed_at")


def artifact_key(rule: str) -> str:
    """`preview-RULE`, in the characters Prefect allows in an artifact key."""
    return "preview-" + (re.sub(r"[^a-z0-9-]+", "-", rule.lower()).strip("-") or "rule")


def run_name(rule: str) -> str:
    return f"preview {rule}"


def _table(result: Preview) -> list[dict[str, Any]]:
    rows = [
        {
            "phase": row.phase.value,
            "external_id": row.external_id,
            "action": row.action.value,
            "reason": row.reason,
            "status": (row.status.value if row.status else "-") + (" (in doubt)" if row.in_doubt else ""),
            "attempts": row.attempts,
            "changed_at": row.changed_at.isoformat(timespec="seconds"),
        }
        for row in result.rows
    ]
    # An empty table shows as nothing at all in the UI: one line says why it is empty.
    return rows or [{**dict.fromkeys(COLUMNS, ""), "reason": "nothing to do: no retry is due and no change follows"}]


def describe(result: Preview) -> str:
    """The artifact's description: the opening line, the counts per action and what they cover."""
    opening = result.hold.line if result.hold else f"the chain would start now (target `{result.target}`)"
    # Deletes named only when there are some, as the terminal's tally does: most rules never delete.
    counts = " · ".join(f"{action}: **{n}**" for action, n in result.counts.items() if n or action != "delete")
    return (
        f"**{result.rule}** at {result.at.isoformat(timespec='seconds')}: {opening}  \n"
        f"{counts}  \n"
        f"rows: {result.shown}" + (f"; {result.cut_note}" if result.cut_note else "") + "  \n"
        "A preview: nothing was sent and nothing written."
    )


async def _label_run(rule: str, target: str) -> None:
    """Name and tag the run after the rule and target, as deliver-rule's runs are."""
    run_id = flow_run.get_id()
    if run_id is None:
        return
    tags = sorted({*flow_run.get_tags(), f"rule:{rule}", f"target:{target}"})
    if flow_run.get_name() == run_name(rule) and set(tags) <= set(flow_run.get_tags()):
        return
    async with get_client() as client:
        await client.update_flow_run(UUID(run_id), name=run_name(rule), tags=tags)


@flow(name="delivery-preview", flow_run_name="preview {rule}", retries=0, log_prints=False)
async def delivery_preview(rule: str, limit: Limit = DEFAULT_LIMIT) -> State[Any]:
    """What the next chain of a rule would do now: the due retries, then the scan's first changes,
    each as create, update, delete, suppress or skip, and why. Nothing is sent and nothing is written.

    Args:
        rule: The delivery rule to preview (its name, as delivery rules lists it).
        limit: At most this many due retries, and this many of the scan's first changes, are
            listed (1 to 10000); the description says when more follow.
    """
    logger = get_run_logger()
    settings()  # a bad DELIVERY_* value fails the run here, naming the variable
    try:
        problem = limit_problem(limit)
        if problem is not None:
            raise InputError(f"limit: {problem}")
        result = preview(shared_engine(), rule, limit)
    except InputError as exc:
        logger.error("preview of %s refused: %s", rule, exc)
        # Plainly Failed, as every refused run is, so Prefect's Failed filter finds it; the class
        # leads the message and is the tag `fault:CLASS`.
        await tag_this_run(f"fault:{type(exc).__name__}")
        return Failed(message=f"{type(exc).__name__}: {exc}")
    await _label_run(result.rule, result.target)
    await acreate_table_artifact(table=_table(result), key=artifact_key(rule), description=describe(result))
    message = (f"{result.hold.line}; " if result.hold else "") + result.summary
    logger.info("preview of %s: %s", rule, message)
    return Completed(message=message, data=result.as_json())
