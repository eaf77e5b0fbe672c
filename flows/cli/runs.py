"""Commands that run chains and tell how rules are doing: run, tick, status."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from delivery.domain import LedgerStatus
from delivery.settings import dead_chain_minutes
from delivery.store import catalog
from flows.cli.apps import app
from flows.cli.output import (
    JsonFlag,
    engine,
    json_cursor_text,
    out,
    print_json,
    read_only,
    say,
    show,
)


@app.command("run")
def run(
    rule: Annotated[str, typer.Argument(help="Rule name.")],
    as_json: JsonFlag = False,
) -> None:
    """Run one chain of RULE now through the deliver-rule flow (Prefect's local API, or PREFECT_API_URL).

    Exit 0 when the chain is Completed (caught up, route closed, breaker open, superseded),
    1 when it Failed (a rule fault) or was Cancelled (Ctrl-C, SIGTERM), 2 for an unknown rule."""
    with read_only() as conn:
        catalog.get_rule(conn, rule)
    from flows.deliver_rule import run_now

    result = run_now(rule)
    if as_json:
        print_json(result)
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
        say(f"cursor: {json_cursor_text(result['cursor_before'])} -> {json_cursor_text(result['cursor_after'])}")
        say(f"flow run: {result['flow_run_id']}")
    raise typer.Exit(0 if result["state"] == "COMPLETED" else 1)


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
        dead_chain_minutes(dead_after_minutes, "--dead-after-minutes")
    engine()  # a database that cannot be reached says so before a Prefect API starts for the tick
    result = run_tick(dead_after_minutes)
    if as_json:
        print_json(result)
    else:
        say(f"tick {result['state']}: {result['message']}")
    raise typer.Exit(0 if result["state"] == "COMPLETED" else 1)


@app.command("status")
def status_command(as_json: JsonFlag = False) -> None:
    """Per rule: how the last chain ended and since when, route, breaker, the target's traffic
    (rate budget, a pause), cursor lag (age of the oldest undelivered change), ledger counts, due
    retries, and the last chain's message."""
    from delivery.clock import utcnow
    from delivery.status import overview, plain_time, rule_label

    with read_only() as conn:
        rows = overview(conn, utcnow())
    if as_json:
        print_json(rows)
        return
    show(
        [
            {
                "rule": rule_label(r),
                "last chain": r["last_ending"],
                "since": plain_time(r["last_since"]),
                "route": r["route"],
                "breaker": r["breaker"],
                "traffic": r["traffic"],
                "lag": r["cursor_lag"],
                "delivered": str(r["counts"]["delivered"]),
                "failed (due)": f"{r['counts']['failed']} ({r['due_retries']})",
                "parked": f"{r['counts']['exhausted']} exhausted, {r['counts']['remote_gone']} gone",
                "message": (r["last_chain"] or {}).get("message") or "-",
            }
            for r in rows
        ],
        empty="no rules yet: `delivery apply CONFIG.yaml` saves some",
    )
