"""The delivery chain on SQLite and PostgreSQL against a real local HTTP target: every row of the
design's two fault tables, drain before scan, the cursor. The engine's behaviour is driven without
Prefect; what the `deliver-rule` flow adds (its run's states and record, its logs, the batch
timeout) runs through the real flow, in the tests marked `through_prefect`."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import sqlalchemy as sa

from delivery.clock import utcnow
from delivery.store.tables import chains_table, connections_table
from tests.integration.world import REQUEST_TIMEOUT_SECONDS, RULE, World
from tests.support.faults import scan_then_race
from tests.target_server import Answer, TargetServer


def posts(target: TargetServer) -> list[str]:
    return [r.key for r in target.requests if r.method == "POST"]


# -- success, suppression, re-offering --------------------------------------------------------


@pytest.mark.through_prefect
def test_creates_then_updates_by_remote_id_and_a_caught_up_rule_sends_nothing(world: World) -> None:
    world.load("a", "b")
    result = world.run()
    assert result["state"] == "COMPLETED" and result["ended_by"] == "caught_up"
    assert result["counts"]["delivered"] == 2 and result["scanned"]["delivered"] == 2
    rows = world.ledger()
    assert {rows["a"]["status"], rows["b"]["status"]} == {"delivered"}
    assert rows["a"]["remote_id"] and rows["a"]["attempts"] == 0
    stored = world.target.records("contacts")
    assert stored[rows["a"]["remote_id"]]["email"] == "a@example.com"
    first_post = world.target.requests[0]
    assert first_post.headers["idempotency-key"] and first_post.headers["authorization"].startswith("Bearer ")

    sent = len(world.target.requests)
    again = world.run()
    assert again["counts"]["delivered"] == 0 and len(world.target.requests) == sent

    world.load("a", name="Renamed")
    third = world.run()
    assert third["scanned"]["delivered"] == 1
    patch = world.target.requests[-1]
    assert patch.method == "PATCH" and patch.path.endswith(f"/contacts/{rows['a']['remote_id']}")
    assert stored != world.target.records("contacts")
    assert world.target.records("contacts")[rows["a"]["remote_id"]]["name"] == "Renamed"


def test_identical_mapped_payload_is_suppressed_without_calling_the_target(world: World) -> None:
    world.apply(rule={"fields": {"email": "email", "full_name": "name"}})
    world.load("a", note="one")
    world.run()
    sent = len(world.target.requests)
    world.load("a", note="two")  # the change is in a field the rule does not map
    result = world.run()
    assert result["scanned"]["suppressed"] == 1
    assert len(world.target.requests) == sent
    row = world.ledger()["a"]
    assert row["status"] == "suppressed" and row["remote_id"]
    # A suppressed row is offered again when its record's change signal moves.
    world.load("a", note="three", name="New name")
    assert world.run()["scanned"]["delivered"] == 1
    assert world.target.requests[-1].method == "PATCH"


def test_policy_that_excludes_the_verb_suppresses(world: World) -> None:
    world.apply(rule={"policy": "update_only"})
    world.load("new")
    result = world.run()
    assert result["scanned"]["suppressed"] == 1 and world.target.requests == []
    assert "excludes create" in world.ledger()["new"]["last_error"]

    world.apply(rule={"policy": "create_only"})
    world.load("x")
    world.run()
    world.load("x", name="changed")
    result = world.run()
    assert result["scanned"]["suppressed"] == 1
    assert [r.method for r in world.target.requests] == ["POST"]


# -- record faults ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "expected_error"),
    [
        (Answer.timeout(1.5), "timed out"),
        (Answer.status(503), "HTTP 503"),
        (Answer.status(422, body={"error": "email is invalid"}), "HTTP 422"),
        (Answer.drop(), "POST contacts"),
    ],
    ids=["timeout", "5xx", "rejected-field", "connection-error"],
)
def test_transient_and_rejected_writes_park_the_record_as_failed_and_the_job_carries_on(
    world: World, answer: Answer, expected_error: str
) -> None:
    world.load("bad", "good")
    world.target.program(world.key("bad"), answer)
    if answer.kind == "timeout":
        world.set_timeout()
    before = utcnow()
    result = world.run()
    assert result["state"] == "COMPLETED"
    rows = world.ledger()
    assert rows["good"]["status"] == "delivered"
    bad = rows["bad"]
    assert bad["status"] == "failed" and bad["attempts"] == 1
    assert expected_error in bad["last_error"]
    assert before + timedelta(seconds=60) <= bad["next_attempt_at"] <= utcnow() + timedelta(seconds=60)
    assert world.cursor() is not None and world.cursor().record_id == world.record_id("good")


def test_rejected_field_error_carries_status_and_body_excerpt(world: World) -> None:
    world.load("bad")
    world.target.program(world.key("bad"), Answer.status(422, body={"error": "email is invalid"}))
    world.run()
    assert world.ledger()["bad"]["last_error"].startswith("POST contacts: HTTP 422: ")
    assert "email is invalid" in world.ledger()["bad"]["last_error"]


def test_429_honours_retry_after_up_to_the_connections_cap(world: World) -> None:
    # A pause longer than the job can wait: the record waits for its end, spending no attempt.
    world.apply(target={"max_pause_seconds": 7200})
    world.load("slow")
    world.target.program(world.key("slow"), Answer.status(429, headers={"Retry-After": "7200"}))
    world.run()
    row = world.full_ledger_row("slow")
    assert row["status"] == "failed" and row["attempts"] == 0
    assert row["next_attempt_at"] >= utcnow() + timedelta(seconds=7100)


def test_a_retry_after_beyond_the_cap_pauses_for_the_cap(world: World) -> None:
    world.load("slow")
    world.target.program(world.key("slow"), Answer.status(503, headers={"Retry-After": "7200"}))
    world.run()
    row = world.full_ledger_row("slow")
    assert row["status"] == "failed" and row["attempts"] == 0
    assert utcnow() + timedelta(seconds=800) <= row["next_attempt_at"] <= utcnow() + timedelta(seconds=900)


@pytest.mark.parametrize("code", [404, 410])
def test_update_answered_gone_parks_remote_gone(world: World, code: int) -> None:
    world.load("a")
    world.run()
    remote_id = world.ledger()["a"]["remote_id"]
    world.load("a", name="changed")
    world.target.program_remote(remote_id, Answer.status(code))
    result = world.run()
    assert result["scanned"]["remote_gone"] == 1
    row = world.full_ledger_row("a")
    assert row["status"] == "remote_gone" and row["next_attempt_at"] is None
    assert f"HTTP {code}" in row["last_error"]


@pytest.mark.parametrize("answer", [Answer.no_id(), Answer.not_json()], ids=["no-id", "not-json"])
def test_unaddressable_create_is_exhausted_at_once(world: World, answer: Answer) -> None:
    world.load("a")
    world.target.program(world.key("a"), answer)
    result = world.run()
    assert result["scanned"]["exhausted"] == 1
    row = world.full_ledger_row("a")
    assert row["status"] == "exhausted" and row["next_attempt_at"] is None and row["remote_id"] is None
    # Never offered again, even when the record changes: a retry would make a second copy.
    world.load("a", name="changed")
    world.make_due()
    world.run()
    assert world.target.count(world.key("a")) == 1


#: 2xx answers to a create whose id addresses nothing, or that one database would store and the
#: other refuse. Before: a lone surrogate, or (on PostgreSQL) a NUL or an id over 500 characters,
#: failed the chain at the settle, on every tick, with the create sent again each time; on SQLite
#: the NUL and the long id, and on both NaN/Infinity (as "nan"/"inf") and a blank id, were stored
#: as the record's remote id.
UNUSABLE_IDS = {
    "lone-surrogate": b'{"id": "\\ud800"}',
    "nul": b'{"id": "a\\u0000b"}',
    "too-long": json.dumps({"id": "x" * 501}).encode(),
    "infinity": b'{"id": 1e400}',
    "nan": b'{"id": NaN}',
    "blank": b'{"id": "  "}',
    "float": b'{"id": 1.5}',
}


@pytest.mark.parametrize("body", UNUSABLE_IDS.values(), ids=UNUSABLE_IDS.keys())
def test_a_create_answered_with_an_unusable_id_is_exhausted_and_the_rule_carries_on(world: World, body: bytes) -> None:
    world.load("a", "b")
    world.target.program(world.key("a"), Answer.raw(201, body))
    result = world.run()
    assert result["state"] == "COMPLETED", result
    row = world.full_ledger_row("a")
    assert row["status"] == "exhausted" and row["remote_id"] is None, row
    assert "answer has no usable 'id' (it " in row["last_error"], row["last_error"]
    assert world.ledger()["b"]["status"] == "delivered"


def test_an_error_body_holding_a_nul_is_kept_in_last_error_on_both_databases(world: World) -> None:
    """Before: PostgreSQL refused the settle (a NUL in text), which failed the chain on every tick."""
    world.load("a", "b")
    world.target.program(world.key("a"), Answer.raw(422, b"bad\x00field", "text/plain"))
    result = world.run()
    assert result["state"] == "COMPLETED", result
    row = world.full_ledger_row("a")
    assert row["status"] == "failed" and "bad\ufffdfield" in row["last_error"], row
    assert world.ledger()["b"]["status"] == "delivered"


def test_the_failure_that_reaches_max_attempts_exhausts(world: World) -> None:
    world.load("a")
    # Refusals, not outages: a failure that trips the breaker never spends the last attempt.
    world.target.program(world.key("a"), Answer.status(422), Answer.status(422), Answer.status(422))
    world.run()
    world.make_due()
    assert world.run()["drained"]["failed"] == 1
    assert world.ledger()["a"]["attempts"] == 2
    world.make_due()
    result = world.run()
    assert result["drained"]["exhausted"] == 1
    row = world.ledger()["a"]
    assert row["status"] == "exhausted" and row["attempts"] == 3 and row["next_attempt_at"] is None
    assert "gave up after 3 attempts" in row["last_error"]


def test_a_retried_create_carries_the_same_idempotency_key(world: World) -> None:
    world.load("a")
    # The target creates the record but answers too late; the retry must not make a second copy.
    world.target.program(world.key("a"), Answer.timeout(1.5))
    world.set_timeout()
    world.run()
    assert world.ledger()["a"]["status"] == "failed"
    world.set_timeout(REQUEST_TIMEOUT_SECONDS)
    world.make_due()
    world.run()
    keys = [r.headers["idempotency-key"] for r in world.target.requests if r.method == "POST"]
    assert len(keys) == 2 and keys[0] == keys[1]
    assert world.ledger()["a"]["status"] == "delivered"
    assert len(world.target.records("contacts")) == 1


def test_success_after_failure_resets_attempts_and_clears_the_error(world: World) -> None:
    world.load("a")
    world.target.program(world.key("a"), Answer.status(500))
    world.run()
    world.make_due()
    result = world.run()
    assert result["drained"]["delivered"] == 1
    row = world.ledger()["a"]
    assert row["attempts"] == 0 and row["last_error"] is None and row["next_attempt_at"] is None


# -- drain before scan, terminal rows ---------------------------------------------------------


def test_drain_comes_before_scan(world: World) -> None:
    world.load("retry-me")
    world.target.program(world.key("retry-me"), Answer.status(500))
    world.run()
    world.make_due()
    world.load("fresh-1", "fresh-2")
    world.target.requests.clear()
    result = world.run()
    assert [r.key for r in world.target.requests] == [world.key("retry-me"), world.key("fresh-1"), world.key("fresh-2")]
    assert result["drained"]["delivered"] == 1 and result["scanned"]["delivered"] == 2


def test_failed_rows_not_yet_due_wait_and_belong_to_the_drain(world: World) -> None:
    world.load("a")
    world.target.program(world.key("a"), Answer.status(500))
    world.run()
    world.load("a", name="changed while failed")  # the scan must leave it to the drain
    result = world.run()
    assert result["counts"] == {s: 0 for s in result["counts"]}
    assert world.target.count(world.key("a")) == 1


def test_terminal_rows_stay_parked_when_their_record_changes(world: World) -> None:
    world.load("gone", "dead")
    world.target.program(world.key("dead"), Answer.no_id())
    world.run()
    gone_remote = world.ledger()["gone"]["remote_id"]
    world.target.program_remote(gone_remote, Answer.status(404))
    world.load("gone", name="v2")
    world.run()
    assert world.ledger()["dead"]["status"] == "exhausted"
    world.target.requests.clear()
    world.load("gone", name="v3")
    world.load("dead", name="v3")
    world.make_due()
    result = world.run()
    assert world.target.requests == [] and result["counts"] == {s: 0 for s in result["counts"]}
    assert world.ledger()["gone"]["status"] == "remote_gone"


def test_deleted_records_are_not_scanned(world: World) -> None:
    world.load("a", deleted=True)
    world.load("b")
    assert world.run()["scanned"]["delivered"] == 1
    assert "a" not in world.ledger()


def test_scan_pages_through_batches_and_the_cursor_lands_on_the_last_record(world: World) -> None:
    ids = [f"r{n:02d}" for n in range(25)]
    world.load(*ids)
    result = world.run()
    assert result["scanned"]["delivered"] == 25
    assert result["cursor_before"] is None
    assert result["cursor_after"]["record_id"] == world.record_id("r24")
    assert world.cursor().record_id == world.record_id("r24")
    assert sorted(posts(world.target)) == sorted(world.key(i) for i in ids)


# -- rule faults that return: route closed, breaker open --------------------------------------


@pytest.mark.through_prefect
@pytest.mark.parametrize(("connection", "status"), [("shop", "disabled"), ("crm", "error")])
def test_closed_route_completes_writes_nothing_and_names_the_connection(
    world: World, connection: str, status: str
) -> None:
    world.load("a")
    with world.engine.begin() as conn:
        conn.execute(connections_table.update().where(connections_table.c.name == connection).values(status=status))
    result = world.run()
    assert result["state"] == "COMPLETED" and result["ended_by"] == "route_closed"
    assert connection in result["message"] and status in result["message"]
    assert world.ledger() == {} and world.target.requests == [] and world.cursor() is None


@pytest.mark.through_prefect
def test_open_breaker_ends_the_chain_completed_and_leaves_the_connection_alone(world: World) -> None:
    world.load(*[f"r{n}" for n in range(6)])
    world.target.down = True
    result = world.run()
    assert result["state"] == "COMPLETED" and result["ended_by"] == "breaker_open"
    assert "breaker open" in result["message"] and "crm" in result["message"]
    # fail_max 3: three records failed (the third tripped it), the rest were not attempted.
    assert result["scanned"]["failed"] == 3 and len(world.ledger()) == 3
    assert world.cursor().record_id == world.record_id("r2")  # moved past the attempted ones only
    with world.engine.connect() as conn:
        assert (
            conn.execute(sa.select(connections_table.c.status).where(connections_table.c.name == "crm")).scalar()
            == "active"
        )
    sent = len(world.target.requests)
    again = world.run()  # the breaker is still open: the chain ends before the drain
    assert again["ended_by"] == "breaker_open" and len(world.target.requests) == sent


def test_breaker_ignores_record_rejections(world: World) -> None:
    world.load(*[f"r{n}" for n in range(5)])
    for n in range(5):
        world.target.program(world.key(f"r{n}"), Answer.status(422))
    result = world.run()
    assert result["ended_by"] == "caught_up" and result["scanned"]["failed"] == 5


# -- rule faults that raise --------------------------------------------------------------------


@pytest.mark.through_prefect
def test_missing_writer_fails_the_chain_and_writes_nothing(world: World) -> None:
    world.load("a")
    world.set_driver("soap")
    result = world.run()
    assert result["state"] == "FAILED" and result["ended_by"] == "rule_fault"
    assert "MissingWriter" in result["message"] and "soap" in result["message"] and RULE in result["message"]
    assert world.ledger() == {} and world.target.requests == []
    # The summary of a failed chain, as tests/support/chains.run builds it from the chain's report.
    with world.engine.connect() as conn:
        report = conn.execute(sa.select(chains_table.c.report)).scalar_one()
    assert {key: value for key, value in result.items() if key != "flow_run_id"} == {
        "rule": RULE,
        "state": "FAILED",
        **report,
    }


def test_writer_without_the_needed_verb_fails_the_chain_and_leaves_the_cursor(world: World) -> None:
    world.load("a", "b")
    world.run()
    cursor = world.cursor()
    world.set_driver("rest-create-only")  # changed after the rule was saved: updates are now impossible
    world.load("c")
    world.load("a", name="needs an update")
    result = world.run()
    assert result["state"] == "FAILED" and "UnsupportedDeliveryVerb" in result["message"]
    assert "'update'" in result["message"] and "rest-create-only" in result["message"]
    assert world.ledger()["a"]["status"] == "delivered"  # nothing parked for a fault of the rule
    assert world.cursor() == cursor  # the batch raised: the cursor did not move


def test_ledger_row_where_the_scan_saw_none_fails_the_chain(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    from delivery.store import ledger

    world.load("a")
    # Another writer settles the record behind the scan's back.
    monkeypatch.setattr(ledger, "scan_page", scan_then_race(ledger.scan_page))
    result = world.run()
    assert result["state"] == "FAILED" and "LedgerRowConflict" in result["message"] and "'a'" in result["message"]
    assert world.cursor() is None


def test_candidate_the_scan_should_never_return_fails_the_chain(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    from delivery.store import ledger

    world.load("a")
    world.load("other", domain="company")
    real_scan = ledger.scan_page

    def leaky_scan(conn: sa.Connection, rule, after, limit):  # type: ignore[no-untyped-def]
        import dataclasses

        from delivery.domain import Candidate

        page = real_scan(conn, rule, after, limit)
        return [Candidate(dataclasses.replace(page[0].record, domain="company", external_id="other"), None)]

    monkeypatch.setattr(ledger, "scan_page", leaky_scan)
    result = world.run()
    assert result["state"] == "FAILED" and "UnexpectedCandidate" in result["message"]
    assert "other source or domain" in result["message"]
    assert world.ledger() == {} and world.target.requests == []


# -- secrets -------------------------------------------------------------------------------------


@pytest.mark.through_prefect
def test_the_token_never_reaches_ledger_errors_reports_or_logs(world: World, caplog: pytest.LogCaptureFixture) -> None:
    world.load("a")
    world.target.program(world.key("a"), Answer.echo_headers(422))
    with caplog.at_level("DEBUG"):
        result = world.run()
    token = "s3cr3t-token-value"
    row = world.ledger()["a"]
    assert row["status"] == "failed" and "authori" in row["last_error"]  # the echo did reach the excerpt
    assert token not in row["last_error"]
    assert token not in str(result)
    assert token not in caplog.text
    with world.engine.connect() as conn:
        dump = " ".join(str(r) for t in ("ledger", "chains") for r in conn.execute(sa.text(f"SELECT * FROM {t}")))
    assert token not in dump


@pytest.mark.through_prefect
def test_missing_token_variable_fails_the_chain(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    world.load("a")
    monkeypatch.delenv("CRM_TOKEN")
    result = world.run()
    assert result["state"] == "FAILED" and "CRM_TOKEN" in result["message"]
    assert world.ledger() == {}


@pytest.mark.through_prefect
def test_chain_is_recorded_with_its_flow_run(world: World) -> None:
    world.load("a")
    result = world.run()
    with world.engine.connect() as conn:
        row = conn.execute(sa.select(chains_table)).one()._asdict()
    assert row["flow_run_id"] == result["flow_run_id"] and row["ended_by"] == "caught_up"
    assert isinstance(row["report"], dict) and row["report"]["counts"]["delivered"] == 1
    assert world.rule_row()["chain_token"] == row["token"]
    # What the tests that run chains without Prefect get (tests/support/chains.run) is this summary.
    summary = {key: value for key, value in result.items() if key != "flow_run_id"}
    assert summary == {"rule": RULE, "state": "COMPLETED", **row["report"]}


@pytest.mark.through_prefect
def test_a_batch_that_overruns_its_timeout_fails_the_chain(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELIVERY_BATCH_TIMEOUT_SECONDS", "1")
    world.load(*[f"r{n}" for n in range(6)])
    world.target.latency_ms = 300
    result = world.run()
    assert result["state"] == "FAILED" and result["ended_by"] == "rule_fault"
    assert world.cursor() is None  # the batch did not conclude
