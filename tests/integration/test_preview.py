"""`delivery preview` and the `delivery-preview` flow: what the next chain of a rule would do now, on
SQLite and PostgreSQL against the real local HTTP target.

The ledger each preview reads is left by real chains (`tests.support.chains.drive`, the flow's
own sequence without Prefect), and what a preview predicts is then checked against what the next
chain really does. A preview sends nothing (the target sees no request) and writes nothing (every
table of the delivery database is the same, row for row, before and after)."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any
from uuid import UUID

import httpx
import pytest
import sqlalchemy as sa

import delivery.settings
import delivery.writers.base
from delivery import preview as preview_module
from delivery.clock import utcnow
from delivery.domain import LedgerStatus, Phase
from delivery.errors import UnknownName
from delivery.preview import (
    CHANGED,
    DELETED,
    IN_DOUBT,
    NEW_RECORD,
    NO_REMOTE_ID,
    REPLAY,
    Action,
    Preview,
    preview,
)
from delivery.store import catalog
from delivery.store.tables import (
    breaker_states_table,
    ledger_table,
    metadata,
    mirror_records_table,
    target_traffic_table,
)
from flows.cli import preview as cli_preview
from flows.preview import artifact_key, delivery_preview
from tests.integration.world import REQUEST_TIMEOUT_SECONDS, RULE, World
from tests.support.chains import drive
from tests.support.faults import close_route, open_breaker
from tests.target_server import Answer, TargetServer

FIELDS = {"email": "email", "full_name": "name"}


# -- helpers ------------------------------------------------------------------------------------


def snapshot(engine: sa.Engine) -> dict[str, list[dict[str, Any]]]:
    """Every row of every table of the delivery database (ledger, chains, rules with their
    cursor and fence, breaker rows, mirror, requeues, ...), in primary-key order."""
    with engine.connect() as conn:
        return {
            table.name: [row._asdict() for row in conn.execute(sa.select(table).order_by(*table.primary_key.columns))]
            for table in metadata.sorted_tables
        }


def due(world: World, *external_ids: str) -> None:
    """Time travel for these failed rows only: due now, in the order given (the first oldest)."""
    now = utcnow()
    record_ids = [world.record_id(external_id) for external_id in external_ids]
    with world.engine.begin() as conn:
        for number, record_id in enumerate(record_ids):
            conn.execute(
                ledger_table.update()
                .where(ledger_table.c.record_id == record_id)
                .values(next_attempt_at=now - timedelta(seconds=60 - number))
            )


def table_of(result: Preview) -> list[tuple[str, str, str, str]]:
    return [(row.phase.value, row.external_id, row.action.value, row.reason) for row in result.rows]


@pytest.fixture
def world(engine: sa.Engine, target: TargetServer) -> World:
    # A breaker that does not trip on the few failures the tests make on purpose.
    return World(engine, target).apply(
        rule={"fields": FIELDS}, target={"breaker": {"fail_max": 50, "reset_seconds": 60}}
    )


@pytest.fixture
def every_case(world: World) -> World:
    """A rule whose next chain meets every action and reason:

    drain (due retries, oldest due first): `deleted-failed` (failed, then deleted in the source),
    `fail` (a create refused with a 500), `fail2` (the same, and changed since), `flaky` (an update
    whose answer never came: in doubt);
    scan (changes in order): `upd` (changed), `same` (changed in a field the rule does not map),
    `ex` (parked exhausted, changed), `gone` (parked remote_gone, changed), `del` (deleted in the
    source), `later` (failed and not due, changed), `new` (never seen)."""
    target = world.target
    world.load("upd", "same", "gone", "ex", "fail", "fail2", "deleted-failed", "flaky", "del", "later")
    target.program(world.key("ex"), Answer.no_id())
    for external_id in ("fail", "fail2", "deleted-failed"):
        target.program(world.key(external_id), Answer.status(500))
    drive(world.engine, RULE)
    rows = world.ledger()
    target.program_remote(rows["gone"]["remote_id"], Answer.status(404))
    target.program_remote(rows["flaky"]["remote_id"], Answer.given_up())
    target.program_remote(rows["later"]["remote_id"], Answer.status(500))
    world.load("gone", "flaky", "later", name="second")
    world.set_timeout()  # for `flaky`'s answer to come too late
    drive(world.engine, RULE)
    world.set_timeout(REQUEST_TIMEOUT_SECONDS)
    statuses = {k: r["status"] for k, r in world.ledger().items()}
    assert statuses == {
        "upd": "delivered",
        "same": "delivered",
        "gone": "remote_gone",
        "ex": "exhausted",
        "fail": "failed",
        "fail2": "failed",
        "deleted-failed": "failed",
        "flaky": "failed",
        "del": "delivered",
        "later": "failed",
    }
    assert world.full_ledger_row("flaky")["in_doubt"] is True
    world.load("deleted-failed", deleted=True)
    world.load("fail2", name="changed since it failed")
    due(world, "deleted-failed", "fail", "fail2", "flaky")
    world.load("upd", name="changed")
    world.load("same", phone="+1 555 0100")  # not mapped: the body sent is the same
    world.load("ex", name="changed")
    world.load("gone", name="changed")
    world.load("del", deleted=True)
    world.load("later", name="changed")
    world.load("new")
    target.requests.clear()  # what the target holds stays: the next chain updates it
    return world


EVERY_CASE = [
    ("drain", "deleted-failed", "suppress", "record deleted in the source; not delivered"),
    ("drain", "fail", "create", f"due retry, attempt 2 of 3: {NO_REMOTE_ID}"),
    ("drain", "fail2", "create", f"due retry, attempt 2 of 3: {NO_REMOTE_ID}; {REPLAY}"),
    ("drain", "flaky", "update", f"due retry, attempt 2 of 3: {IN_DOUBT}"),
    ("scan", "upd", "update", CHANGED),
    ("scan", "same", "suppress", "identical to what was last delivered"),
    ("scan", "ex", "skip", "parked: exhausted; only a requeue puts it back"),
    ("scan", "gone", "skip", "parked: remote_gone; only a requeue puts it back"),
    ("scan", "del", "skip", DELETED),
    ("scan", "later", "skip", "failed, not due yet: the drain retries it from {later}"),
    ("scan", "new", "create", NEW_RECORD),
]


def expected(world: World) -> list[tuple[str, str, str, str]]:
    later = world.full_ledger_row("later")["next_attempt_at"]
    return [(p, e, a, r.format(later=later.isoformat(timespec="seconds"))) for p, e, a, r in EVERY_CASE]


# -- (a) each action and reason, drain first, the limit --------------------------------------------


def test_every_action_and_reason_drain_rows_first(every_case: World) -> None:
    result = preview(every_case.engine, RULE)
    assert result.hold is None
    assert table_of(result) == expected(every_case)
    assert result.counts == {"create": 3, "update": 2, "delete": 0, "suppress": 2, "skip": 4}
    assert result.counts_of(Phase.DRAIN) == {"create": 2, "update": 1, "delete": 0, "suppress": 1, "skip": 0}
    assert not result.cut
    rows = {row.external_id: row for row in result.rows}
    assert rows["new"].status is None and rows["new"].attempts == 0
    assert rows["flaky"].status is LedgerStatus.FAILED and rows["flaky"].in_doubt and rows["flaky"].attempts == 1
    assert rows["ex"].status is LedgerStatus.EXHAUSTED
    with every_case.engine.connect() as conn:
        changed_at = conn.execute(
            sa.select(mirror_records_table.c.changed_at).where(mirror_records_table.c.external_id == "new")
        ).scalar_one()
    assert rows["new"].changed_at == changed_at
    assert result.cursor == every_case.cursor()
    assert result.scan_from is not None and result.cursor is not None
    assert result.scan_from.changed_at == result.cursor.changed_at - timedelta(seconds=300)


def test_the_next_chain_does_what_the_preview_said(every_case: World) -> None:
    world, target = every_case, every_case.target
    result = preview(world.engine, RULE)
    before = {row.external_id: world.full_ledger_row(row.external_id) for row in result.rows if row.status}
    drive(world.engine, RULE)
    after = world.ledger()
    for row in result.rows:
        key = world.key(row.external_id)
        methods = [r.method for r in target.requests if r.key in (key, row.remote_id)]
        if row.action is Action.CREATE:
            assert methods[0] == "POST", row
            assert after[row.external_id]["status"] == "delivered", row
        elif row.action is Action.UPDATE:
            assert methods == ["PATCH"], row
            assert after[row.external_id]["status"] == "delivered", row
        elif row.action is Action.SUPPRESS:
            assert methods == [], row
            assert after[row.external_id]["status"] == "suppressed", row
            assert after[row.external_id]["last_error"] == row.reason, row
        else:
            assert methods == [], row
            assert world.full_ledger_row(row.external_id) == before[row.external_id], row
    # The replayed create is followed by an update with the latest body, as the reason said.
    assert [r.method for r in target.requests if r.key == world.key("fail2")] == ["POST"]
    assert target.records("contacts")[after["fail2"]["remote_id"]]["full_name"] == "changed since it failed"
    # Nothing is left to do but the parked, the deleted and the failed row not due yet.
    again = preview(world.engine, RULE)
    assert [(row.external_id, row.action.value) for row in again.rows] == [
        ("ex", "skip"),
        ("gone", "skip"),
        ("del", "skip"),
        ("later", "skip"),
    ]


def test_the_limit_bounds_each_phase_and_says_when_it_cut(world: World) -> None:
    world.load("f1", "f2", "f3")
    for external_id in ("f1", "f2", "f3"):
        world.target.program(world.key(external_id), Answer.status(500))
    drive(world.engine, RULE)
    due(world, "f3", "f1", "f2")  # oldest due first: f3, f1, f2
    for external_id in ("n1", "n2", "n3", "n4"):
        world.load(external_id)

    cut = preview(world.engine, RULE, limit=2)
    assert [(row.phase.value, row.external_id) for row in cut.rows] == [
        ("drain", "f3"),
        ("drain", "f1"),
        ("scan", "n1"),
        ("scan", "n2"),
    ]
    assert cut.drain_cut and cut.scan_cut and cut.cut
    assert cut.counts == {"create": 4, "update": 0, "delete": 0, "suppress": 0, "skip": 0}
    assert cut.summary == (
        "4 create, 0 update, 0 suppress, 0 skip (of the first 2 due retries, the first 2 changes); "
        "cut off at limit 2: more due retries and more changes follow, not counted"
    )
    assert cut.as_json()["drain"] == {
        "shown": 2,
        "cut": True,
        "counts": {"create": 2, "update": 0, "delete": 0, "suppress": 0, "skip": 0},
    }

    whole = preview(world.engine, RULE, limit=4)
    assert len(whole.drain) == 3 and len(whole.scan) == 4
    assert not whole.drain_cut and not whole.scan_cut
    assert "cut off" not in whole.summary
    exact = preview(world.engine, RULE, limit=3)
    assert not exact.drain_cut and exact.scan_cut  # exactly 3 due: nothing more is due
    assert exact.cut_note == "cut off at limit 3: more changes follow, not counted"

    for bad in (0, -1, 10_001, True, 2.5):
        with pytest.raises(ValueError, match="limit must be a whole number from 1 to 10000"):
            preview(world.engine, RULE, limit=bad)  # type: ignore[arg-type]


EXCLUDED = {
    "create_only": [("update", "suppress", "policy create_only excludes update"), ("create", "create", NEW_RECORD)],
    "update_only": [("update", "update", CHANGED), ("create", "suppress", "policy update_only excludes create")],
}


@pytest.mark.parametrize("policy", list(EXCLUDED))
def test_a_verb_the_policy_excludes_is_suppressed(world: World, policy: str) -> None:
    world.load("update")
    drive(world.engine, RULE)
    world.apply(rule={"fields": FIELDS, "policy": policy})
    world.load("update", name="changed")
    world.load("create")
    result = preview(world.engine, RULE)
    assert table_of(result) == [("scan", *row) for row in EXCLUDED[policy]]


def test_an_unknown_rule_is_refused(world: World) -> None:
    with pytest.raises(UnknownName, match="no rule named 'nope'"):
        preview(world.engine, "nope")


def test_an_empty_preview(world: World) -> None:
    result = preview(world.engine, RULE)
    assert result.rows == [] and result.hold is None and result.cursor is None and result.scan_from is None
    assert result.summary == "0 create, 0 update, 0 suppress, 0 skip (of 0 due retries, 0 changes)"


# -- why the chain would not start (a line, not an exception) -------------------------------------


def _disable(world: World) -> None:
    world.apply(rule={"fields": FIELDS, "enabled": False})


def _pause_target(world: World) -> None:
    with world.engine.begin() as conn:
        target_id = catalog.get_rule(conn, RULE).target.id
        conn.execute(
            target_traffic_table.update()
            .where(target_traffic_table.c.connection_id == target_id)
            .values(paused_until=utcnow() + timedelta(seconds=300), pause_reason="HTTP 429, Retry-After 300 s")
        )


HOLDS = {
    "disabled": (_disable, "the chain would not start now (disabled): rule 'contacts-to-crm' is disabled"),
    "route_closed": (
        close_route,
        "the chain would not start now (route_closed): route closed: target connection 'crm' is error",
    ),
    "breaker_open": (
        open_breaker,
        "the chain would not start now (breaker_open): breaker open for target 'crm' until",
    ),
    "rate_limited": (
        _pause_target,
        "the chain would not start now (rate_limited): target 'crm' is paused until",
    ),
    "missing_writer": (
        lambda world: world.set_driver("soap"),
        "the chain would fail at once (MissingWriter): rule 'contacts-to-crm': no writer is registered for "
        "target driver 'soap'",
    ),
    "missing_verb": (
        lambda world: world.set_driver("rest-create-only"),
        "the chain would fail (UnsupportedDeliveryVerb) at its first such record: rule 'contacts-to-crm': the "
        "writer for driver 'rest-create-only' does not offer the 'update' verb the rule needs",
    ),
}


@pytest.mark.parametrize("kind", list(HOLDS))
def test_a_chain_that_would_not_start_says_why_in_a_line_and_still_lists_the_records(world: World, kind: str) -> None:
    world.load("old")
    drive(world.engine, RULE)
    world.load("old", name="changed")
    world.load("new")
    make, line = HOLDS[kind]
    make(world)
    world.target.requests.clear()
    before = snapshot(world.engine)

    result = preview(world.engine, RULE)
    assert result.hold is not None and result.hold.kind == kind
    assert result.hold.line.startswith(line), result.hold.line
    assert result.as_json()["starts"] is (kind == "missing_verb")
    assert [(row.external_id, row.action.value) for row in result.rows] == [("old", "update"), ("new", "create")]
    if kind == "missing_verb":
        assert result.rows[0].reason.endswith(
            "the writer cannot update: the chain fails here (UnsupportedDeliveryVerb)"
        )
        assert result.rows[1].reason == NEW_RECORD
    assert snapshot(world.engine) == before
    assert world.target.requests == []


def test_a_breaker_whose_cooldown_has_passed_does_not_hold_the_chain(world: World) -> None:
    open_breaker(world)
    with world.engine.begin() as conn:
        conn.execute(breaker_states_table.update().values(opened_at=utcnow() - timedelta(seconds=61)))
    assert preview(world.engine, RULE).hold is None


# -- (b) a preview changes nothing and sends nothing ---------------------------------------------


def test_a_preview_writes_nothing_and_sends_nothing(every_case: World, monkeypatch: pytest.MonkeyPatch) -> None:
    world = every_case
    # No token is read and no HTTP client is built: the chain would have both.
    monkeypatch.delenv("CRM_TOKEN")

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("a preview must neither read a token nor build an HTTP client")

    monkeypatch.setattr(delivery.settings, "secret", refuse)
    monkeypatch.setattr(delivery.writers.base, "secret", refuse)
    monkeypatch.setattr(httpx.Client, "__init__", refuse)
    before = snapshot(world.engine)
    assert (
        before["ledger"] and before["chains"] and before["breaker_states"] and before["rules"][0]["cursor_changed_at"]
    )

    first = preview(world.engine, RULE)
    assert snapshot(world.engine) == before
    assert world.target.requests == []
    # The same answer again: nothing it read was changed by reading it.
    assert table_of(preview(world.engine, RULE, limit=3)) == table_of(first)[:3] + table_of(first)[4:7]
    assert snapshot(world.engine) == before
    assert world.target.requests == []


def test_a_rule_with_no_breaker_row_yet_gets_none_from_a_preview(world: World) -> None:
    """A chain's breaker inserts the target's breaker row; a preview only reads it."""
    world.load("a")
    before = snapshot(world.engine)
    assert before["breaker_states"] == []
    assert [row.action for row in preview(world.engine, RULE).rows] == [Action.CREATE]
    assert snapshot(world.engine) == before


def test_the_transaction_refuses_writes(world: World) -> None:
    """The snapshot a preview reads in is read-only in the database itself, not only by habit."""
    from delivery.store.preview import read_only_snapshot

    with read_only_snapshot(world.engine) as conn, pytest.raises(sa.exc.DBAPIError):
        conn.execute(ledger_table.delete())
    # The pooled connection writes again for its next user.
    world.load("after")
    with world.engine.begin() as conn:
        conn.execute(mirror_records_table.update().values(domain="contact"))


def test_a_connection_the_caller_holds_is_read_in_its_own_transaction(world: World) -> None:
    world.load("a")
    with world.engine.connect() as conn:
        result = preview(conn, RULE)
    assert [row.external_id for row in result.rows] == ["a"]


def test_the_cli_repeats_the_engine_limits() -> None:
    assert (cli_preview.DEFAULT_LIMIT, cli_preview.MAX_LIMIT) == (
        preview_module.DEFAULT_LIMIT,
        preview_module.MAX_LIMIT,
    )


# -- (c) the delivery-preview flow on the Prefect test harness ------------------------------------


def _run_flow(**parameters: Any) -> Any:
    async def run() -> Any:
        return await delivery_preview(**parameters, return_state=True)

    return asyncio.run(run())


def artifact(flow_run_id: str, key: str) -> tuple[list[dict[str, Any]], str]:
    """The table artifact `key` the run published: its rows and its description."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    async def read() -> list[Any]:
        async with get_client() as client:
            return list(
                await client.read_artifacts(
                    artifact_filter=ArtifactFilter(
                        key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run_id)])
                    )
                )
            )

    [found] = asyncio.run(read())
    data = found.data
    return (json.loads(data) if isinstance(data, str) else data), found.description or ""


