"""ADR-0029 at its edges: a job that ends stops its workers, a chain ended before its first job
writes nothing, the gate at every job, a ledger conflict found before any request, requeue and
settle racing, and a create replayed under its key after the body changed."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest
import sqlalchemy as sa

from delivery.chain import Chain
from delivery.clock import utcnow
from delivery.domain import Candidate, ChainEnd, ConnectionStatus, LedgerStatus, Phase
from delivery.errors import LedgerRowConflict
from delivery.store import catalog, chains, ledger, requeue
from delivery.store.tables import breaker_states_table, ledger_table, mirror_records_table
from delivery.writers.base import Creates, Updates, Writer
from delivery.writers.registry import register_writer, reset_registry
from tests.integration.world import REQUEST_TIMEOUT_SECONDS, RULE, World
from tests.support.threads import engine_threads
from tests.target_server import Answer, TargetServer


def _ledger_snapshot(world: World) -> list[tuple[Any, ...]]:
    with world.engine.connect() as conn:
        return [tuple(row) for row in conn.execute(sa.select(ledger_table).order_by(ledger_table.c.id))]


# -- a job that ends stops its workers (point 3) ---------------------------------------------------


def test_a_batch_timeout_stops_every_worker_before_the_job_ends(
    prefect_api: None, engine: sa.Engine, target: TargetServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    world = World(engine, target).apply(rule={"concurrency": 8, "batch_size": 200}, target={"timeout_seconds": 10})
    world.load(*[f"r{n:03d}" for n in range(120)])
    world.target.latency_ms = 400  # eight calls at a time, 0.4 s each: 120 records take ~6 s
    # The timeout must strike while calls are in flight. On a loaded machine the job can spend the
    # first 1.5 s before its first call (the rule lock, the page): then nothing was sent, the
    # records are all still there, and the chain runs again with a longer one.
    for timeout in ("1.5", "3", "4.5"):
        monkeypatch.setenv("DELIVERY_BATCH_TIMEOUT_SECONDS", timeout)
        result = world.run()
        assert result["state"] == "FAILED", result
        if world.target.requests:
            break
    # The job has ended: what reached the target and the ledger by now is all there will be.
    requests_at_end = len(world.target.requests)
    ledger_at_end = _ledger_snapshot(world)
    assert 0 < requests_at_end < 120
    # The job ended with none of its workers left: not one of them sends after it.
    assert engine_threads() == []
    assert len(world.target.requests) == requests_at_end
    assert _ledger_snapshot(world) == ledger_at_end


# -- a chain ended before its first job (point 4) --------------------------------------------------


def test_a_chain_superseded_before_its_first_job_claims_nothing_and_writes_nothing(world: World) -> None:
    world.load("c-1", "c-2")
    chain = Chain(world.engine, RULE)
    assert chain.open() is None
    with world.engine.begin() as conn:  # the tick judged it dead while it waited for a worker
        chains.supersede(conn, chain.rule.id, chain.token, utcnow(), "judged dead")
    report = chain.run_batch(Phase.DRAIN)
    assert report.ended_by is ChainEnd.SUPERSEDED
    report = chain.run_batch(Phase.SCAN)
    assert report.ended_by is ChainEnd.SUPERSEDED
    assert world.target.requests == []
    assert world.ledger() == {}
    assert world.rule_row()["chain_token"] is None
    assert world.cursor() is None


# -- the gate at every job (point 6) -----------------------------------------------------------------


@pytest.mark.parametrize(("role", "status"), [("target", "error"), ("source", "disabled")])
def test_a_connection_closed_mid_chain_ends_the_chain_at_its_next_job(world: World, role: str, status: str) -> None:
    world.apply(rule={"batch_size": 2})
    world.load("c-1", "c-2", "c-3", "c-4")
    chain = Chain(world.engine, RULE)
    assert chain.open() is None
    first = chain.run_batch(Phase.SCAN)
    assert first.attempted == 2 and first.ended_by is None
    with world.engine.begin() as conn:
        catalog.set_connection_status(conn, "crm" if role == "target" else "shop", ConnectionStatus(status))
    second = chain.run_batch(Phase.SCAN)
    report = chain.finish()
    assert second.ended_by is ChainEnd.ROUTE_CLOSED and second.attempted == 0
    assert report.ended_by is ChainEnd.ROUTE_CLOSED
    assert f"{role} connection" in report.message and status in report.message
    assert len(world.target.requests) == 2 and set(world.ledger()) == {"c-1", "c-2"}


def test_a_rule_disabled_mid_chain_ends_the_chain_at_its_next_job(world: World) -> None:
    world.apply(rule={"batch_size": 1})
    world.load("c-1", "c-2")
    chain = Chain(world.engine, RULE)
    assert chain.open() is None
    assert chain.run_batch(Phase.SCAN).attempted == 1
    world.apply(rule={"batch_size": 1, "enabled": False})
    assert chain.run_batch(Phase.SCAN).ended_by is ChainEnd.DISABLED
    assert set(world.ledger()) == {"c-1"}


# -- a ledger conflict is found before any request (point 7) ---------------------------------------


def test_a_ledger_row_the_scan_did_not_see_fails_the_chain_before_the_create_goes_out(world: World) -> None:
    world.load("c-1")
    chain = Chain(world.engine, RULE)
    assert chain.open() is None
    real_check = chain.step.check

    def check(candidate: Candidate, phase: Phase) -> None:
        # Between the page read and the write, a row appears that the scan said was not there.
        with world.engine.begin() as conn:
            now = utcnow()
            conn.execute(
                ledger_table.insert().values(
                    rule_id=chain.rule.id,
                    record_id=candidate.record.id,
                    status="delivered",
                    remote_id="r-elsewhere",
                    attempts=0,
                    create_generation=0,
                    created_at=now,
                    updated_at=now,
                )
            )
        real_check(candidate, phase)

    chain.step.check = check  # type: ignore[method-assign]
    with pytest.raises(LedgerRowConflict, match="c-1"):
        chain.run_batch(Phase.SCAN)
    chain.finish(LedgerRowConflict(RULE, "c-1"))
    assert world.target.requests == []


# -- requeue and settle racing (point 8) -----------------------------------------------------------


def _failed_create(world: World, external_id: str) -> None:
    """A record whose first create failed: a failed row the drain will offer."""
    world.load(external_id)
    world.target.program(world.key(external_id), Answer.status(503))
    assert world.run()["scanned"]["failed"] == 1
    world.make_due()


def test_a_requeue_during_the_send_stands_and_the_settle_writes_nothing(world: World) -> None:
    _failed_create(world, "c-1")
    world.target.program(world.key("c-1"), Answer.timeout(0.3))  # slow, then created
    chain = Chain(world.engine, RULE)
    assert chain.open() is None
    requeued: list[list[dict[str, Any]]] = []

    def requeue_while_in_flight() -> None:
        deadline = time.monotonic() + 10
        while world.target.count(world.key("c-1")) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        with world.engine.begin() as conn:
            rule = catalog.get_rule(conn, RULE)
            selection = requeue.Selection(statuses=(LedgerStatus.FAILED,))
            requeued.append(requeue.requeue(conn, rule, selection, "ops", utcnow()))
        requeued_at.append(world.target.pending(world.key("c-1")))

    requeued_at: list[int] = []
    racer = threading.Thread(target=requeue_while_in_flight)
    racer.start()
    report = chain.run_batch(Phase.DRAIN)
    racer.join()
    chain.finish()
    # The requeue committed while the create was still in flight (the overlap happened) ...
    assert len(requeued) == 1 and [r["external_id"] for r in requeued[0]] == ["c-1"]
    row = world.full_ledger_row("c-1")
    # ... and the settle that came after found the row moved on: the requeue's write stands.
    assert row["status"] == "failed" and row["last_error"].startswith("requeued by ops")
    assert report.attempted == 0
    # The next chain sends the create again under the same key: one copy in the target.
    world.make_due()
    world.run()
    assert world.ledger()["c-1"]["status"] == "delivered"
    assert len(world.target.records("contacts")) == 1


def test_a_requeue_of_a_row_settled_since_it_was_read_leaves_it_alone(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    _failed_create(world, "c-1")
    real_preview = requeue.preview
    with world.engine.connect() as conn:
        rule = catalog.get_rule(conn, RULE)
        read = real_preview(conn, rule, requeue.Selection(statuses=(LedgerStatus.FAILED,)))
    assert [r["external_id"] for r in read] == ["c-1"]
    world.run()  # the chain settles c-1: delivered, the row's version moves on
    monkeypatch.setattr(requeue, "preview", lambda conn, rule, selection: read)
    with world.engine.begin() as conn:
        changed = requeue.requeue(conn, rule, requeue.Selection(statuses=(LedgerStatus.FAILED,)), "ops", utcnow())
    assert changed == []
    assert world.ledger()["c-1"]["status"] == "delivered"
    with world.engine.connect() as conn:
        assert requeue.list_requeues(conn, RULE) == []


# -- a create replayed under its key after the body changed (point 12) ----------------------------


def test_a_crash_between_the_answer_and_the_settle_then_a_change_ends_with_the_latest_body(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    world.load("c-1", name="First")
    chain = Chain(world.engine, RULE)
    assert chain.open() is None

    def crash(*_args: Any, **_kwargs: Any) -> bool:
        raise SystemExit("killed after the target took the create")

    with monkeypatch.context() as patched:
        patched.setattr(ledger, "settle", crash)
        with pytest.raises(SystemExit):
            chain.run_batch(Phase.SCAN)
    assert [r["name"] for r in world.target.records("contacts").values()] == ["First"]
    row = world.full_ledger_row("c-1")
    assert row["status"] == "failed" and row["last_error"] == ledger.CREATE_IN_FLIGHT
    world.load("c-1", name="Second")
    world.make_due()
    result = world.run()
    assert result["state"] == "COMPLETED"
    records = world.target.records("contacts")
    assert [r["name"] for r in records.values()] == ["Second"]  # one copy, the latest body
    row = world.full_ledger_row("c-1")
    assert row["status"] == "delivered" and row["remote_id"] in records
    assert world.run()["counts"]["delivered"] == 0  # and nothing more to send


def test_a_timeout_after_the_target_took_the_create_then_a_change_ends_with_the_latest_body(world: World) -> None:
    world.load("c-1", name="First")
    # The target takes the create, but answers after the client (0.5 s) has given up.
    world.target.program(world.key("c-1"), Answer.given_up())
    world.set_timeout()
    assert world.run()["scanned"]["failed"] == 1
    world.set_timeout(REQUEST_TIMEOUT_SECONDS)
    # Applied once the client has hung up, at the latest at the stall's 30-second bound (a CI run
    # under heavy load once waited more than 5 s for it).
    deadline = time.monotonic() + 40
    while not world.target.records("contacts") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r["name"] for r in world.target.records("contacts").values()] == ["First"]
    world.load("c-1", name="Second")
    world.make_due()
    world.run()
    assert [r["name"] for r in world.target.records("contacts").values()] == ["Second"]
    assert world.ledger()["c-1"]["status"] == "delivered"


def test_a_requeued_exhausted_create_ends_with_the_latest_body(world: World) -> None:
    world.apply(rule={"max_attempts": 1})
    world.load("c-1", name="First")
    # A create timed out (the target applies it late), then its retry is refused: parked. (A
    # timeout alone never parks it: it may be an outage, ADR-0039.)
    world.target.program(world.key("c-1"), Answer.given_up(), Answer.status(422))
    world.set_timeout()
    assert world.run()["scanned"]["failed"] == 1
    world.set_timeout(REQUEST_TIMEOUT_SECONDS)
    # Applied once the client has hung up, at the latest at the stall's 30-second bound (a CI run
    # under heavy load once waited more than 5 s for it).
    deadline = time.monotonic() + 40
    while not world.target.records("contacts") and time.monotonic() < deadline:
        time.sleep(0.05)
    world.make_due()
    assert world.run()["drained"]["exhausted"] == 1
    world.load("c-1", name="Second")
    with world.engine.begin() as conn:
        requeue.requeue(conn, catalog.get_rule(conn, RULE), requeue.Selection(), "ops", utcnow())
    world.run()
    assert [r["name"] for r in world.target.records("contacts").values()] == ["Second"]
    assert world.ledger()["c-1"]["status"] == "delivered"


def test_an_unchanged_body_sent_again_under_its_key_needs_no_update(world: World) -> None:
    world.load("c-1")
    world.target.program(world.key("c-1"), Answer.status(503))
    world.run()
    world.make_due()
    world.run()
    assert [r.method for r in world.target.requests] == ["POST", "POST"]
    assert world.ledger()["c-1"]["status"] == "delivered"


# -- what counts against the breaker, and unsendable bodies (point 2) -----------------------------


class _BrokenWriter(Writer, Creates, Updates):
    """A writer with a bug: every call raises an exception that is none of ours."""

    def create(self, body: Mapping[str, Any], idempotency_key: str) -> str:
        raise RuntimeError("writer bug")

    def update(self, remote_id: str, body: Mapping[str, Any]) -> None:
        raise RuntimeError("writer bug")


def test_an_unexpected_writer_exception_is_a_rule_fault_that_does_not_count_against_the_breaker(
    world: World,
) -> None:
    register_writer("broken", _BrokenWriter)
    try:
        world.load("c-1")
        world.set_driver("broken")
        with world.engine.begin() as conn:  # one failure short of tripping (fail_max 3)
            target_id = catalog.get_rule(conn, RULE).target.id
            conn.execute(
                breaker_states_table.insert().values(
                    connection_id=target_id, state="closed", fail_counter=2, success_counter=0
                )
            )
        result = world.run()
    finally:
        reset_registry()
    assert result["state"] == "FAILED" and "RuntimeError: writer bug" in result["message"]
    with world.engine.connect() as conn:
        state = conn.execute(sa.select(breaker_states_table)).one()
    assert state.state == "closed"
    assert world.cursor() is None


def test_a_body_the_writer_cannot_encode_is_exhausted_at_once_and_the_rule_goes_on(
    target: TargetServer, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NaN can be stored only where the database takes it (PostgreSQL's json refuses it): a payload
    # loaded before `mirror load` refused NaN, or written by another program.
    from delivery import db

    url = f"sqlite:///{tmp_path / 'nan.db'}"
    monkeypatch.setenv(db.DATABASE_URL_ENV, url)
    world = World(db.shared_engine(url), target, through_prefect=False).apply()
    try:
        world.load("c-1", "c-3")
        world.load("c-2")
        with world.engine.begin() as conn:  # what `mirror load` refuses now, written by another program
            conn.execute(
                mirror_records_table.update()
                .where(mirror_records_table.c.external_id == "c-2")
                .values(payload={"email": world.key("c-2"), "name": "Name c-2", "score": float("nan")})
            )
        result = world.run()
        assert result["state"] == "COMPLETED" and result["ended_by"] == "caught_up"
        rows = world.ledger()
        assert rows["c-2"]["status"] == "exhausted" and rows["c-2"]["attempts"] == 1
        assert "JSON" in rows["c-2"]["last_error"]
        assert rows["c-1"]["status"] == rows["c-3"]["status"] == "delivered"
        assert world.target.count(world.key("c-2")) == 0
        with world.engine.connect() as conn:
            assert conn.execute(sa.select(breaker_states_table.c.fail_counter)).scalar() in (None, 0)
    finally:
        db.dispose_engines()
