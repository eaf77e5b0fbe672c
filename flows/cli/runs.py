"""Commands that run chains and tell how rules are doing: run, tick, status."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from delivery.domain import LedgerStatus, Rule
from flows.cli.apps import app
from flows.cli.output import (
    JsonFlag,
    console,
    engine,
    json_cursor_text,
    print_json,
    read_only,
    say,
    show,
)

#: `ended_by` of a `delivery run` that started no chain: the rule had nothing to do.
NOTHING_TO_DO = "nothing_to_do"
NOTHING_TO_DO_MESSAGE = "no due retries, no changes since the cursor"


def nothing_to_do(rule: Rule) -> dict[str, Any]:
    """What `delivery run --json` prints for a rule the tick would leave idle: the keys of a chain's
    summary (`flows.deliver_rule.run_now`), no flow run, every count 0, the cursor where it is."""
    zero = {s.value: 0 for s in LedgerStatus}
    cursor = rule.cursor.as_json() if rule.cursor else None
    return {
        "rule": rule.name,
        "state": "COMPLETED",
        "ended_by": NOTHING_TO_DO,
        "message": NOTHING_TO_DO_MESSAGE,
        "counts": dict(zero),
        "drained": dict(zero),
        "scanned": dict(zero),
        "cursor_before": cursor,
        "cursor_after": cursor,
        "waited_seconds": 0.0,
        "flow_run_id": None,
    }


@app.command("run")
def run(
    rule: Annotated[str, typer.Argument(help="Rule name.")],
    always: Annotated[
        bool,
        typer.Option(
            "--always",
            metavar="",
            help="Run the chain even when the rule has nothing to do: a flow run either way.",
        ),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Run one chain of RULE now through the deliver-rule flow (Prefect's local API, or PREFECT_API_URL).

    A rule the tick would leave idle (enabled, no due retry, no change since its cursor, not
    misconfigured) gets no chain and no flow run: it ends `nothing_to_do`, exit 0, without starting
    Prefect; `--always` runs the chain anyway.

    Exit 0 when the chain is Completed (caught up, route closed, breaker open, superseded, nothing to do),
    1 when it Failed (a rule fault) or was Cancelled (Ctrl-C, SIGTERM), 2 for an unknown rule."""
    from delivery import listings
    from delivery.clock import utcnow
    from delivery.tick import needs_chain

    with read_only() as conn:
        found = listings.rule(conn, rule)
        # The tick's own predicate; a disabled rule still gets its chain, which ends `disabled`.
        idle = not always and found.enabled and not needs_chain(conn, found, utcnow())
    if idle:
        result = nothing_to_do(found)
    else:
        from flows.deliver_rule import run_now

        result = run_now(rule)
    if as_json:
        print_json(result)
    else:
        _say_run(rule, result)
    raise typer.Exit(0 if result["state"] == "COMPLETED" else 1)


def _say_run(rule: str, result: dict[str, Any]) -> None:
    """A `delivery run` for a person: its state and ending, and a chain's counts and cursor."""
    from rich.markup import escape
    from rich.table import Table

    if result["flow_run_id"] is None:
        say(
            f"[green]COMPLETED[/green] {escape(rule)}: {NOTHING_TO_DO} - {NOTHING_TO_DO_MESSAGE}; "
            f"no flow run (--always runs one), cursor {json_cursor_text(result['cursor_after'])}",
            markup=True,
        )
        return
    colour = "green" if result["state"] == "COMPLETED" else "red"
    say(
        f"[{colour}]{result['state']}[/{colour}] {escape(rule)}: {result['ended_by']} - "
        + escape(result["message"] or "caught up"),
        markup=True,
    )
    table = Table("outcome", "drained", "scanned")
    for s in LedgerStatus:
        table.add_row(s.value, str(result["drained"].get(s.value, 0)), str(result["scanned"].get(s.value, 0)))
    console().print(table)
    say(f"cursor: {json_cursor_text(result['cursor_before'])} -> {json_cursor_text(result['cursor_after'])}")
    say(f"flow run: {result['flow_run_id']}")


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
    from delivery.settings import dead_chain_minutes
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
    from delivery.status import last_message, overview, standing

    with read_only() as conn:
        rows = overview(conn, utcnow())
    if as_json:
        print_json(rows)
        return
    show(
        [
            {
                **standing(r),
                # Deleted copies (a rule propagating deletes) beside the delivered ones: most rules have none.
                "delivered": str(r["counts"]["delivered"])
                + (f", {r['counts']['deleted']} deleted" if r["counts"].get("deleted") else ""),
                "failed (due)": f"{r['counts']['failed']} ({r['due_retries']})",
                "parked": f"{r['counts']['exhausted']} exhausted, {r['counts']['remote_gone']} gone",
                "message": last_message(r),
            }
            for r in rows
        ],
        empty="no rules yet: `delivery apply CONFIG.yaml` saves some",
    )