def _flow_run(flow_run_id: str) -> Any:
    from prefect import get_client

    async def read() -> Any:
        async with get_client() as client:
            return await client.read_flow_run(UUID(flow_run_id))

    return asyncio.run(read())


def test_the_flow_publishes_the_preview_as_a_table_artifact(prefect_api: None, every_case: World) -> None:
    world = every_case
    before = snapshot(world.engine)
    state = _run_flow(rule=RULE, limit=50)
    assert state.is_completed(), state
    run_id = str(state.state_details.flow_run_id)
    assert state.message == "3 create, 2 update, 2 suppress, 4 skip (of 4 due retries, 7 changes)"

    table, description = artifact(run_id, artifact_key(RULE))
    assert [(r["phase"], r["external_id"], r["action"], r["reason"]) for r in table] == expected(world)
    assert {r["external_id"]: r["status"] for r in table}["flaky"] == "failed (in doubt)"
    assert {r["external_id"]: r["status"] for r in table}["new"] == "-"
    assert {r["external_id"]: r["attempts"] for r in table}["fail"] == 1
    assert "create: **3** · update: **2** · suppress: **2** · skip: **4**" in description
    assert "the chain would start now (target `crm`)" in description
    assert "cut off" not in description and "nothing was sent and nothing written" in description

    run = _flow_run(run_id)
    assert run.name == f"preview {RULE}"
    assert {f"rule:{RULE}", "target:crm"} <= set(run.tags)
    assert snapshot(world.engine) == before
    assert world.target.requests == []


