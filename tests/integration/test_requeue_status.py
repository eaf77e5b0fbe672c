"""Putting parked records back (`delivery requeue`, `delivery.store.requeue`) and the operator's
overview (`delivery status`), on SQLite and PostgreSQL. Records are parked and delivered by real
chains (driven without Prefect) against the real local HTTP target; the CLI runs in process (CliRunner on
`flows.cli.app`; refusals through `flows.cli.main`, which turns them into exit 2)."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from delivery.clock import utcnow
from delivery.domain import LedgerStatus
from delivery.store import catalog, requeue
from delivery.store.tables import connections_table, requeues_table, rules_table
from flows.cli import app, main
from tests.integration.world import RULE, World
from tests.support.ledger import park, snapshot
from tests.target_server import Answer, TargetServer

STATUSES = [s.value for s in LedgerStatus]


# -- helpers ------------------------------------------------------------------------------------


def cli(*args: str) -> Any:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, f"{args}: exit {result.exit_code}: {result.output} {result.exception!r}"
    return result


def cli_json(*args: str) -> Any:
    return json.loads(cli(*args, "--json").stdout)


def refused(monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    """Run the `delivery` console script (flows.cli:main) in process; expect exit 2 and return
    what it wrote to stderr."""
    monkeypatch.setattr(sys, "argv", ["delivery", *args])
    with CliRunner().isolation() as (stdout, stderr, _):
        try:
            main()
            code: int | str | None = 0
        except SystemExit as exc:
            code = exc.code
        sys.stdout.flush()
        sys.stderr.flush()
        out, err = stdout.getvalue().decode(), stderr.getvalue().decode()
    assert code == 2, f"{args}: exit {code}, stdout {out!r}, stderr {err!r}"
    return err + out


def history_count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(requeues_table)).scalar_one())


def posts_for(target: TargetServer, key: str) -> list[str]:
    return [r.headers["idempotency-key"] for r in target.requests if r.method == "POST" and r.key == key]


@pytest.fixture
def parked(world: World) -> World:
    """Three records left by real chains: `ex` exhausted (a create answered without an id), `gone`
    remote_gone (an update answered 404), `fail` failed and not yet due (a 500)."""
    world.load("ex", "gone", "fail")
    world.target.program(world.key("ex"), Answer.no_id())
    world.target.program(world.key("fail"), Answer.status(500))
    world.run()
    remote_id = world.ledger()["gone"]["remote_id"]
    assert remote_id
    world.load("gone", name="changed")
    world.target.program_remote(remote_id, Answer.status(404))
    world.run()
    rows = world.ledger()
    assert {k: r["status"] for k, r in rows.items()} == {"ex": "exhausted", "gone": "remote_gone", "fail": "failed"}
    assert rows["fail"]["next_attempt_at"] > utcnow() + timedelta(seconds=30)
    return world


def assert_requeued(world: World, external_id: str, before: datetime) -> dict[str, Any]:
    row = world.full_ledger_row(external_id)
    assert row["status"] == "failed" and row["attempts"] == 0
    assert before <= row["next_attempt_at"] <= utcnow()
    return row


def assert_next_chain_delivers_all_three(world: World, first_gone_remote: str) -> None:
    """The drain takes the requeued rows; `gone` is created again with a new Idempotency-Key."""
    result = world.run()
    assert result["state"] == "COMPLETED"
    assert result["drained"]["delivered"] == 3 and result["scanned"]["delivered"] == 0
    rows = world.ledger()
    assert {r["status"] for r in rows.values()} == {"delivered"}
    assert all(r["attempts"] == 0 and r["last_error"] is None for r in rows.values())
    keys = posts_for(world.target, world.key("gone"))
    assert len(keys) == 2 and keys[0] != keys[1]
    assert rows["gone"]["remote_id"] and rows["gone"]["remote_id"] != first_gone_remote
    stored = world.target.records("contacts")
    assert stored[rows["gone"]["remote_id"]]["email"] == world.key("gone")
    assert stored[rows["ex"]["remote_id"]]["email"] == world.key("ex")


# -- requeue through the Python API -------------------------------------------------------------


def test_requeue_through_the_api_puts_parked_rows_back_and_the_next_chain_delivers_them(parked: World) -> None:
    world = parked
    gone_remote = world.ledger()["gone"]["remote_id"]
    gone_generation = world.full_ledger_row("gone")["create_generation"]
    before = utcnow()
    with world.engine.begin() as conn:
        rule = catalog.get_rule(conn, RULE)
        moved = requeue.requeue(conn, rule, requeue.Selection(statuses=(LedgerStatus.FAILED,)), "alice", utcnow())
    assert [r["external_id"] for r in moved] == ["fail"]
    assert_requeued(world, "fail", before)
    assert world.full_ledger_row("ex")["status"] == "exhausted"

    with world.engine.begin() as conn:
        rule = catalog.get_rule(conn, RULE)
        moved = requeue.requeue(conn, rule, requeue.Selection(), "bob", utcnow())
    # Default statuses: the parked ones only.
    assert sorted(r["external_id"] for r in moved) == ["ex", "gone"]
    assert_requeued(world, "ex", before)
    gone = assert_requeued(world, "gone", before)
    assert gone["remote_id"] is None and gone["create_generation"] == gone_generation + 1
    assert "requeued by bob" in gone["last_error"] and "remote_gone" in gone["last_error"]

    with world.engine.connect() as conn:
        history = requeue.list_requeues(conn, RULE)
    assert [(h["requested_by"], h["count"]) for h in history] == [("bob", 2), ("alice", 1)]

    assert_next_chain_delivers_all_three(world, gone_remote)


# -- requeue through the CLI --------------------------------------------------------------------


def test_requeue_through_the_cli_dry_run_then_real_then_history(parked: World) -> None:
    world = parked
    gone_remote = world.ledger()["gone"]["remote_id"]
    before_rows = snapshot(world.engine)

    preview = cli_json("requeue", RULE, "--dry-run", "--by", "carol")
    assert preview["dry_run"] is True and preview["count"] == 2
    assert sorted((r["external_id"], r["status"]) for r in preview["records"]) == [
        ("ex", "exhausted"),
        ("gone", "remote_gone"),
    ]
    cli("requeue", RULE, "--dry-run")  # the table form too
    assert snapshot(world.engine) == before_rows
    assert history_count(world.engine) == 0
    assert cli_json("requeues") == []

    before = utcnow()
    table = cli("requeue", RULE, "--status", "failed", "--by", "dave")
    assert "requeued 1 record" in table.stdout and "dave" in table.stdout
    assert_requeued(world, "fail", before)
    assert world.full_ledger_row("ex")["status"] == "exhausted"

    done = cli_json("requeue", RULE, "--by", "carol")
    assert done["dry_run"] is False and done["count"] == 2
    assert sorted(r["external_id"] for r in done["records"]) == ["ex", "gone"]
    assert_requeued(world, "ex", before)
    assert assert_requeued(world, "gone", before)["remote_id"] is None

    history = cli_json("requeues")
    assert [(h["rule"], h["requested_by"], h["count"]) for h in history] == [(RULE, "carol", 2), (RULE, "dave", 1)]
    for entry in history:
        assert set(entry) >= {"rule", "requested_by", "requested_at", "count", "criteria"}
        assert before <= datetime.fromisoformat(entry["requested_at"]) <= utcnow()
    assert sorted(history[0]["criteria"]["statuses"]) == ["exhausted", "remote_gone"]
    assert history[1]["criteria"]["statuses"] == ["failed"]
    assert cli_json("requeues", "--rule", RULE) == history
    assert "carol" in cli("requeues").stdout

    assert_next_chain_delivers_all_three(world, gone_remote)


# -- selecting rows (rows written directly; no chain needed) -------------------------------------

OLD = datetime(2024, 1, 1, 8, 0, tzinfo=UTC)
NEW = datetime(2025, 6, 1, 8, 0, tzinfo=UTC)


@pytest.fixture
def rows(engine: sa.Engine, target: TargetServer) -> World:
    world = World(engine, target).apply()
    world.load("p1", "p2", "p3", "pct", "under", "old", "fresh-failed")
    park(world, "p1", "exhausted", updated_at=NEW)
    park(world, "p2", "exhausted", updated_at=NEW)
    park(world, "p3", "remote_gone", last_error="PATCH contacts/r-9: HTTP 404", updated_at=NEW)
    park(world, "pct", "exhausted", last_error="HTTP 422: quota 100% used_up", updated_at=NEW)
    park(world, "under", "exhausted", last_error="HTTP 422: quota 1000 usedXup", updated_at=NEW)
    park(world, "old", "exhausted", updated_at=OLD)
    park(world, "fresh-failed", "failed", updated_at=NEW)
    return world


def selected(*args: str) -> list[str]:
    return sorted(r["external_id"] for r in cli_json("requeue", RULE, "--dry-run", *args)["records"])


def test_default_selection_is_the_parked_statuses(rows: World) -> None:
    assert selected() == ["old", "p1", "p2", "p3", "pct", "under"]
    assert selected("--status", "failed") == ["fresh-failed"]
    assert selected("--status", "failed", "--status", "remote_gone") == ["fresh-failed", "p3"]


def test_both_parked_statuses_named_explicitly(rows: World) -> None:
    done = cli_json("requeue", RULE, "--status", "exhausted", "--status", "remote_gone", "--by", "erin")
    assert sorted(r["external_id"] for r in done["records"]) == ["old", "p1", "p2", "p3", "pct", "under"]
    assert rows.full_ledger_row("p3")["remote_id"] is None
    assert rows.ledger()["fresh-failed"]["attempts"] == 1  # not named, not touched


def test_requeue_selecting_nothing_changes_nothing_and_records_nothing(rows: World) -> None:
    before = snapshot(rows.engine)
    with rows.engine.begin() as conn:
        rule = catalog.get_rule(conn, RULE)
        moved = requeue.requeue(conn, rule, requeue.Selection(external_ids=("nobody",)), "x", utcnow())
    assert moved == []
    assert cli_json("requeue", RULE, "--id", "nobody")["count"] == 0
    assert snapshot(rows.engine) == before and history_count(rows.engine) == 0


def test_id_filter_is_repeatable(rows: World) -> None:
    done = cli_json("requeue", RULE, "--id", "p1", "--id", "p3", "--id", "not-there", "--by", "ops")
    assert sorted(r["external_id"] for r in done["records"]) == ["p1", "p3"]
    ledger_rows = rows.ledger()
    assert ledger_rows["p1"]["status"] == "failed" and ledger_rows["p3"]["status"] == "failed"
    assert ledger_rows["p2"]["status"] == "exhausted"
    assert cli_json("requeues")[0]["criteria"]["external_ids"] == ["p1", "p3", "not-there"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("HTTP 404", ["p3"]),
        ("100%", ["pct"]),  # '%' is not a wildcard: "1000" does not match
        ("used_up", ["pct"]),  # '_' is not a wildcard: "usedXup" does not match
        ("quota", ["pct", "under"]),
        ("nothing like it", []),
    ],
)
def test_error_contains_matches_a_literal_substring(rows: World, text: str, expected: list[str]) -> None:
    assert selected("--error-contains", text) == expected


def test_error_contains_requeue_changes_only_the_matching_rows(rows: World) -> None:
    done = cli_json("requeue", RULE, "--error-contains", "100%", "--by", "ops")
    assert [r["external_id"] for r in done["records"]] == ["pct"]
    assert rows.ledger()["under"]["status"] == "exhausted"
    assert cli_json("requeues")[0]["criteria"]["error_contains"] == "100%"


@pytest.mark.parametrize(
    "since", ["2025-01-01T00:00:00+00:00", "2025-01-01T00:00", "2025-01-01", "2025-06-01T08:00:00Z"]
)
def test_since_excludes_rows_updated_before(rows: World, since: str) -> None:
    assert "old" not in selected("--since", since)
    assert selected("--since", since) == ["p1", "p2", "p3", "pct", "under"]


def test_since_with_an_offset_is_compared_in_utc(rows: World) -> None:
    # 2025-06-01T09:00+02:00 is 07:00 UTC, before the rows' 08:00 UTC: they are included.
    assert "p1" in selected("--since", "2025-06-01T09:00+02:00")
    # 2025-06-01T09:00 UTC is after them.
    assert selected("--since", "2025-06-01T09:00+00:00") == []


def test_refused_requeues_exit_2_and_change_nothing(rows: World, monkeypatch: pytest.MonkeyPatch) -> None:
    before = snapshot(rows.engine)
    assert "--since" in refused(monkeypatch, "requeue", RULE, "--since", "yesterday-ish")
    assert "no rule named 'nope'" in refused(monkeypatch, "requeue", "nope")
    assert "--status" in refused(monkeypatch, "requeue", RULE, "--status", "delivered")
    assert "--status" in refused(monkeypatch, "requeue", RULE, "--status", "suppressed")
    assert "--status" in refused(monkeypatch, "requeue", RULE, "--status", "bogus")
    assert snapshot(rows.engine) == before
    assert history_count(rows.engine) == 0


# -- delivery status ----------------------------------------------------------------------------


def test_status_on_an_empty_database(engine: sa.Engine) -> None:
    assert cli_json("status") == []
    assert "no rules yet" in cli("status").stdout


def test_status_of_a_caught_up_rule(world: World) -> None:
    world.load("a", "b")
    world.run()
    [row] = cli_json("status")
    assert set(row) >= {
        "rule",
        "enabled",
        "route_open",
        "route",
        "breaker",
        "cursor",
        "cursor_lag_seconds",
        "counts",
        "due_retries",
        "last_chain",
    }
    assert row["rule"] == RULE and row["enabled"] is True
    assert row["route_open"] is True and row["route"] == "open"
    assert row["breaker"].startswith("closed")
    assert row["cursor"]["record_id"] == world.record_id("b")
    assert row["cursor_lag_seconds"] == 0
    assert row["counts"] == {**dict.fromkeys(STATUSES, 0), "delivered": 2}
    assert row["due_retries"] == 0
    assert row["last_chain"]["ended_by"] == "caught_up"
    assert row["last_chain"]["message"] == "caught up: 2 delivered"
    assert row["last_chain"]["ended_at"] is not None
    cli("status")


def test_status_of_a_busy_rule_with_a_tripped_breaker(world: World) -> None:
    world.load(*[f"r{n}" for n in range(6)])
    world.target.down = True
    result = world.run()
    assert result["ended_by"] == "breaker_open"

    [row] = cli_json("status")
    assert row["route_open"] is True
    assert row["breaker"].startswith("open"), row["breaker"]
    assert row["cursor"]["record_id"] == world.record_id("r2")
    assert row["cursor_lag_seconds"] > 0  # r3..r5 lie beyond the cursor, undelivered
    assert row["counts"]["failed"] == 3 and row["counts"]["delivered"] == 0
    assert row["due_retries"] == 0
    assert row["last_chain"]["ended_by"] == "breaker_open"
    assert "breaker open" in row["last_chain"]["message"]

    world.make_due()
    [row] = cli_json("status")
    assert row["due_retries"] == 3

    with world.engine.begin() as conn:
        conn.execute(connections_table.update().where(connections_table.c.name == "crm").values(status="error"))
    [row] = cli_json("status")
    assert row["route_open"] is False
    assert "crm" in row["route"] and "error" in row["route"] and "target" in row["route"]
    assert "caught up" not in cli("status").stdout  # the table form works on a busy database


def test_status_lag_counts_a_failed_row_behind_the_cursor(world: World) -> None:
    world.load("a", "b")
    world.target.program(world.key("a"), Answer.status(500))
    world.run()
    [row] = cli_json("status")
    assert row["cursor"]["record_id"] == world.record_id("b")  # the cursor moved past the failure
    assert row["counts"]["failed"] == 1 and row["counts"]["delivered"] == 1
    assert row["cursor_lag_seconds"] > 0  # a's change is still undelivered


def test_status_shows_no_lag_for_changes_delivered_beyond_a_cursor_that_did_not_move(world: World) -> None:
    """A chain killed after its records settled but before its cursor moved leaves them delivered
    beyond the cursor; the next chain finds nothing to send and the cursor stays. Nothing is
    behind, and status must not say so (a lag alert would fire until the next change)."""
    world.load("a", "b")
    world.run()
    with world.engine.begin() as conn:
        conn.execute(
            rules_table.update().where(rules_table.c.name == RULE).values(cursor_changed_at=None, cursor_record_id=None)
        )
    assert world.run()["ended_by"] == "caught_up"
    [row] = cli_json("status")
    assert row["counts"]["delivered"] == 2
    assert row["cursor_lag_seconds"] == 0
    world.load("c", at=utcnow() - timedelta(seconds=1))  # changed a second before status looks
    [row] = cli_json("status")
    assert row["cursor_lag_seconds"] > 0  # c's change is waiting
