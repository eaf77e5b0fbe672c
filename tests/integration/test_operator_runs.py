"""What an operator sees of a chain in Prefect: a state named after how it ended, the records it
parked or left failed (with the `delivery requeue` command that puts exactly those back), lock
waits, lock repairs and breaker trips in the run's log, and one event per change of a breaker."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import sys
from datetime import timedelta
from typing import Any

import pybreaker
import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

import flows.breaker_events
import flows.chain_reporting
import flows.deliver_rule
import flows.lock
from delivery import liveness
from delivery.breaker import BreakerListener, TargetBreaker
from delivery.clock import utcnow
from delivery.errors import MissingWriter, TargetUnavailable
from delivery.liveness import LEASE_SECONDS
from delivery.store import catalog, chains
from delivery.store.breaker import DatabaseBreakerStorage
from delivery.store.tables import breaker_states_table, chains_table, connections_table, rules_table
from flows.chain_reporting import records_artifact_key
from flows.cli import app
from flows.deliver_rule import deliver_rule, fault_state_name, launched
from flows.lock import acquire_lease
from flows.parked_artifact import parked_artifact_key
from tests.integration.locks import own_rule_lock
from tests.integration.runs import child_runs, run_artifacts, run_logs, run_state, run_tags
from tests.integration.world import RULE, World
from tests.target_server import Answer, TargetServer


@pytest.fixture
def world(prefect_api: None, engine: sa.Engine, target: TargetServer) -> World:
    return World(engine, target).apply()


def _set(engine: sa.Engine, table: sa.Table, where: Any, **values: Any) -> None:
    with engine.begin() as conn:
        conn.execute(table.update().where(where).values(**values))


def _crm_id(world: World) -> int:
    with world.engine.connect() as conn:
        return int(
            conn.execute(sa.select(connections_table.c.id).where(connections_table.c.name == "crm")).scalar_one()
        )


# -- 1. states that tell apart -----------------------------------------------------------------


def test_each_way_a_chain_ends_completed_has_a_state_name_of_its_own(world: World) -> None:
    world.load("a")

    def ended(expected_end: str) -> tuple[str, str]:
        result = world.run()
        assert result["state"] == "COMPLETED" and result["ended_by"] == expected_end  # `delivery run --json`
        return run_state(result["flow_run_id"])

    assert ended("caught_up") == ("COMPLETED", "CaughtUp")

    _set(world.engine, connections_table, connections_table.c.name == "crm", status="error")
    assert ended("route_closed") == ("COMPLETED", "RouteClosed")
    _set(world.engine, connections_table, connections_table.c.name == "crm", status="active")

    _set(world.engine, rules_table, rules_table.c.name == RULE, enabled=False)
    assert ended("disabled") == ("COMPLETED", "Disabled")
    _set(world.engine, rules_table, rules_table.c.name == RULE, enabled=True)

    crm = _crm_id(world)
    _set(
        world.engine,
        breaker_states_table,
        breaker_states_table.c.connection_id == crm,
        state="open",
        opened_at=utcnow(),
    )
    assert ended("breaker_open") == ("COMPLETED", "BreakerOpen")

    # A launch the tick judged dead before it ran: the run adopts a chain that has ended.
    rule_id = world.rule_row()["id"]
    with world.engine.begin() as conn:
        token = chains.start_chain(conn, rule_id, None, utcnow())
        chains.supersede(conn, rule_id, token, utcnow(), "judged dead by the tick")
    with launched(token):
        state = asyncio.run(deliver_rule(rule=RULE, return_state=True))  # type: ignore[call-overload]
    assert run_state(str(state.state_details.flow_run_id)) == ("COMPLETED", "Superseded")


def test_a_failed_chain_is_a_plain_failed_run_tagged_with_the_fault_of_the_rule(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    world.load("a")
    world.set_driver("soap")
    result = world.run()
    # What `delivery run --json` prints is unchanged.
    assert result["state"] == "FAILED" and result["ended_by"] == "rule_fault"
    assert result["message"].startswith("MissingWriter:")
    # Named `Failed`, as Prefect's state filter and its automations (`prefect.flow-run.Failed`) know
    # it; the fault's class is a tag and the message's first word.
    assert run_state(result["flow_run_id"]) == ("FAILED", "Failed")
    assert {"fault:MissingWriter", "ended:rule_fault", f"rule:{RULE}", "target:crm"} <= run_tags(result["flow_run_id"])
    # One ERROR line saying the fault, the rule and what to do; no traceback for a fault the engine names.
    errors = [line for line in run_logs(result["flow_run_id"]) if "failed" in line and RULE in line]
    assert len(errors) == 1 and "What to do:" in errors[0] and "Traceback" not in errors[0], errors
    # The run is Failed without the flow raising; whoever awaits its result still gets the fault.
    with pytest.raises(MissingWriter):
        asyncio.run(deliver_rule(rule=RULE))  # type: ignore[call-overload]

    world.set_driver("rest")
    monkeypatch.delenv("CRM_TOKEN")
    result = world.run()
    assert run_state(result["flow_run_id"]) == ("FAILED", "Failed")
    assert "fault:MissingCredential" in run_tags(result["flow_run_id"])
    assert "CRM_TOKEN" in result["message"]


def test_a_fault_met_in_a_batch_makes_one_failed_run_and_no_traceback(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chain's run is the one Failed run of the fault: its scan subflow ends `Stopped` (of
    type Completed), and no log of the chain, its subflows or its batch holds a traceback."""
    world.load("a")
    monkeypatch.setenv("CRM_TOKEN", "a-token-the-target-refuses-0123456789")
    original, world.target.token = world.target.token, "s3cr3t-token-value"
    try:
        result = world.run()
    finally:
        world.target.token = original
    run_id = result["flow_run_id"]
    assert run_state(run_id) == ("FAILED", "Failed") and result["message"].startswith("Unauthorized:")
    assert "fault:Unauthorized" in run_tags(run_id)
    children = child_runs(run_id)
    assert [(run.name, run.state.type.value, run.state.name) for run in children] == [
        (f"{RULE} · drain", "COMPLETED", "Completed"),
        (f"{RULE} · scan", "COMPLETED", "Stopped"),
    ]
    logs = run_logs(run_id) + [line for run in children for line in run_logs(str(run.id))]
    assert not [line for line in logs if "Traceback" in line], logs
    errors = [line for line in run_logs(run_id) if "failed" in line and "Unauthorized" in line]
    assert len(errors) == 1 and "What to do:" in errors[0], errors


