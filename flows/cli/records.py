"""Commands over the ledger: what each record's row says, and putting parked records back."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import typer

from delivery.domain import LedgerStatus
from delivery.errors import InputError
from flows.cli.apps import app
from flows.cli.output import (
    JsonFlag,
    console,
    engine,
    iso,
    print_json,
    read_only,
    say,
    show,
)

#: As `delivery.listings.DEFAULT_ATTEMPTS` and `MAX_ATTEMPTS`: repeated here so that importing the
#: `delivery` command does not import the store and SQLAlchemy (a test keeps them equal).
DEFAULT_ATTEMPTS = 50
MAX_ATTEMPTS = 10_000


@app.command("ledger")
def show_ledger(
    rule: Annotated[str | None, typer.Option("--rule", help="Only this rule.")] = None,
    status: Annotated[LedgerStatus | None, typer.Option("--status", help="Only this status.")] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, max=1_000_000_000, help="At most this many rows.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Ledger rows: one per (rule, record), with status, remote id, attempts, next attempt and last error."""
    from delivery import listings

    with read_only() as conn:
        rows = listings.ledger_rows(conn, rule, status, limit)
    if as_json:
        print_json(
            [{**r, "next_attempt_at": iso(r["next_attempt_at"]), "updated_at": iso(r["updated_at"])} for r in rows]
        )
        return
    show(
        [
            {
                # A record's heading names its rule too: ledger rows of several rules are listed together.
                "record": f"{r['rule']} / {r['external_id']}",
                # In doubt: a write's answer was never seen, so the next offer is sent whatever its body.
                "status": r["status"]
                + (" (delete in doubt)" if r["deleting"] else " (in doubt)" if r["in_doubt"] else ""),
                "remote_id": r["remote_id"] or "-",
                "attempts": str(r["attempts"]),
                "next_attempt_at": iso(r["next_attempt_at"]) or "-",
                "last_error": r["last_error"] or "-",
            }
            for r in rows
        ],
        empty="no ledger rows" + (" match" if rule or status else " yet: `delivery run RULE` delivers and records"),
    )


@app.command("attempts")
def show_attempts(
    rule: Annotated[str, typer.Argument(help="Rule name.")],
    record_id: Annotated[str, typer.Argument(help="The record's id in the source (its external id).")],
    limit: Annotated[
        int,
        typer.Option("--limit", min=1, max=MAX_ATTEMPTS, help="At most this many requests, newest first."),
    ] = DEFAULT_ATTEMPTS,
    as_json: JsonFlag = False,
) -> None:
    """A record's history under RULE: every request its chains made, newest first, with the chain
    run, verb, method and path, status code or transport error, duration, the start of the answer
    (secrets masked) and the outcome it led to. Kept DELIVERY_ATTEMPTS_KEEP_DAYS days (14).
    Exit 2 for an unknown rule or a record the rule's source has not mirrored."""
    from delivery import listings

    with read_only() as conn:
        history = listings.record_history(conn, rule, record_id, limit)
    tried = history["attempts"]
    if as_json:
        print_json([{**a, "at": iso(a["at"])} for a in tried])
        return
    row = history["ledger"]
    if row is None:
        say(f"{rule} / {record_id}: no ledger row (this rule has not settled it yet)")
    else:
        flags = " (delete in doubt)" if row["deleting"] else " (in doubt)" if row["in_doubt"] else ""
        say(
            f"{rule} / {record_id}: {row['status']}{flags}, remote id {row['remote_id'] or '-'}, "
            f"{row['attempts']} attempt{'' if row['attempts'] == 1 else 's'} counted"
        )
    show(
        [
            {
                "at": iso(a["at"]) or "-",
                "request": f"{a['verb']}: {a['method']} {a['path']}",
                "answer": str(a["status_code"]) if a["status_code"] is not None else (a["error"] or "-"),
                "ms": str(a["duration_ms"]),
                "outcome": a["outcome"],
                "excerpt": (a["answer_excerpt"] or "-")[:120],
                "chain run": a["chain_run_id"] or "-",
            }
            for a in tried
        ],
        empty="no requests recorded for this record (none made, or older than DELIVERY_ATTEMPTS_KEEP_DAYS)",
    )


