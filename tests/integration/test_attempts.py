"""A record's history (issue 32, point 5), on SQLite and PostgreSQL against the real local target:
every request a record's step made is written with the settle it belongs to (time, chain run,
verb, method and path, status code or transport error, duration, the answer's start with secrets
masked, the outcome), read newest first, and pruned by the tick in bounded deletes."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from delivery import attempts, listings
from delivery.clock import utcnow
from delivery.store import attempts as attempts_store
from delivery.store.tables import attempts_table
from delivery.tick import PRUNE_ROWS, prune_attempts
from tests.integration.world import SHORT_TIMEOUT_SECONDS, World, email
from tests.support import chains
from tests.target_server import Answer, TargetServer

RULE = "contacts-to-crm"
SECRET = "s3cr3t-token-value"


def history(engine: sa.Engine, external_id: str, limit: int = 50) -> dict[str, Any]:
    with engine.connect() as conn:
        return listings.record_history(conn, RULE, external_id, limit)


def test_each_request_is_kept_with_its_outcome_newest_first(engine: sa.Engine, target: TargetServer) -> None:
    w = World(engine, target, through_prefect=False).apply()
    target.program(email("a"), Answer.status(503, {"error": "busy"}))
    w.load("a")
    w.run()
    w.make_due()
    w.run()
    w.load("a", note="changed")
    w.run()
    found = history(engine, "a")
    assert found["ledger"]["status"] == "delivered"
    tried = found["attempts"]
    assert [(a["verb"], a["method"], a["status_code"], a["outcome"]) for a in tried] == [
        ("update", "PATCH", 200, "delivered"),
        ("create", "POST", 201, "delivered"),
        ("create", "POST", 503, "failed"),
    ]
    remote = found["ledger"]["remote_id"]
    assert tried[0]["path"] == f"contacts/{remote}" and tried[2]["path"] == "contacts"
    assert tried[2]["answer_excerpt"] == '{"error": "busy"}' and tried[2]["error"] is None
    assert set(tried[0]) == set(attempts_store.FIELDS)
    assert all(a["duration_ms"] >= 0 and a["at"] <= utcnow() for a in tried)
    assert tried[0]["at"] >= tried[1]["at"] >= tried[2]["at"]
    assert history(engine, "a", limit=1)["attempts"] == tried[:1]


def test_a_transport_error_has_no_status_code_and_says_what_happened(engine: sa.Engine, target: TargetServer) -> None:
    w = World(engine, target, through_prefect=False).apply()
    w.set_timeout(SHORT_TIMEOUT_SECONDS)
    target.program(email("a"), Answer.given_up())
    w.load("a")
    w.run()
    (tried,) = history(engine, "a")["attempts"]
    assert tried["status_code"] is None and "timed out" in tried["error"] and tried["outcome"] == "failed"


def test_an_answer_echoing_the_token_is_kept_masked(engine: sa.Engine, target: TargetServer) -> None:
    w = World(engine, target, through_prefect=False).apply()
    target.program(email("a"), Answer.echo_headers(422))
    w.load("a")
    w.run()
    (tried,) = history(engine, "a")["attempts"]
    assert tried["status_code"] == 422 and tried["answer_excerpt"]
    assert SECRET not in tried["answer_excerpt"] and "***" in tried["answer_excerpt"]
    assert len(tried["answer_excerpt"]) <= 500


def test_a_batch_call_is_in_the_history_of_each_record_it_carried(engine: sa.Engine, target: TargetServer) -> None:
    w = World(engine, target, through_prefect=False).apply(
        target={"batch": {"create_path": "contacts/batch", "update_path": "contacts/batch"}}
    )
    w.load("a", "b")
    w.run()
    for external_id in ("a", "b"):
        (tried,) = history(engine, external_id)["attempts"]
        assert (tried["method"], tried["path"], tried["status_code"], tried["outcome"]) == (
            "POST",
            "contacts/batch",
            200,
            "delivered",
        )


def test_a_batch_call_is_told_to_the_observers_once(engine: sa.Engine, target: TargetServer) -> None:
    """The metrics time requests (`delivery_request_seconds`): one call carrying three records is
    one request, though each record's history shows it."""
    w = World(engine, target, through_prefect=False).apply(
        target={"batch": {"create_path": "contacts/batch", "update_path": "contacts/batch"}}
    )
    told: list[tuple[str, str, str]] = []
    stop = attempts.observe(lambda name, attempt: told.append((name, attempt.verb, attempt.path)))
    try:
        w.load("a", "b", "c")
        w.run()
    finally:
        stop()
    assert told == [("crm", "create", "contacts/batch")]
    assert all(len(history(engine, i)["attempts"]) == 1 for i in ("a", "b", "c"))


