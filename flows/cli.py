"""`delivery`: everything an operator does, from the command line.

Refused input exits 2 with a message naming what is wrong and where, and writes nothing.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

# isort: split
# First, before the slower imports: on a `delivery serve` command line this takes SIGTERM and SIGINT
# over at once, so that a signal during start-up stops it cleanly too (see flows/stop_signals.py).
import flows.stop_signals  # noqa: F401

# isort: split
import sqlalchemy as sa
import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from delivery.db import DatabaseUnavailable, shared_engine, upgrade
from delivery.domain import ConnectionStatus, LedgerStatus
from delivery.errors import InputError
from delivery.policy import closed_connection
from delivery.settings import positive, secret, settings
from delivery.store import catalog
from delivery.store import ledger as ledger_store

app = typer.Typer(
    name="delivery",
    help="Outbound record-delivery engine: apply configuration, load mirrors, run and inspect delivery rules.\n\n"
    "The database is DELIVERY_DATABASE_URL (default: SQLite file delivery.db in the working directory).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True, rich_markup_mode="markdown")
mirror_app = typer.Typer(help="The local mirror of source records.", no_args_is_help=True, rich_markup_mode="markdown")
app.add_typer(db_app, name="db")
app.add_typer(mirror_app, name="mirror")
alerts_app = typer.Typer(
    help="Alerting through Prefect automations.", no_args_is_help=True, rich_markup_mode="markdown"
)
app.add_typer(alerts_app, name="alerts")

out = Console()
err = Console(stderr=True)


def say(text: str, *, markup: bool = False) -> None:
    """One line for a person, never broken by Rich at the console's width: piped into a script
    or a file (where Rich assumes 80 columns) a line stays one line."""
    out.print(text, soft_wrap=True, markup=markup, highlight=False)


def _json_cursor_text(cursor: dict[str, Any] | None) -> str:
    """A cursor as `delivery run --json` gives it, written as `_cursor_text` writes a saved one."""
    return "-" if cursor is None else f"{cursor['changed_at']} #{cursor['record_id']}"


# A flag takes no value: an empty metavar keeps Typer from showing one (`<bool>`) in --help.
JsonFlag = Annotated[bool, typer.Option("--json", metavar="", help="Print JSON for scripts instead of a table.")]


def _engine() -> sa.Engine:
    return shared_engine()


def _read() -> sa.Connection:
    return _engine().connect().execution_options(readonly=True)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _show(rows: list[dict[str, str]], columns: list[str] | None = None, *, empty: str) -> None:
    """Rows of text as a table when the whole table fits the terminal, else one block per row
    (the first column as its heading, then one `label  value` line per other column).

    Rich fits a table that is too wide by cutting cells (`contact…`); a name or a fault class cut
    that way says nothing, so a narrow terminal gets blocks, whose values wrap and are never cut."""
    if not rows:
        say(empty)  # a blank answer reads as a command that did nothing
        return
    columns = columns or list(rows[0])
    table = Table(*columns)
    for row in rows:
        table.add_row(*(Text(row[c]) for c in columns))
    # Measured without a width limit: Rich clamps a measurement to the width it is given.
    unbounded = out.options.update(width=sys.maxsize, max_width=sys.maxsize)
    if Measurement.get(out, unbounded, table).maximum <= out.width:
        out.print(table)
        return
    heading, *fields = columns
    label_width = max(len(field) for field in fields)
    indent = " " * (2 + label_width + 2)
    for number, row in enumerate(rows):
        if number:
            out.print()
        out.print(Text(row[heading], style="bold"), soft_wrap=True)
        for field in fields:
            # Wrapped here rather than by Rich, so lines carry no padding; a word longer than the
            # line (a URL, say) is broken, never cut.
            lines = textwrap.wrap(row[field], max(20, out.width - len(indent)), break_on_hyphens=False) or [""]
            out.print(f"  {field.ljust(label_width)}  {lines[0]}", markup=False, highlight=False, soft_wrap=True)
            for line in lines[1:]:
                out.print(indent + line, markup=False, highlight=False, soft_wrap=True)


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply the Alembic migrations up to head (the default SQLite file is also migrated on first use)."""
    from delivery.db import check_connection, create_engine

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
    with _engine().begin() as conn:
        report = apply_config(conn, parsed)
    if as_json:
        _print_json(report.as_json())
        return
    for label, items in (("created", report.created), ("updated", report.updated), ("unchanged", report.unchanged)):
        if items:
            say(f"{label}: {', '.join(items)}")
    for retirement in report.retired:
        say(f"retired: {_retirement_text(retirement)}")
    if not (report.created or report.updated or report.unchanged):
        say("nothing to apply")