def _criteria_text(criteria: dict[str, object]) -> str:
    """A requeue's selection in words (`statuses exhausted, remote_gone; ids c-1, c-2`), what was
    not given left out."""
    parts = []
    for key, label in (("statuses", "statuses"), ("external_ids", "ids")):
        values = criteria.get(key)
        if isinstance(values, list) and values:
            parts.append(f"{label} {', '.join(str(v) for v in values)}")
    if criteria.get("error_contains"):
        parts.append(f"error contains {criteria['error_contains']!r}")
    if criteria.get("since"):
        parts.append(f"since {criteria['since']}")
    return "; ".join(parts) or "-"


def _parse_time(value: str) -> datetime:
    from datetime import UTC

    try:
        when = datetime.fromisoformat(value)
    except ValueError as exc:
        raise InputError(f"--since: {value!r} is not an ISO-8601 date or time (e.g. 2026-12-01T08:00)") from exc
    return when if when.tzinfo else when.replace(tzinfo=UTC)


#: The option of `delivery requeue` behind each parameter a requeue's input error names.
_REQUEUE_OPTIONS = {
    "statuses": "--status",
    "ids": "--id",
    "error_contains": "--error-contains",
    "rule": "RULE",
    "by": "--by",
    "since": "--since",
}


@app.command("requeue")
def requeue_command(
    rule: Annotated[str, typer.Argument(help="Rule name.")],
    status: Annotated[
        list[LedgerStatus] | None,
        typer.Option(
            "--status",
            metavar="STATUS",
            help="exhausted | remote_gone | failed (repeatable; default: exhausted and remote_gone).",
        ),
    ] = None,
    ids: Annotated[list[str] | None, typer.Option("--id", help="Only this external id (repeatable).")] = None,
    error_contains: Annotated[
        str | None, typer.Option("--error-contains", help="Only rows whose last error contains TEXT.")
    ] = None,
    since: Annotated[
        str | None, typer.Option("--since", help="Only rows parked at or after TIME (ISO-8601, UTC if no zone).")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", metavar="", help="List what would be requeued; change nothing.")
    ] = False,
    by: Annotated[str | None, typer.Option("--by", help="Who asks (recorded; default: the login name).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Put parked records back: the selected rows become retries due now (attempts reset).

    A remote_gone row also loses its remote id, so the next chain creates the record again (with a new
    Idempotency-Key). Every requeue that puts a row back is recorded; `delivery requeues` lists them."""
    import getpass

    from delivery import requeue as requeue_service

    since_time = _parse_time(since) if since else None
    who = by or getpass.getuser()
    try:
        # The same checks as the delivery-requeue flow's.
        selection = requeue_service.Selection.of(status, ids, error_contains, since_time)
        requeue_service.check_request(rule, who)
    except requeue_service.RequeueInputError as exc:
        raise InputError(f"{_REQUEUE_OPTIONS.get(exc.parameter, exc.parameter)}: {exc}") from None
    with engine().begin() as conn:
        rows = requeue_service.requeue(conn, rule, selection, who, dry_run=dry_run)
    if as_json:
        print_json(
            {
                "rule": rule,
                "dry_run": dry_run,
                "count": len(rows),
                "records": [
                    {
                        "external_id": r["external_id"],
                        "status": r["status"],
                        "remote_id": r["remote_id"],
                        "last_error": r["last_error"],
                    }
                    for r in rows
                ],
            }
        )
        return
    from rich.table import Table

    table = Table("external_id", "was", "remote_id", "attempts", "last_error")
    for r in rows:
        table.add_row(
            r["external_id"], r["status"], r["remote_id"] or "-", str(r["attempts"]), (r["last_error"] or "")[:100]
        )
    console().print(table)
    verb = "would requeue" if dry_run else "requeued"
    say(f"{verb} {len(rows)} record(s) of {rule}" + ("" if dry_run else f" (recorded as requested by {who})"))


@app.command("requeues")
def requeues_command(
    rule: Annotated[str | None, typer.Option("--rule", help="Only this rule.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """The requeue history: who put back how many records of which rule, when, and with what filters."""
    from delivery import requeue as requeue_service

    with read_only() as conn:
        rows = requeue_service.history(conn, rule)
    if as_json:
        print_json([{**r, "requested_at": iso(r["requested_at"])} for r in rows])
        return
    show(
        [
            {
                "requested_at": iso(r["requested_at"]) or "",
                "rule": r["rule"],
                "by": r["requested_by"],
                "count": str(r["count"]),
                "criteria": _criteria_text(r["criteria"]),
            }
            for r in rows
        ],
        empty="no requeues recorded",
    )
