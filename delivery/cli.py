"""`delivery`: everything an operator does, from the command line.

Refused input exits 2 with a message naming what is wrong and where, and writes nothing.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import sqlalchemy as sa
import typer
from rich.console import Console
from rich.table import Table

from delivery.db import shared_engine, upgrade
from delivery.domain import ConnectionStatus, LedgerStatus
from delivery.errors import InputError
from delivery.store import catalog
from delivery.store import ledger as ledger_store

# The ephemeral Prefect server would otherwise try to phone home from machines with no internet.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Without PREFECT_API_URL, Prefect starts a local API server and gives it 20 s by default; with a
# fresh PREFECT_HOME it first migrates its own database, which takes longer on a busy small machine.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

app = typer.Typer(
    name="delivery",
    help="Outbound record-delivery engine: apply configuration, load mirrors, run and inspect delivery rules.\n\n"
    "The database is DELIVERY_DATABASE_URL (default: SQLite file delivery.db in the working directory).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
mirror_app = typer.Typer(help="The local mirror of source records.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(mirror_app, name="mirror")
alerts_app = typer.Typer(help="Alerting through Prefect automations.", no_args_is_help=True)
app.add_typer(alerts_app, name="alerts")

out = Console()
err = Console(stderr=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]


def _engine() -> sa.Engine:
    return shared_engine()


def _read() -> sa.Connection:
    return _engine().connect().execution_options(readonly=True)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply the Alembic migrations up to head (the default SQLite file is also migrated on first use)."""
    from delivery.db import create_engine

    engine = create_engine()
    upgrade(engine)
    out.print("database is at the latest schema")


@app.command("apply")
def apply(config: Annotated[Path, typer.Argument(help="YAML file with 'connections' and 'rules'.")]) -> None:
    """Upsert the connections and rules of CONFIG in one transaction (refused input: exit 2, nothing written)."""
    from delivery.config import load_config

    parsed = load_config(config)
    with _engine().begin() as conn:
        report = catalog.apply_config(conn, parsed)
    for label, items in (("created", report.created), ("updated", report.updated), ("unchanged", report.unchanged)):
        if items:
            out.print(f"{label}: {', '.join(items)}")
    if not (report.created or report.updated or report.unchanged):
        out.print("nothing to apply")


@mirror_app.command("load")
def mirror_load(
    file: Annotated[
        Path, typer.Argument(help='JSONL, one record a line: {"id": ..., "payload": {...}, "deleted": false}')
    ],
    source: Annotated[str, typer.Option("--source", help="Source connection name.")],
    domain: Annotated[str, typer.Option("--domain", help="Record domain, e.g. contact.")],
) -> None:
    """Upsert mirror records from FILE, all or nothing; the change signal moves only on a real change."""
    from delivery.mirror_file import read_mirror_file
    from delivery.store.mirror import load_records

    with _engine().begin() as conn:
        report = load_records(conn, source, domain, read_mirror_file(file))
    out.print(
        f"{report.total} records read: {report.inserted} new, {report.changed} changed, {report.unchanged} unchanged"
    )


@app.command("connections")
def list_connections(as_json: JsonFlag = False) -> None:
    """List connections with driver, status and base URL."""
    with _read() as conn:
        items = catalog.list_connections(conn)
    rows = [
        {"name": c.name, "driver": c.driver, "status": c.status.value, "base_url": c.base_url, "token_env": c.token_env}
        for c in items
    ]
    if as_json:
        _print_json(rows)
        return
    table = Table("connection", "driver", "status", "base_url", "token_env")
    for r in rows:
        table.add_row(r["name"], r["driver"] or "-", r["status"], r["base_url"] or "-", r["token_env"] or "-")
    out.print(table)


@app.command("connection-status")
def connection_status(
    name: Annotated[str, typer.Argument(help="Connection name.")],
    status: Annotated[ConnectionStatus, typer.Argument(help="active | error | disabled")],
) -> None:
    """Set a connection's status; a route is open only while both of its connections are active."""
    with _engine().begin() as conn:
        catalog.set_connection_status(conn, name, status)
    out.print(f"connection {name} is now {status.value}")


def _cursor_text(cursor: Any) -> str:
    return "-" if cursor is None else f"{cursor.changed_at.isoformat(timespec='seconds')} #{cursor.record_id}"