def test_the_chain_run_is_named(engine: sa.Engine, target: TargetServer) -> None:
    World(engine, target, through_prefect=False).apply().load("a")
    chains.run(engine, RULE, flow_run_id="run-1234")
    (tried,) = history(engine, "a")["attempts"]
    assert tried["chain_run_id"] == "run-1234"


def _attempt_row(at: Any) -> dict[str, Any]:
    """A request of record 1 made at `at`, as its row is written."""
    return {
        "rule_id": 1,
        "record_id": 1,
        "at": at,
        "verb": "create",
        "method": "POST",
        "path": "contacts",
        "duration_ms": 1,
        "outcome": "failed",
    }


def test_the_tick_prunes_what_is_older_than_the_keep_days_in_bounded_deletes(
    engine: sa.Engine, target: TargetServer
) -> None:
    """The requests older than the keep days go, in deletes of at most PRUNE_ROWS, wherever their
    rows stand; a younger row among them (a request still in flight when they settled) stays."""
    now = utcnow()
    old = [_attempt_row(now - timedelta(days=20, seconds=PRUNE_ROWS + 5 - i)) for i in range(PRUNE_ROWS + 5)]
    old.insert(PRUNE_ROWS // 2, _attempt_row(now - timedelta(days=13)))  # younger than the keep days
    w = World(engine, target, through_prefect=False).apply()
    with engine.begin() as conn:
        conn.execute(attempts_table.insert(), old)
    w.load("a")
    w.run()  # and the recent request of record a
    assert prune_attempts(engine, now, keep_days=14) == PRUNE_ROWS + 5
    with engine.connect() as conn:
        left = conn.execute(sa.select(attempts_table.c.at).order_by(attempts_table.c.id)).scalars().all()
    assert len(left) == 2 and all(at > now - timedelta(days=14) for at in left)
    assert prune_attempts(engine, now, keep_days=14) == 0


def test_the_delivery_record_flow_publishes_the_row_and_its_requests(
    prefect_api: None, engine: sa.Engine, target: TargetServer
) -> None:
    import asyncio
    import json

    from flows.record import artifact_key, delivery_record
    from tests.integration.runs import run_artifacts

    w = World(engine, target, through_prefect=False).apply()
    target.program(email("c-42"), Answer.status(503, {"error": "busy"}))
    w.load("c-42")
    w.run()

    async def run(**parameters: Any) -> Any:
        return await delivery_record(**parameters, return_state=True)

    state = asyncio.run(run(rule=RULE, record_id="c-42"))
    assert state.is_completed(), state
    found = run_artifacts(str(state.state_details.flow_run_id))[artifact_key(RULE, "c-42")]
    rows = json.loads(found.data) if isinstance(found.data, str) else found.data
    assert [(r["verb"], r["request"], r["answer"], r["outcome"]) for r in rows] == [
        ("create", "POST contacts", 503, "failed")
    ]
    assert "**contacts-to-crm** / **c-42**: `failed`" in found.description
    refused = asyncio.run(run(rule=RULE, record_id="nobody"))
    assert refused.is_failed() and "no such 'contact' record" in refused.message


def test_one_row_is_written_as_the_core_insert_writes_several(engine: sa.Engine) -> None:
    """A settle's single attempt goes to the driver through `exec_driver_sql` (the per_record
    fast path); a group's go through SQLAlchemy's executemany. Both store the same values: a
    moment with its microseconds, NULLs, text no codec should bend, a NUL kept as the history keeps it."""
    from types import SimpleNamespace

    from delivery.domain import Attempt, LedgerStatus

    at = utcnow().replace(microsecond=123456)
    whole_second = at.replace(microsecond=0)  # a moment the text form must still write in full
    tried = Attempt(
        at=at,
        verb="create",
        method="POST",
        path="contacts/Łódź-ü",
        status_code=None,
        error="timed out\x00 after 0.5 s",
        duration_ms=512,
        answer_excerpt=None,
        chain_run_id="6f19e22d-725c-4a95-8084-e59521616211",
    )
    for rule_id, moment in ((7, at), (8, whole_second)):
        outcome = SimpleNamespace(status=LedgerStatus.FAILED, tried=[dataclasses.replace(tried, at=moment)])

        def settled(record_id: int, outcome: Any = outcome) -> Any:
            return (SimpleNamespace(record=SimpleNamespace(id=record_id)), outcome)

        with engine.begin() as conn:
            attempts_store.write(conn, rule_id, [settled(1)])  # one row: the driver's path
            attempts_store.write(conn, rule_id, [settled(2), settled(3)])  # the executemany
        with engine.connect() as conn:
            alone, *grouped = (attempts_store.of_record(conn, rule_id, record_id, 5) for record_id in (1, 2, 3))
            # As stored, not as read back: SQLite keeps a moment as fixed-width text, compared as text.
            stored = conn.execute(sa.text(f"SELECT DISTINCT at FROM delivery_attempts WHERE rule_id = {rule_id}")).all()
        assert alone == grouped[0] == grouped[1]
        assert len(stored) == 1, stored
    (row,) = alone  # the whole second's
    assert row["at"] == whole_second and row["error"] == "timed out\ufffd after 0.5 s" and row["status_code"] is None
    assert (row["path"], row["outcome"], row["answer_excerpt"]) == ("contacts/Łódź-ü", "failed", None)


def test_a_settle_whose_row_moved_writes_no_request_and_one_whose_row_stood_writes_it(
    engine: sa.Engine, target: TargetServer
) -> None:
    """A settle writes the row and its one request together (on PostgreSQL in one statement): a
    requeue that moved the row first keeps it, and the request of the settle it beat is not kept."""
    from delivery.domain import Attempt, Candidate, LedgerStatus, Outcome
    from delivery.store import catalog, ledger

    w = World(engine, target, through_prefect=False).apply()
    w.load("a")
    w.run()
    w.load("a", note="changed")
    with engine.connect() as conn:
        rule = catalog.get_rule(conn, RULE)
        (candidate,) = ledger.scan_page(conn, rule, None, 10)
    assert candidate.ledger is not None
    tried = Attempt(
        at=(utcnow() + timedelta(seconds=1)).replace(microsecond=0),  # after the create; a whole second
        verb="update",
        method="PATCH",
        path="contacts/Łódź",
        status_code=200,
        error=None,
        duration_ms=7,
        answer_excerpt='{"ok": "\x00"}',
        chain_run_id="run-9",
    )
    outcome = Outcome(LedgerStatus.DELIVERED, remote_id=candidate.ledger.remote_id, tried=(tried,))
    # The one statement writes every column a settle writes.
    assert set(ledger._settled_values(candidate, outcome, utcnow())) == set(ledger._SETTLED_COLUMNS)
    moved = Candidate(candidate.record, dataclasses.replace(candidate.ledger, version=candidate.ledger.version - 1))
    with engine.begin() as conn:
        assert ledger.settle(conn, rule, moved, outcome, utcnow()) is False
    assert [a["verb"] for a in history(engine, "a")["attempts"]] == ["create"]
    with engine.begin() as conn:
        assert ledger.settle(conn, rule, candidate, outcome, utcnow()) is True
    newest, _ = history(engine, "a")["attempts"]
    assert newest == {
        "at": tried.at,
        "chain_run_id": "run-9",
        "verb": "update",
        "method": "PATCH",
        "path": "contacts/Łódź",
        "status_code": 200,
        "error": None,
        "duration_ms": 7,
        "answer_excerpt": '{"ok": "\ufffd"}',
        "outcome": "delivered",
    }
    assert w.ledger()["a"]["status"] == "delivered"


def test_a_long_token_echoed_where_the_excerpt_is_cut_leaves_nothing_of_itself(
    engine: sa.Engine, target: TargetServer, monkeypatch: Any
) -> None:
    """An answer holds a 6,000-character token beginning before the cut: the history's excerpt
    (500 characters) and the row's error (200) hold none of it, masked before the cut."""
    token = "eyJ" + "t0k" * 2_000
    monkeypatch.setenv("CRM_TOKEN", token)
    target.token = token
    w = World(engine, target, through_prefect=False).apply()
    target.program(email("a"), Answer.echo_headers(422))
    target.program(email("b"), Answer.status(422, {"error": f"the token {token} may not write here"}))
    w.load("a", "b")
    w.run()
    (tried,) = history(engine, "a")["attempts"]
    assert "t0kt0k" not in tried["answer_excerpt"] and "Bearer ***" in tried["answer_excerpt"]
    refused = history(engine, "b")["ledger"]["last_error"]  # cut at 200 characters, the token's start inside
    assert "t0kt0k" not in refused and "the token *** may not write here" in refused, refused