def _retirement_text(retirement: catalog.Retirement) -> str:
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
    from delivery.mirror_file import read_mirror_file
    from delivery.store.mirror import load_records

    with _engine().begin() as conn:
        report = load_records(conn, source, domain, read_mirror_file(file))
    if as_json:
        _print_json(
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
    """List connections with driver, status, base URL, token source and settle mode."""
    with _read() as conn:
        items = catalog.list_connections(conn)
    rows = [
        {
            "name": c.name,
            "driver": c.driver,
            "status": c.status.value,
            "base_url": c.base_url,
            "token_env": c.token_env,
            "token_secret": c.token_secret,
            "settle": c.settle.value,
        }
        for c in items
    ]
    if as_json:
        _print_json(rows)
        return
    _show(
        [
            {
                "connection": str(r["name"]),
                "driver": r["driver"] or "-",
                "status": str(r["status"]),
                "base_url": r["base_url"] or "-",
                "token": f"env {r['token_env']}"
                if r["token_env"]
                else (f"secret {r['token_secret']}" if r["token_secret"] else "-"),
                "settle": str(r["settle"]),
            }
            for r in rows
        ],
        empty="no connections yet: `delivery apply CONFIG.yaml` saves some",
    )


@app.command("connection-status")
def connection_status(
    name: Annotated[str, typer.Argument(help="Connection name.")],
    status: Annotated[ConnectionStatus, typer.Argument(help="active | error | disabled")],
) -> None:
    """Set a connection's status; a route is open only while both of its connections are active."""
    with _engine().begin() as conn:
        catalog.set_connection_status(conn, name, status)
    say(f"connection {name} is now {status.value}")


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
            "route_open": closed_connection(r) is None,
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
    _show(
        [
            {
                "rule": r.name + ("" if r.enabled else " (disabled)"),
                "route": row["route"] + ("" if row["route_open"] else " (closed)"),
                "policy": r.policy.value,
                "cursor": _cursor_text(r.cursor),
                **{s.value: str(counts[s.value]) for s in LedgerStatus},
            }
            for (r, counts), row in zip(items, rows, strict=True)
        ],
        empty="no rules yet: `delivery apply CONFIG.yaml` saves some",
    )


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
    _show(
        [
            {
                # A record's heading names its rule too: ledger rows of several rules are listed together.
                "record": f"{r['rule']} / {r['external_id']}",
                "status": r["status"],
                "remote_id": r["remote_id"] or "-",
                "attempts": str(r["attempts"]),
                "next_attempt_at": _iso(r["next_attempt_at"]) or "-",
                "last_error": r["last_error"] or "-",
            }
            for r in rows
        ],
        empty="no ledger rows" + (" match" if rule or status else " yet: `delivery run RULE` delivers and records"),
    )


@app.command("run")
def run(
    rule: Annotated[str, typer.Argument(help="Rule name.")],
    as_json: JsonFlag = False,
) -> None:
    """Run one chain of RULE now through the deliver-rule flow (Prefect's local API, or PREFECT_API_URL).

    Exit 0 when the chain is Completed (caught up, route closed, breaker open, superseded),
    1 when it Failed (a rule fault) or was Cancelled (Ctrl-C, SIGTERM), 2 for an unknown rule."""
    with _read() as conn:
        catalog.get_rule(conn, rule)
    from flows.deliver_rule import run_now

    result = run_now(rule)
    if as_json:
        _print_json(result)
    else:
        colour = "green" if result["state"] == "COMPLETED" else "red"
        say(
            f"[{colour}]{result['state']}[/{colour}] {escape(rule)}: {result['ended_by']} - "
            + escape(result["message"] or "caught up"),
            markup=True,
        )
        table = Table("outcome", "drained", "scanned")
        for s in LedgerStatus:
            table.add_row(s.value, str(result["drained"].get(s.value, 0)), str(result["scanned"].get(s.value, 0)))
        out.print(table)
        say(f"cursor: {_json_cursor_text(result['cursor_before'])} -> {_json_cursor_text(result['cursor_after'])}")
        say(f"flow run: {result['flow_run_id']}")
    raise typer.Exit(0 if result["state"] == "COMPLETED" else 1)


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
    Idempotency-Key). Every requeue is recorded; `delivery requeues` lists them."""
    import getpass

    from delivery.clock import utcnow
    from delivery.store import requeue as requeue_store

    since_time = _parse_time(since) if since else None
    who = by or getpass.getuser()
    try:
        # The same checks as the delivery-requeue flow's.
        selection = requeue_store.Selection.of(status, ids, error_contains, since_time)
        requeue_store.check_request(rule, who)
    except requeue_store.RequeueInputError as exc:
        raise InputError(f"{_REQUEUE_OPTIONS.get(exc.parameter, exc.parameter)}: {exc}") from None
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
    say(f"{verb} {len(rows)} record(s) of {rule}" + ("" if dry_run else f" (recorded as requested by {who})"))


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
    _show(
        [
            {
                "requested_at": _iso(r["requested_at"]) or "",
                "rule": r["rule"],
                "by": r["requested_by"],
                "count": str(r["count"]),
                "criteria": json.dumps(r["criteria"]),
            }
            for r in rows
        ],
        empty="no requeues recorded",
    )


@app.command("status")
def status_command(as_json: JsonFlag = False) -> None:
    """Per rule: route, breaker, cursor lag (age of the oldest undelivered change), ledger counts,
    due retries, and how the last chain ended."""
    from delivery.clock import utcnow
    from delivery.status import last_ending, overview

    with _read() as conn:
        rows = overview(conn, utcnow())
    if as_json:
        _print_json(rows)
        return
    _show(
        [
            {
                "rule": r["rule"] + ("" if r["enabled"] else " (disabled)"),
                "route": r["route"],
                "breaker": r["breaker"],
                "lag": f"{r['cursor_lag_seconds']:.0f}s",
                "delivered": str(r["counts"]["delivered"]),
                "failed (due)": f"{r['counts']['failed']} ({r['due_retries']})",
                "parked": f"{r['counts']['exhausted']} exhausted, {r['counts']['remote_gone']} gone",
                "last chain": last_ending(r["last_chain"]),
            }
            for r in rows
        ],
        empty="no rules yet: `delivery apply CONFIG.yaml` saves some",
    )


@app.command("tick")
def tick_command(
    dead_after_minutes: Annotated[
        float | None,
        typer.Option(
            "--dead-after-minutes",
            help="Judge a chain dead after this long without a heartbeat (default 15, or DELIVERY_DEAD_CHAIN_MINUTES).",
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Run one tick now: start a chain for every enabled rule that has none alive and something to
    do, replace dead ones.

    Exit 1 when a chain the tick ran itself failed (a misconfigured rule fails on every tick).
    `--json` prints the tick's state and message and, per rule, what it did: started (with the chain's
    flow run), left alone (alive), idle (nothing to do: no chain, no flow run), or skipped (disabled),
    and the dead chains it replaced."""
    from flows.tick import run_tick

    if dead_after_minutes is not None:
        # NaN, 0 or a negative threshold would judge every live chain dead.
        positive(dead_after_minutes, "--dead-after-minutes")
    _engine()  # a database that cannot be reached says so before a Prefect API starts for the tick
    result = run_tick(dead_after_minutes)
    if as_json:
        _print_json(result)
    else:
        say(f"tick {result['state']}: {result['message']}")
    raise typer.Exit(0 if result["state"] == "COMPLETED" else 1)