@app.command("rules")
def list_rules(as_json: JsonFlag = False) -> None:
    """List rules: route, policy, cursor and ledger counts per status."""
    with _read() as conn:
        items = [(r, ledger_store.counts_by_status(conn, r.id)) for r in catalog.list_rules(conn)]
    rows: list[dict[str, Any]] = [
        {
            "rule": r.name,
            "route": f"{r.source.name}/{r.domain} -> {r.target.name}/{r.collection}",
            "route_open": r.source.status is ConnectionStatus.ACTIVE and r.target.status is ConnectionStatus.ACTIVE,
            "policy": r.policy.value,
            "enabled": r.enabled,
            "cursor": r.cursor.as_json() if r.cursor else None,
            "counts": counts,
        }
        for r, counts in items
    ]
    if as_json:
        _print_json(rows)
        return
    table = Table("rule", "route", "policy", "cursor", *[s.value for s in LedgerStatus])
    for (r, counts), row in zip(items, rows, strict=True):
        route = row["route"] + ("" if row["route_open"] else " [red](closed)[/red]")
        name = r.name + ("" if r.enabled else " [dim](disabled)[/dim]")
        table.add_row(
            name, route, r.policy.value, _cursor_text(r.cursor), *[str(counts[s.value]) for s in LedgerStatus]
        )
    out.print(table)


