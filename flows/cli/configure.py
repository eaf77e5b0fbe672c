"""Commands that set the engine up: the schema, connections and rules (and listing them), the mirror."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from delivery.domain import ConnectionStatus, LedgerStatus
from delivery.errors import InputError
from flows.cli.apps import app, db_app, mirror_app
from flows.cli.output import (
    JsonFlag,
    cursor_text,
    engine,
    print_json,
    read_only,
    say,
    show,
)

if TYPE_CHECKING:
    from delivery.listings import Retirement


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply the Alembic migrations up to head (the default SQLite file is also migrated on first use)."""
    from delivery.db import check_connection, create_engine, upgrade

    engine = create_engine()
    check_connection(engine)
    upgrade(engine)
    say("database is at the latest schema")


@app.command("apply")
def apply(
    config: Annotated[Path, typer.Argument(help="YAML file with 'connections' and 'rules'.")],
    as_json: JsonFlag = False,
) -> None:
    """Upsert the connections and rules of CONFIG in one transaction (refused input: exit 2, nothing written).
    A rule whose source, domain or target changes has its ledger rows retired and starts over."""
    from delivery.apply import apply_config
    from delivery.config import load_config

    parsed = load_config(config)
    with engine().begin() as conn:
        report = apply_config(conn, parsed)
    if as_json:
        print_json(report.as_json())
        return
    for label, items in (("created", report.created), ("updated", report.updated), ("unchanged", report.unchanged)):
        if items:
            say(f"{label}: {', '.join(items)}")
    for retirement in report.retired:
        say(f"retired: {_retirement_text(retirement)}")
    if not (report.created or report.updated or report.unchanged):
        say("nothing to apply")


def _retirement_text(retirement: Retirement) -> str:
    statuses = ", ".join(f"{count} {status}" for status, count in sorted(retirement.statuses.items()))
    rows = f"{retirement.rows} ledger row{'' if retirement.rows == 1 else 's'}"
    return f"rule {retirement.rule}: {rows}{f' ({statuses})' if statuses else ''}; {retirement.reason}"


@mirror_app.command("load")
def mirror_load(
    file: Annotated[
        Path, typer.Argument(help='JSONL, one record a line: {"id": ..., "payload": {...}, "deleted": false}')
    ],
    source: Annotated[str, typer.Option("--source", help="Source connection name.")],
    domain: Annotated[str, typer.Option("--domain", help="Record domain, e.g. contact.")],
    as_json: JsonFlag = False,
) -> None:
    """Upsert mirror records from FILE, all or nothing; the change signal moves only on a real change."""
    from delivery import mirror

    try:
        with engine().begin() as conn:
            report = mirror.load_file(conn, source, domain, file)
    except mirror.MirrorInputError as exc:  # the store names the input; the command line, its option
        raise InputError(f"--{exc.parameter}: {exc.reason}") from None
    if as_json:
        print_json(
            {
                "source": source,
                "domain": domain,
                "file": str(file),
                "read": report.read,
                "inserted": report.inserted,
                "changed": report.changed,
                "unchanged": report.unchanged,
                "repeated": report.repeated,
            }
        )
        return
    repeated = f", {report.repeated} repeated (last one kept)" if report.repeated else ""
    say(
        f"{report.read} records read: {report.inserted} new, {report.changed} changed, {report.unchanged} unchanged"
        + repeated
    )


@app.command("connections")
def list_connections(as_json: JsonFlag = False) -> None:
    """List connections with driver, status, base URL (a password masked), auth kind and where
    its secrets come from (never a value), and settle mode."""
    from delivery import listings
    from delivery.status import auth_text, auth_view, masked_url

    with read_only() as conn:
        items = listings.connections(conn)
    rows = [
        {
            "name": c.name,
            "driver": c.driver,
            "status": c.status.value,
            "base_url": masked_url(c.base_url),
            "token_env": c.token_env,
            "token_secret": c.token_secret,
            "auth": auth_view(c),
            "settle": c.settle.value,
        }
        for c in items
    ]
    if as_json:
        print_json(rows)
        return
    show(
        [
            {
                "connection": str(r["name"]),
                "driver": str(r["driver"] or "-"),
                "status": str(r["status"]),
                "base_url": str(r["base_url"] or "-"),
                "auth": auth_text(c),
                "settle": str(r["settle"]),
            }
            for c, r in zip(items, rows, strict=True)
        ],
        empty="no connections yet: `delivery apply CONFIG.yaml` saves some",
    )