def test_an_unexpected_error_keeps_its_traceback_in_the_log(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    world.load("a")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ZeroDivisionError("a bug, not a fault of the rule")

    monkeypatch.setattr(flows.deliver_rule.Chain, "run_batch", broken)
    result = world.run()
    assert run_state(result["flow_run_id"]) == ("FAILED", "Failed")
    assert "fault:ZeroDivisionError" in run_tags(result["flow_run_id"])
    assert any("unexpected error" in line and "Traceback" in line for line in run_logs(result["flow_run_id"]))


def test_a_chain_that_parked_records_says_so_in_its_tags_and_a_warning_per_record(world: World) -> None:
    world.apply(rule={"max_attempts": 1})
    world.load("ok", "refused", "unaddressable")
    world.target.program(world.key("refused"), Answer.status(422, {"error": "email invalid"}))
    world.target.program(world.key("unaddressable"), Answer.no_id())
    result = world.run()
    run_id = result["flow_run_id"]
    assert run_state(run_id) == ("COMPLETED", "CaughtUp")
    assert {"ended:caught_up", "parked:2"} <= run_tags(run_id)
    logs = run_logs(run_id)
    parked = [line for line in logs if "parked as exhausted" in line]
    assert len(parked) == 2, logs
    assert any("record refused" in line and "422" in line for line in parked), parked
    # Counts in words, not a Python dict (the batch lines are in the scan subflow's log).
    scan_logs = run_logs(str(child_runs(run_id)[-1].id))
    assert "scan batch 1: 3 records: 1 delivered, 2 exhausted" in scan_logs, scan_logs

    world.load("later")
    clean = world.run()
    assert clean["counts"]["delivered"] == 1
    assert not any(tag.startswith(("parked:", "failed:")) for tag in run_tags(clean["flow_run_id"]))
    # The rule's standing parked set, published by the chain that parked nothing, still holds both.
    parked = run_artifacts(clean["flow_run_id"])[parked_artifact_key(RULE)].data
    assert "2 records parked (2 exhausted)" in parked, parked
    assert "| refused |" in parked and "| unaddressable |" in parked, parked
    # And the status of every rule, refreshed as the chain ended: not a tick behind.
    status = run_artifacts(clean["flow_run_id"])["delivery-status"].data
    [row] = json.loads(status) if isinstance(status, str) else status
    assert (row["rule"], row["last chain"], row["records"]) == (RULE, "CaughtUp", "2 delivered, 2 exhausted")


def test_subflows_are_named_after_the_rule_carry_its_tags_and_run_no_empty_batch(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs: list[int] = []
    run_batch = flows.deliver_rule.Chain.run_batch

    def counted(self: Any, phase: Any) -> Any:
        report = run_batch(self, phase)
        jobs.append(report.attempted)
        return report

    monkeypatch.setattr(flows.deliver_rule.Chain, "run_batch", counted)
    world.apply(rule={"batch_size": 2})
    world.load("a", "b", "c", "d")
    result = world.run()
    assert jobs == [2, 2]  # nothing due for the drain, two full pages of the scan, and no empty job
    children = child_runs(result["flow_run_id"])
    assert [run.name for run in children] == [f"{RULE} · drain", f"{RULE} · scan"]
    for run in children:
        assert {f"rule:{RULE}", "target:crm"} <= set(run.tags)
    scan_logs = run_logs(str(children[-1].id))
    assert [line for line in scan_logs if "batch" in line] == [
        "scan batch 1: 2 records: 2 delivered",
        "scan batch 2: 2 records: 2 delivered",
    ]


def test_a_batch_out_of_time_is_named_timed_out() -> None:
    assert fault_state_name(TimeoutError("Task run exceeded timeout of 1.0 seconds")) == "TimedOut"
    assert fault_state_name(MissingWriter("r", "soap")) == "MissingWriter"


# -- 2. the records a chain parked or left failed ------------------------------------------------


def _markdown_rows(markdown: str) -> list[list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return [[cell.strip() for cell in line[2:-2].split(" | ")] for line in lines[1:]]  # the header out


def test_the_records_artifact_lists_what_this_chain_left_and_its_requeue_command_puts_exactly_those_back(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    world.apply(rule={"max_attempts": 2})
    # An earlier chain: one record delivered (to go gone later), one left failed (not due again
    # during the next chain): that one is no business of the next chain's artifact.
    world.load("gone", "early")
    world.target.program(world.key("early"), Answer.status(422))
    first = world.run()
    assert first["counts"]["failed"] == 1 and first["counts"]["delivered"] == 1
    remote_gone_id = world.ledger()["gone"]["remote_id"]

    monkeypatch.setattr(flows.chain_reporting, "RECORDS_LISTED", 2)
    world.load("ok", "refused", "unaddressable")
    world.load("gone", changed="yes")
    world.target.program(world.key("refused"), Answer.status(422, {"error": "email | invalid"}))
    world.target.program(world.key("unaddressable"), Answer.no_id())
    world.target.program_remote(remote_gone_id, Answer.status(404))
    second = world.run()

    artifact = run_artifacts(second["flow_run_id"])[records_artifact_key(RULE)]
    markdown: str = artifact.data
    assert artifact.key == f"chain-{RULE}-records"
    assert "**3** record(s)" in markdown and "1 failed, 1 exhausted, 1 remote_gone" in markdown
    rows = _markdown_rows(markdown)
    assert len(rows) == 2 and "The first 2 of 3 are listed" in markdown  # the cap, and the total
    listed = {row[0]: row for row in rows}
    assert set(listed) <= {"refused", "unaddressable", "gone"}
    if "refused" in listed:  # a pipe in an error does not break the table
        assert listed["refused"][1:3] == ["failed", "1"] and "email \\| invalid" in listed["refused"][3]

    (command,) = [line for line in markdown.splitlines() if line.startswith("delivery requeue ")]
    with world.engine.connect() as conn:
        started = conn.execute(
            sa.select(chains_table.c.started_at).where(chains_table.c.flow_run_id == second["flow_run_id"])
        ).scalar_one()
    assert shlex.split(command) == [
        "delivery", "requeue", RULE,
        "--status", "failed", "--status", "exhausted", "--status", "remote_gone",
        "--since", started.isoformat(),
    ]  # fmt: skip

    before = world.ledger()
    result = CliRunner().invoke(app, [*shlex.split(command)[1:], "--by", "ops", "--json"])
    assert result.exit_code == 0, result.output
    assert {r["external_id"] for r in json.loads(result.stdout)["records"]} == {
        "refused",
        "unaddressable",
        "gone",
    }
    after = world.ledger()
    for external_id in ("refused", "unaddressable", "gone"):
        assert after[external_id]["status"] == "failed" and after[external_id]["attempts"] == 0
    assert after["early"] == before["early"] and after["ok"]["status"] == "delivered"


def test_a_chain_that_leaves_nothing_behind_says_so(world: World) -> None:
    world.load("a")
    result = world.run()
    markdown = run_artifacts(result["flow_run_id"])[records_artifact_key(RULE)].data
    assert "parked no record and left none failed" in markdown and "delivery requeue" not in markdown


# -- 3. the lock and the breaker in the run's log -------------------------------------------------


@pytest.fixture
def lock(monkeypatch: pytest.MonkeyPatch) -> str:
    """A limit of this test's own, so that no other test's slot can be in the way."""
    return own_rule_lock(monkeypatch, "delivery-rule-logs")


def test_a_wait_for_the_rule_lock_and_the_repair_of_a_dead_holder_are_in_the_runs_log(world: World, lock: str) -> None:
    lease = asyncio.run(acquire_lease(lock, timeout_seconds=10, lease_seconds=LEASE_SECONDS))
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()  # a process that held the lock and died mid-job
    rule_id = world.rule_row()["id"]
    with world.engine.begin() as conn:
        token = chains.start_chain(conn, rule_id, "0000-dead-run", utcnow() - timedelta(seconds=5))
        chains.record_lock(conn, token, str(lease), liveness.this_host(), finished.pid, utcnow())
    world.load("a")
    result = world.run()
    assert result["ended_by"] == "caught_up"
    logs = run_logs(result["flow_run_id"])
    (begins,) = [m for m in logs if m.startswith("waiting for the rule lock")]  # said at once
    assert f"held by chain {token} (flow run 0000-dead-run)" in begins
    (waiting,) = [m for m in logs if "waiting for the rule lock" in m and "so far" in m]
    assert f"chain {token} (flow run 0000-dead-run, pid {finished.pid} on {liveness.this_host()}" in waiting
    # How long it had waited when it said so depends on the machine's load: only that it says.
    assert re.search(r"for \d+ s so far", waiting), waiting
    assert any(f"freed the lock of dead chain {token}" in m and "its lease was released" in m for m in logs)
    assert any("took the rule lock after waiting" in m for m in logs)


@pytest.fixture
def emitted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    events: list[tuple[str, str]] = []

    def record(*, event: str, resource: dict[str, str], **_: Any) -> None:
        events.append((event, resource["prefect.resource.id"]))

    monkeypatch.setattr(flows.breaker_events, "emit_event", record)
    return events


def test_a_breaker_trip_mid_chain_is_in_the_runs_log_and_each_change_is_emitted_once(
    world: World, emitted: list[tuple[str, str]]
) -> None:
    world.apply(rule={"concurrency": 4})  # four workers, four breakers sharing one state
    world.load(*[f"r{n}" for n in range(12)])
    world.target.down = True
    tripped = world.run()
    assert tripped["ended_by"] == "breaker_open" and tripped["state"] == "COMPLETED"
    assert run_state(tripped["flow_run_id"]) == ("COMPLETED", "BreakerOpen")
    assert emitted == [(flows.breaker_events.OPENED, "delivery.connection.crm")]
    logs = run_logs(tripped["flow_run_id"])
    assert [m for m in logs if "the breaker of target crm opened (closed -> open)" in m]

    assert world.run()["ended_by"] == "breaker_open"  # still open: no second event
    assert len(emitted) == 1

    # The cooldown over, one trial call goes through and closes it.
    crm = _crm_id(world)
    _set(
        world.engine,
        breaker_states_table,
        breaker_states_table.c.connection_id == crm,
        opened_at=utcnow() - timedelta(hours=1),
    )
    world.target.down = False
    world.make_due()
    recovered = world.run()
    assert recovered["ended_by"] == "caught_up" and recovered["counts"]["delivered"] == 12
    assert emitted == [
        (flows.breaker_events.OPENED, "delivery.connection.crm"),
        (flows.breaker_events.CLOSED, "delivery.connection.crm"),
    ]
    assert [m for m in run_logs(recovered["flow_run_id"]) if "the breaker of target crm is closed" in m]


class _Heard(BreakerListener):
    def __init__(self) -> None:
        self.changes: list[tuple[str, str]] = []

    def changed(self, breaker: TargetBreaker, old: str, new: str) -> None:
        self.changes.append((old, new))


def test_only_the_breaker_whose_write_changed_the_shared_state_tells_its_listeners(
    engine: sa.Engine, db_url: str, target: TargetServer
) -> None:
    from delivery import db

    World(engine, target).apply(target={"breaker": {"fail_max": 2, "reset_seconds": 60}})
    with engine.connect() as conn:
        rule = catalog.get_rule(conn, RULE)
    other_engine = db.create_engine(db_url)  # a second worker process
    try:
        mine, theirs = _Heard(), _Heard()
        breaker, other = TargetBreaker(engine, rule, [mine]), TargetBreaker(other_engine, rule, [theirs])

        def fail() -> None:
            raise TargetUnavailable("down")

        for _ in range(2):
            with pytest.raises(TargetUnavailable):
                breaker.call(fail)
        with pytest.raises(pybreaker.CircuitBreakerError):
            other.call(lambda: None)  # it notices the trip: pybreaker tells its listeners, we do not
        assert mine.changes == [("closed", "open")] and theirs.changes == []

        # Two writers making the same change: exactly one of them is told it changed the row.
        storage = DatabaseBreakerStorage(other_engine, rule.target.id)
        assert storage.change_state("open") is None  # open already
        assert breaker.storage.change_state("closed") == "open"
        assert storage.change_state("closed") is None
    finally:
        other_engine.dispose()