@app.command("ledger")
def show_ledger(
    rule: Annotated[str | None, typer.Option("--rule", help="Only this rule.")] = None,
    status: Annotated[LedgerStatus | None, typer.Option("--status", help="Only this status.")] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="At most this many rows.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Ledger rows: one per (rule, record), with status, remote id, attempts, next attempt and last error."""
    with _read() as conn:
        if rule is not None:
            catalog.get_rule(conn, rule)
        rows = ledger_store.ledger_rows(conn, rule, status, limit)
    if as_json:
        _print_json(
            [{**r, "next_attempt_at": _iso(r["next_attempt_at"]), "updated_at": _iso(r["updated_at"])} for r in rows]
        )
        return
    table = Table("rule", "external_id", "status", "remote_id", "attempts", "next_attempt_at", "last_error")
    for r in rows:
        table.add_row(
            r["rule"],
            r["external_id"],
            r["status"],
            r["remote_id"] or "-",
            str(r["attempts"]),
            _iso(r["next_attempt_at"]) or "-",
            (r["last_error"] or "")[:120],
        )
    out.print(table)


@app.command("run")
def run(
    rule: Annotated[str, typer.Argument(help="Rule name.")],
    as_json: JsonFlag = False,
) -> None:
    """Run one chain of RULE now through the deliver-rule flow (Prefect's local API, or PREFECT_API_URL).

    Exit 0 when the chain is Completed (caught up, route closed, breaker open, superseded),
    1 when it Failed (a rule fault), 2 for an unknown rule."""
    with _read() as conn:
        catalog.get_rule(conn, rule)
    from flows.deliver_rule import run_now

    result = run_now(rule)
    if as_json:
        _print_json(result)
    else:
        colour = "green" if result["state"] == "COMPLETED" else "red"
        out.print(
            f"[{colour}]{result['state']}[/{colour}] {rule}: {result['ended_by']} - {result['message'] or 'caught up'}"
        )
        table = Table("outcome", "drained", "scanned")
        for s in LedgerStatus:
            table.add_row(s.value, str(result["drained"].get(s.value, 0)), str(result["scanned"].get(s.value, 0)))
        out.print(table)
        out.print(f"cursor: {result['cursor_before']} -> {result['cursor_after']}")
        out.print(f"flow run: {result['flow_run_id']}")
    raise typer.Exit(0 if result["state"] == "COMPLETED" else 1)


def _parse_time(value: str) -> datetime:
    from datetime import UTC

    try:
        when = datetime.fromisoformat(value)
    except ValueError as exc:
        raise InputError(f"--since: {value!r} is not an ISO-8601 date or time (e.g. 2026-12-01T08:00)") from exc
    return when if when.tzinfo else when.replace(tzinfo=UTC)


@app.command("requeue")
def requeue_command(
    rule: Annotated[str, typer.Argument(help="Rule name.")],
    status: Annotated[
        list[LedgerStatus] | None,
        typer.Option(
            "--status", help="exhausted | remote_gone | failed (repeatable; default: exhausted and remote_gone)."
        ),
    ] = None,
    ids: Annotated[list[str] | None, typer.Option("--id", help="Only this external id (repeatable).")] = None,
    error_contains: Annotated[
        str | None, typer.Option("--error-contains", help="Only rows whose last error contains TEXT.")
    ] = None,
    since: Annotated[
        str | None, typer.Option("--since", help="Only rows parked at or after TIME (ISO-8601, UTC if no zone).")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be requeued; change nothing.")] = False,
    by: Annotated[str | None, typer.Option("--by", help="Who asks (recorded; default: the login name).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Put parked records back: the selected rows become retries due now (attempts reset).

    A remote_gone row also loses its remote id, so the next chain creates the record again (with a new
    Idempotency-Key). Every requeue is recorded; `delivery requeues` lists them."""
    import getpass

    from delivery.clock import utcnow
    from delivery.store import requeue as requeue_store

    statuses = tuple(status or requeue_store.DEFAULT_STATUSES)
    if LedgerStatus.DELIVERED in statuses or LedgerStatus.SUPPRESSED in statuses:
        raise InputError("--status: only exhausted, remote_gone and failed rows can be requeued")
    selection = requeue_store.Selection(
        statuses, tuple(ids or ()), error_contains, _parse_time(since) if since else None
    )
    who = by or getpass.getuser()
    with _engine().begin() as conn:
        target_rule = catalog.get_rule(conn, rule)
        if dry_run:
            rows = requeue_store.preview(conn, target_rule, selection)
        else:
            rows = requeue_store.requeue(conn, target_rule, selection, who, utcnow())
    if as_json:
        _print_json(
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
    table = Table("external_id", "was", "remote_id", "attempts", "last_error")
    for r in rows:
        table.add_row(
            r["external_id"], r["status"], r["remote_id"] or "-", str(r["attempts"]), (r["last_error"] or "")[:100]
        )
    out.print(table)
    verb = "would requeue" if dry_run else "requeued"
    out.print(f"{verb} {len(rows)} record(s) of {rule}" + ("" if dry_run else f" (recorded as requested by {who})"))


@app.command("requeues")
def requeues_command(
    rule: Annotated[str | None, typer.Option("--rule", help="Only this rule.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """The requeue history: who put back how many records of which rule, when, and with what filters."""
    from delivery.store import requeue as requeue_store

    with _read() as conn:
        if rule is not None:
            catalog.get_rule(conn, rule)
        rows = requeue_store.history(conn, rule)
    if as_json:
        _print_json([{**r, "requested_at": _iso(r["requested_at"])} for r in rows])
        return
    table = Table("requested_at", "rule", "by", "count", "criteria")
    for r in rows:
        table.add_row(
            _iso(r["requested_at"]) or "", r["rule"], r["requested_by"], str(r["count"]), json.dumps(r["criteria"])
        )
    out.print(table)


@app.command("status")
def status_command(as_json: JsonFlag = False) -> None:
    """Per rule: route, breaker, cursor lag (age of the oldest undelivered change), ledger counts,
    due retries, and how the last chain ended."""
    from delivery.clock import utcnow
    from delivery.status import overview

    with _read() as conn:
        rows = overview(conn, utcnow())
    if as_json:
        _print_json(rows)
        return
    if not rows:
        out.print("no rules yet: `delivery apply CONFIG.yaml` saves some")
        return
    table = Table("rule", "route", "breaker", "lag", "delivered", "failed (due)", "parked", "last chain")
    for r in rows:
        c = r["counts"]
        last = r["last_chain"]
        last_text = (
            "-"
            if last is None
            else ("running" if last["ended_at"] is None else f"{last['ended_by']}: {(last['message'] or '')[:60]}")
        )
        table.add_row(
            r["rule"] + ("" if r["enabled"] else " (disabled)"),
            r["route"],
            r["breaker"],
            f"{r['cursor_lag_seconds']:.0f}s",
            str(c["delivered"]),
            f"{c['failed']} ({r['due_retries']})",
            f"{c['exhausted']} exhausted, {c['remote_gone']} gone",
            last_text,
        )
    out.print(table)


@app.command("tick")
def tick_command(
    dead_after_minutes: Annotated[
        float | None,
        typer.Option(
            "--dead-after-minutes",
            help="Judge a chain dead after this long without a heartbeat (default 15, or DELIVERY_DEAD_CHAIN_MINUTES).",
        ),
    ] = None,
) -> None:
    """Run one tick now: start a chain for every enabled rule that has none alive, replace dead ones.

    Exit 1 when a chain the tick ran itself failed (a misconfigured rule fails on every tick)."""
    import asyncio

    from flows.tick import delivery_tick

    async def _run() -> Any:
        return await delivery_tick(dead_after_minutes=dead_after_minutes, return_state=True)

    state = asyncio.run(_run())
    out.print(f"tick {state.type.value}: {state.message}")
    raise typer.Exit(0 if state.is_completed() else 1)


@app.command("serve")
def serve_command(
    port: Annotated[
        int, typer.Option("--port", help="Port of the local Prefect server (without PREFECT_API_URL).")
    ] = 4200,
) -> None:
    """The long-running job on one machine: serves delivery-tick (every 5 minutes) and deliver-rule.

    Without PREFECT_API_URL it first starts a local Prefect server (SQLite under PREFECT_HOME) and prints
    the UI address; Ctrl-C or SIGTERM stops everything."""
    from flows.serve import serve_forever

    serve_forever(port)


@app.command("sandbox")
def sandbox_command(
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = 8900,
    fail_rate: Annotated[float, typer.Option("--fail-rate", help="Share of writes answered 503 (0..1).")] = 0.0,
    latency_ms: Annotated[int, typer.Option("--latency-ms", help="Latency added to every request.")] = 0,
    timeout_share: Annotated[
        float, typer.Option("--timeout-share", help="Share of the failures that hang instead (client timeouts).")
    ] = 0.0,
    token_env: Annotated[
        str | None, typer.Option("--token-env", help="Require this environment variable's value as bearer token.")
    ] = None,
    db: Annotated[Path | None, typer.Option("--db", help="Keep records in this SQLite file (default: memory).")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Make the fault sequence repeatable.")] = None,
) -> None:
    """A small but real REST target for trying the engine: POST creates, PATCH updates, GET shows what arrived."""
    from delivery.sandbox import SandboxSettings, serve

    token = None
    if token_env:
        token = os.environ.get(token_env)
        if not token:
            raise InputError(f"--token-env: ${token_env} is not set")
    try:
        settings = SandboxSettings(
            port=port,
            fail_rate=fail_rate,
            latency_ms=latency_ms,
            timeout_share=timeout_share,
            token=token,
            db_path=str(db) if db else None,
            seed=seed,
        )
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    serve(settings)


@alerts_app.command("install")
def alerts_install(
    block: Annotated[
        str, typer.Option("--block", help="Notification block as BLOCK-TYPE/NAME, e.g. slack-webhook/ops.")
    ],
    enable: Annotated[
        bool, typer.Option("--enable/--disabled", help="Create the automations enabled or paused.")
    ] = True,
) -> None:
    """Create the two automations that alert once when a rule starts failing and once when it recovers."""
    import asyncio

    from flows.alerts import install

    for name in asyncio.run(install(block, enable)):
        out.print(f"automation {name!r} {'enabled' if enable else 'created paused'}")


@app.command("demo")
def demo_command(
    workdir: Annotated[
        Path, typer.Option("--workdir", help="Where the demo keeps its database and files (emptied first).")
    ] = Path("demo-run"),
    records: Annotated[int, typer.Option("--records", min=20, max=100_000, help="Size of the sample mirror.")] = 3000,
) -> None:
    """Show the engine end to end on the embedded defaults: sandbox target, sample config and mirror,
    deliveries, updates and suppressions, faults with parked records and a breaker opening, recovery."""
    # Prefect's per-run log lines would drown the story the demo tells; the runs are in the ledger.
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    from flows.demo import run_demo

    run_demo(workdir.resolve(), records, out)


def main() -> None:
    try:
        app()
    except InputError as exc:
        # Plain writes: rich markup would eat "[0]" in paths like rules[0].policy.
        problems = getattr(exc, "problems", None) or [str(exc)]
        for problem in problems:
            sys.stderr.write(f"error: {problem}\n")
        sys.exit(2)