@app.command("connection-status")
def connection_status(
    name: Annotated[str, typer.Argument(help="Connection name.")],
    status: Annotated[
        ConnectionStatus | None, typer.Argument(help="active | error | disabled; leave out to see the connection")
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="End the target's pause now (one a 429/503 Retry-After asked for): recorded on the "
            "connection, and announced by the delivery.target.resumed event where a Prefect API is set.",
        ),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Set a connection's status (a route is open only while both of its connections are
    active); without a status, show it: status, breaker, and its traffic as a target (rate
    budget, requests today, a pause its Retry-After asked for). --resume ends a pause by hand."""
    if resume:
        if status is not None:
            raise InputError("--resume: give it alone, without a status")
        _resume(name)
        return
    from delivery import listings

    if status is not None:
        with engine().begin() as conn:
            listings.set_connection_status(conn, name, status)
        say(f"connection {name} is now {status.value}")
        return
    from delivery.clock import utcnow

    with read_only() as conn:
        shown = listings.connection(conn, name, utcnow())
    if as_json:
        print_json(shown)
        return
    say(f"connection {name}: {shown['status']}")
    say(f"  auth: {shown['auth_text']}")
    say(f"  breaker: {shown['breaker']}")
    say(f"  traffic: {shown['traffic']}")


def _resume(name: str) -> None:
    import os

    from delivery import listings
    from delivery.clock import utcnow

    with engine().begin() as conn:
        ended = listings.resume_target(conn, name, utcnow())
    if ended is None:
        say(f"connection {name} is not paused: nothing to resume")
        return
    until = ended["paused_until"].isoformat(timespec="seconds")
    say(f"connection {name}: its pause until {until} ({ended['reason'] or 'Retry-After'}) is ended; sending again")
    if os.environ.get("PREFECT_API_URL"):
        # Told as a pause found over is told, so automations waiting for it close the same way.
        from flows.traffic_events import RESUMED, emit

        paused_at = ended["paused_at"].isoformat(timespec="seconds") if ended["paused_at"] else None
        emit(RESUMED, name, {"rule": None, "paused_at": paused_at, "until": until, "by": "hand"})


@app.command("rules")
def list_rules(as_json: JsonFlag = False) -> None:
    """List rules: route, policy, cursor and ledger counts per status."""
    from delivery import listings
    from delivery.decisions import closed_connection

    with read_only() as conn:
        items = listings.rules_with_counts(conn)
    rows: list[dict[str, Any]] = [
        {
            "rule": r.name,
            "route": f"{r.source.name}/{r.domain} -> {r.target.name}/{r.collection}",
            "route_open": closed_connection(r) is None,
            "policy": r.policy.value,
            "enabled": r.enabled,
            "cursor": r.cursor.as_json() if r.cursor else None,
            "counts": counts,
        }
        for r, counts in items
    ]
    if as_json:
        print_json(rows)
        return
    show(
        [
            {
                "rule": r.name + ("" if r.enabled else " (disabled)"),
                "route": row["route"] + ("" if row["route_open"] else " (closed)"),
                "policy": r.policy.value,
                "cursor": cursor_text(r.cursor),
                **{s.value: str(counts[s.value]) for s in LedgerStatus},
            }
            for (r, counts), row in zip(items, rows, strict=True)
        ],
        empty="no rules yet: `delivery apply CONFIG.yaml` saves some",
    )