def test_the_flow_says_when_it_cut_and_when_the_chain_would_not_start(prefect_api: None, every_case: World) -> None:
    _disable(every_case)
    state = _run_flow(rule=RULE, limit=2)
    assert state.is_completed(), state
    table, description = artifact(str(state.state_details.flow_run_id), artifact_key(RULE))
    assert [(r["phase"], r["external_id"]) for r in table] == [
        ("drain", "deleted-failed"),
        ("drain", "fail"),
        ("scan", "upd"),
        ("scan", "same"),
    ]
    assert "the chain would not start now (disabled): rule 'contacts-to-crm' is disabled" in description
    assert (
        "rows: the first 2 due retries, the first 2 changes; cut off at limit 2: more due retries and more"
        in description
    )
    assert "create: **1** · update: **1** · suppress: **2** · skip: **0**" in description
    assert state.message.startswith("the chain would not start now (disabled)")


def test_the_flow_with_nothing_to_do_says_so(prefect_api: None, world: World) -> None:
    state = _run_flow(rule=RULE)
    assert state.is_completed(), state
    table, _ = artifact(str(state.state_details.flow_run_id), artifact_key(RULE))
    assert [r["reason"] for r in table] == ["nothing to do: no retry is due and no change follows"]


def test_the_flow_fails_for_an_unknown_rule_or_a_limit_out_of_range(prefect_api: None, world: World) -> None:
    before = snapshot(world.engine)
    unknown = _run_flow(rule="nope")
    assert unknown.is_failed()
    assert unknown.message == "UnknownName: no rule named 'nope'" and unknown.name == "Failed"
    assert "fault:UnknownName" in _flow_run(str(unknown.state_details.flow_run_id)).tags
    for bad in (0, 10_001):
        refused = _run_flow(rule=RULE, limit=bad)
        assert refused.is_failed()
        assert "limit" in refused.message
    assert snapshot(world.engine) == before


def test_artifact_keys_use_the_characters_prefect_allows() -> None:
    assert artifact_key("Contacts_to CRM") == "preview-contacts-to-crm"
    assert artifact_key("___") == "preview-rule"
