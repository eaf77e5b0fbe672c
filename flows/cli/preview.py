"""`delivery preview`: what the next chain of a rule would do now, sending and writing nothing."""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli.apps import app
from flows.cli.output import JsonFlag, cursor_text, engine, print_json, say, show

#: As `delivery.preview.DEFAULT_LIMIT` and `MAX_LIMIT`: repeated here so that importing the
#: `delivery` command does not import the engine's decisions (a test keeps them equal).
DEFAULT_LIMIT = 50
MAX_LIMIT = 10_000


@app.command("preview")
def preview_command(
    rule: Annotated[str, typer.Argument(help="Rule name.")],
    limit: Annotated[
        int,
        typer.Option(
            "--limit",
            min=1,
            max=MAX_LIMIT,
            help="Show at most this many due retries, and this many of the scan's first changes.",
        ),
    ] = DEFAULT_LIMIT,
    as_json: JsonFlag = False,
) -> None:
    """What the next chain of RULE would do now, without running it: the due retries (the drain's),
    then the scan's first changes, each as create, update, delete, suppress or skip, and why.

    Read in one read-only transaction: nothing is sent and nothing is written. The first line says
    when the chain would not start (rule disabled, route closed, breaker open, no writer) or would
    fail (the writer lacks a verb). Exit 0, or 2 for an unknown rule or a bad --limit."""
    from delivery.preview import preview

    result = preview(engine(), rule, limit)
    if as_json:
        print_json(result.as_json())
        return
    say(result.hold.line if result.hold else f"the chain of {rule} would start now (target {result.target})")
    if result.scan_from is not None:
        start = result.scan_from.changed_at.isoformat(timespec="seconds")
        say(f"cursor: {cursor_text(result.cursor)}, scan from {start}")
    else:
        say("cursor: - (none yet), scan from the first change")
    show(
        [
            {
                "record": row.external_id,
                "phase": row.phase.value,
                "action": row.action.value,
                "reason": row.reason,
                "status": (row.status.value if row.status else "-") + (" (in doubt)" if row.in_doubt else ""),
                "attempts": str(row.attempts),
                "changed_at": row.changed_at.isoformat(timespec="seconds"),
            }
            for row in result.rows
        ],
        empty="nothing to do: no retry is due and no change follows the cursor",
    )
    say(f"counts: {result.tally}")
    say(f"rows: {result.shown}")
    if result.cut_note:
        say(result.cut_note.replace("at limit", "at --limit", 1))
