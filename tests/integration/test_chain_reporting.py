"""What a `deliver-rule` run reports (`flows/chain_reporting.py`) when one process runs several
chains at once, as the warm worker does (flows/worker.py: a thread and an event loop per chain):
each run's log, artifacts and tags speak of its own chain only. And the two costs a busy process
is spared: the `parked-RULE` artifact of a rule with nothing parked before or after, and the
`delivery-status` artifact while other chains are in flight (`throttle_status`)."""

from __future__ import annotations

import contextvars
import threading
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from delivery.apply import apply_config
from delivery.chain import Chain
from delivery.config import parse_config
from delivery.domain import Phase
from flows import chain_reporting
from flows.chain_reporting import StatusThrottle, records_artifact_key
from flows.parked_artifact import parked_artifact_key
from flows.status_artifact import STATUS_ARTIFACT_KEY
from tests.integration.runs import run_artifacts, run_logs, run_tags
from tests.integration.world import RULE, World
from tests.target_server import Answer, TargetServer

SECOND = "companies-to-crm"


@pytest.fixture
def world(prefect_api: None, engine: sa.Engine, target: TargetServer) -> World:
    return World(engine, target).apply()


def _two_rules(world: World) -> None:
    config = world.config(rule={"max_attempts": 1})
    config["rules"].append({**config["rules"][0], "name": SECOND, "domain": "company", "collection": "companies"})
    with world.engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump(config)))


def test_chains_of_two_rules_at_once_in_one_process_each_report_only_their_own(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    _two_rules(world)
    world.load("c-ok", "c-refused")
    world.load("k-ok", "k-refused", domain="company")
    world.target.program(world.key("c-refused"), Answer.status(422, {"error": "contact refused"}))
    world.target.program(world.key("k-refused"), Answer.status(422, {"error": "company refused"}))

    # Each chain's first scan job waits, once it has run, until the other chain's has run too: past
    # the barrier both chains are in the middle of a job at once, and what each then reports (the
    # records it parked, its end) happens while the other is running.
    both_in_a_job = threading.Barrier(2, timeout=60)
    met: list[str] = []
    run_batch = Chain.run_batch

    def meeting(self: Chain, phase: Phase) -> Any:
        report = run_batch(self, phase)
        if phase is Phase.SCAN and self.rule.name not in met:
            met.append(self.rule.name)
            both_in_a_job.wait()
        return report

    monkeypatch.setattr(Chain, "run_batch", meeting)
    results: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []

    def run(rule: str) -> None:
        try:
            results[rule] = world.run(rule)
        except BaseException as exc:
            errors.append(exc)

    # With this thread's Prefect settings (the harness's API), as the warm worker's threads have theirs.
    threads = [
        threading.Thread(target=contextvars.copy_context().run, args=(run, rule), name=f"run-{rule}")
        for rule in (RULE, SECOND)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    assert not both_in_a_job.broken and sorted(met) == sorted([RULE, SECOND])  # they overlapped

    for rule, other, refused in ((RULE, SECOND, "c-refused"), (SECOND, RULE, "k-refused")):
        result = results[rule]
        run_id = result["flow_run_id"]
        assert (result["state"], result["ended_by"]) == ("COMPLETED", "caught_up"), result
        assert (result["counts"]["delivered"], result["counts"]["exhausted"]) == (1, 1), result
        logs = run_logs(run_id)
        parked = [line for line in logs if "parked as exhausted" in line]
        assert parked == [line for line in parked if line.startswith(f"rule {rule}: record {refused} ")], logs
        assert len(parked) == 1, logs
        assert not any(other in line for line in logs), logs
        assert {f"rule:{rule}", "ended:caught_up", "parked:1"} <= run_tags(run_id)
        assert not any(other in tag for tag in run_tags(run_id))
        artifacts = run_artifacts(run_id)
        assert {records_artifact_key(rule), parked_artifact_key(rule)} <= set(artifacts)
        assert not any(other in key for key in artifacts), sorted(artifacts)
        records = str(artifacts[records_artifact_key(rule)].data)
        assert refused in records and "1 exhausted" in records, records


def test_the_parked_artifact_is_published_while_the_rule_has_or_had_a_parked_set(world: World) -> None:
    world.load("a")
    clean = world.run()
    assert parked_artifact_key(RULE) not in run_artifacts(clean["flow_run_id"])  # never parked anything

    world.load("b")
    world.target.program(world.key("b"), Answer.status(503))
    failed = world.run()
    assert failed["counts"]["failed"] == 1
    parked = run_artifacts(failed["flow_run_id"])[parked_artifact_key(RULE)].data
    assert "nothing parked; 1 failed row waiting for its next attempt" in parked, parked

    world.make_due()
    retried = world.run()
    assert retried["drained"]["delivered"] == 1
    # The set emptied: the artifact says so, rather than go on listing a row that is delivered now.
    parked = run_artifacts(retried["flow_run_id"])[parked_artifact_key(RULE)].data
    assert "nothing parked, no failed row waiting" in parked, parked

    again = world.run()
    assert parked_artifact_key(RULE) not in run_artifacts(again["flow_run_id"])


def test_a_throttled_process_publishes_the_status_only_when_due_or_at_the_last_chain_in_flight(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    throttle = StatusThrottle()
    monkeypatch.setattr(chain_reporting, "STATUS", throttle)
    chain_reporting.throttle_status(3600.0)
    world.load("a")
    # Another chain of this process in flight, and the status published a moment ago.
    throttle.started()
    throttle.started()
    assert throttle.ended() is True

    busy = world.run()
    assert busy["state"] == "COMPLETED"
    artifacts = run_artifacts(busy["flow_run_id"])
    assert STATUS_ARTIFACT_KEY not in artifacts and records_artifact_key(RULE) in artifacts

    assert throttle.ended() is True  # the other chain ends, the last in flight: it would publish
    last = world.run()  # alone in flight: publishes, whatever the interval
    assert STATUS_ARTIFACT_KEY in run_artifacts(last["flow_run_id"])
    assert throttle.in_flight == 0