@app.command("serve")
def serve_command(
    port: Annotated[
        int, typer.Option("--port", help="Port of the local Prefect server (without PREFECT_API_URL).")
    ] = 4200,
) -> None:
    """The long-running job on one machine: serves delivery-tick (every 5 minutes), deliver-rule and delivery-requeue.

    Without PREFECT_API_URL it first starts a local Prefect server (SQLite under PREFECT_HOME) and prints
    the UI address; Ctrl-C or SIGTERM stops everything (exit 0), a second one stops it at once."""
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
    from playground.sandbox import SandboxSettings, serve

    token = None
    if token_env:
        token = secret(token_env)
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
    directory: Annotated[
        Path | None,
        typer.Option("--dir", help="Where the automation files are (default: automations/ of this checkout)."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Create the alert automations of automations/*.yaml, or update in place those installed before.

    They notify through the block: when a rule starts failing and when it recovers, when a target's
    breaker opens and closes again, when no delivery-tick run Completed for 15 minutes, when a tick fails."""
    import asyncio
    import dataclasses

    from flows.alerts import AUTOMATIONS_DIR, install

    installed = asyncio.run(install(block, enable, directory or AUTOMATIONS_DIR))
    if as_json:
        _print_json([dataclasses.asdict(i) for i in installed])
        return
    for i in installed:
        say(f"{i.action} automation {i.name!r} ({i.file}), {'enabled' if enable else 'paused'}")


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
    from playground.demo import run_demo

    run_demo(workdir.resolve(), records, out)


def _prefect_defaults() -> None:
    """Defaults for Prefect's own settings. Prefect reads them once, when it is first imported, which
    no command does before this runs; set here rather than at import, so that importing this module
    changes nothing in the environment."""
    # The ephemeral Prefect server would otherwise try to phone home from machines with no internet.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Without PREFECT_API_URL, Prefect starts a local API server and gives it 20 s by default; with a
    # fresh PREFECT_HOME it first migrates its own database, which takes longer on a busy small machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def main() -> None:
    _prefect_defaults()
    try:
        settings()  # a bad DELIVERY_* value is refused here, naming it, before any command runs
        app()
    except InputError as exc:
        # Plain writes: rich markup would eat "[0]" in paths like rules[0].policy.
        problems = getattr(exc, "problems", None) or [str(exc)]
        for problem in problems:
            sys.stderr.write(f"error: {problem}\n")
        sys.exit(2)
    except DatabaseUnavailable as exc:
        # Not refused input: the same command works once the database takes connections.
        sys.stderr.write(f"error: {exc}\n")
        sys.exit(1)
