"""The production wiring: prefect.yaml's two deployments load real flows with no retries, the alert
automations install against a real Prefect API, and deliver-rule emits one event per change of a
rule's health (not one per failing chain)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any
from uuid import uuid4

import jinja2.sandbox
import pytest
import sqlalchemy as sa
import yaml
from typer.testing import CliRunner

import flows.chain_reporting
import flows.deliver_rule
from delivery.clock import utcnow
from delivery.store import chains
from flows.automations import automations
from flows.cli import app, main
from tests.integration.world import World
from tests.support.databases import unique
from tests.target_server import TargetServer

ROOT = Path(__file__).resolve().parents[2]
FAILING = "delivery.rule.failing"
RECOVERED = "delivery.rule.recovered"


@pytest.fixture(scope="module")
def deployments() -> dict[str, dict[str, Any]]:
    document = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    assert isinstance(document, dict)
    return {d["name"]: d for d in document["deployments"]}


# -- prefect.yaml -------------------------------------------------------------------------------


def test_prefect_yaml_declares_both_deployments_on_the_delivery_pool(deployments: dict[str, dict[str, Any]]) -> None:
    assert set(deployments) == {
        "deliver-rule",
        "delivery-tick",
        "delivery-requeue",
        "delivery-preview",
        "delivery-record",
    }
    assert deployments["delivery-record"]["entrypoint"] == "flows/record.py:delivery_record"
    assert deployments["delivery-requeue"]["entrypoint"] == "flows/requeue.py:delivery_requeue"
    assert deployments["delivery-preview"]["entrypoint"] == "flows/preview.py:delivery_preview"
    assert deployments["deliver-rule"]["entrypoint"] == "flows/deliver_rule.py:deliver_rule"
    assert deployments["delivery-tick"]["entrypoint"] == "flows/tick.py:delivery_tick"
    for deployment in deployments.values():
        assert deployment["work_pool"]["name"] == "delivery"
    crons = [s["cron"] for s in deployments["delivery-tick"]["schedules"]]
    assert crons == ["*/5 * * * *"]
    assert not deployments["deliver-rule"].get("schedules")  # the tick starts chains, not a schedule


@pytest.mark.parametrize(
    "name", ["deliver-rule", "delivery-tick", "delivery-requeue", "delivery-preview", "delivery-record"]
)
def test_each_entrypoint_loads_a_flow_named_as_its_deployment_with_no_retries(
    deployments: dict[str, dict[str, Any]], name: str
) -> None:
    from prefect.flows import load_flow_from_entrypoint

    path, _, func = deployments[name]["entrypoint"].partition(":")
    loaded = load_flow_from_entrypoint(f"{ROOT / path}:{func}")
    assert loaded.name == name
    assert loaded.retries == 0
    if name == "deliver-rule":
        assert "rule" in loaded.parameters.properties
        assert "rule" in (loaded.parameters.required or [])
    if name == "delivery-preview":
        # Each parameter described (the docstring's Args), the limit bounded in the UI's form.
        properties = loaded.parameters.properties
        assert loaded.parameters.required == ["rule"]
        assert set(properties) == {"rule", "limit"}
        assert all(properties[p].get("description") for p in properties)
        assert properties["limit"]["default"] == 50
        assert (properties["limit"]["minimum"], properties["limit"]["maximum"]) == (1, 10_000)
    if name == "delivery-record":
        properties = loaded.parameters.properties
        assert loaded.parameters.required == ["rule", "record_id"]
        assert set(properties) == {"rule", "record_id", "limit"}
        assert all(properties[p].get("description") for p in properties)


def test_subflows_and_the_batch_task_have_no_retries() -> None:
    assert flows.deliver_rule.deliver_rule.retries == 0
    assert flows.deliver_rule.drain.retries == 0
    assert flows.deliver_rule.scan.retries == 0
    assert flows.deliver_rule.delivery_batch.retries == 0


# -- alert automations --------------------------------------------------------------------------


NAMES = {a.name for _, a in automations(uuid4(), enabled=True)}


def test_automations_expect_the_failing_and_recovered_events() -> None:
    block_id = uuid4()
    made = {path.name: a for path, a in automations(block_id, enabled=False)}
    assert set(made["rule-failing.yaml"].trigger.expect) == {FAILING}  # type: ignore[union-attr]
    assert set(made["rule-recovered.yaml"].trigger.expect) == {RECOVERED}  # type: ignore[union-attr]
    for automation in made.values():
        assert automation.enabled is False
        assert [a.block_document_id for a in automation.actions] == [block_id]  # type: ignore[union-attr]
    assert all(a.enabled for _, a in automations(block_id, enabled=True))


def _installed() -> list[Any]:
    from prefect import get_client

    async def read() -> list[Any]:
        async with get_client() as client:
            return list(await client.read_automations())

    return [a for a in asyncio.run(read()) if a.name in NAMES]


def _refused(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int | str | None, str]:
    """Run the `delivery` console script (flows.cli:main) in process: it turns refused input
    into exit 2 and `error: ...` on stderr."""
    runner = CliRunner()
    monkeypatch.setattr(sys, "argv", ["delivery", *args])
    with runner.isolation() as (_, stderr, _):
        try:
            main()
            code: int | str | None = 0
        except SystemExit as exc:
            code = exc.code
        sys.stderr.flush()
        return code, stderr.getvalue().decode()


@pytest.fixture
def slack_block(prefect_api: None) -> tuple[str, Any]:
    from prefect.blocks.notifications import SlackWebhook

    name = unique("ops")
    block_id = SlackWebhook(url="https://hooks.slack.com/services/T00000000/B00000000/XXXXXXXX").save(name)
    return f"slack-webhook/{name}", block_id


def test_alerts_install_creates_the_automations_and_reinstalling_updates_them_in_place(
    slack_block: tuple[str, Any],
) -> None:
    block, block_id = slack_block
    runner = CliRunner()

    result = runner.invoke(app, ["alerts", "install", "--block", block])
    assert result.exit_code == 0, repr(result.exception)
    first = _installed()
    assert sorted(a.name for a in first) == sorted(NAMES)
    assert {FAILING, RECOVERED} <= {next(iter(a.trigger.expect)) for a in first}
    for automation in first:
        assert automation.enabled is True
        assert [a.block_document_id for a in automation.actions] == [block_id]

    again = runner.invoke(app, ["alerts", "install", "--block", block, "--disabled"])
    assert again.exit_code == 0, repr(again.exception)
    second = _installed()
    assert len(second) == len(NAMES)
    assert {a.id for a in second} == {a.id for a in first}  # updated, not made again
    assert all(a.enabled is False for a in second)


def test_alerts_install_refuses_an_unknown_or_malformed_block(
    slack_block: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = sorted(str(a.id) for a in _installed())
    code, stderr = _refused(monkeypatch, "alerts", "install", "--block", f"slack-webhook/{unique('missing')}")
    assert code == 2
    assert "--block" in stderr and "no notification block" in stderr
    code, stderr = _refused(monkeypatch, "alerts", "install", "--block", "no-slash")
    assert code == 2 and "--block" in stderr and "BLOCK-TYPE/NAME" in stderr
    assert sorted(str(a.id) for a in _installed()) == before  # nothing created or deleted


# -- events from deliver-rule -------------------------------------------------------------------


@pytest.fixture
def world(prefect_api: None, engine: sa.Engine, target: TargetServer) -> World:
    return World(engine, target).apply()


@pytest.fixture
def emitted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    events: list[str] = []

    def record(*, event: str, resource: dict[str, str], payload: dict[str, Any] | None = None, **_: Any) -> None:
        assert resource["prefect.resource.id"] == "delivery.rule.contacts-to-crm"
        events.append(event)
        PAYLOADS.append(payload or {})

    monkeypatch.setattr(flows.chain_reporting, "emit_event", record)
    return events


#: What the rule events carried, in the order emitted (cleared by each test that reads it).
PAYLOADS: list[dict[str, Any]] = []


def test_a_failing_rule_alerts_once_and_once_more_when_it_recovers(world: World, emitted: list[str]) -> None:
    PAYLOADS.clear()
    world.load("a")
    world.set_driver("soap")  # no writer registered: a rule fault on every chain
    assert world.run()["state"] == "FAILED"
    assert world.run()["state"] == "FAILED"
    assert emitted == [FAILING]
    world.set_driver("rest")
    result = world.run()
    assert result["ended_by"] == "caught_up" and result["counts"]["delivered"] == 1
    assert emitted == [FAILING, RECOVERED]
    # The notification says it in the run's words, not the chain's snake_case ending.
    (action,) = next(a for path, a in automations(uuid4(), True) if path.name == "rule-recovered.yaml").actions
    event = {"resource": {"name": "contacts-to-crm"}, "payload": PAYLOADS[-1]}
    body = jinja2.sandbox.SandboxedEnvironment().from_string(action.body).render(event=event)  # type: ignore[union-attr]
    assert body == "Delivery rule contacts-to-crm recovered: its last chain ended CaughtUp (caught up: 1 delivered)."


def _superseded_chain(world: World) -> None:
    """What the tick leaves behind when it judges a hung chain dead."""
    rule_id = world.rule_row()["id"]
    with world.engine.begin() as conn:
        token = chains.start_chain(conn, rule_id, None, utcnow())
        chains.supersede(conn, rule_id, token, utcnow(), "judged dead by the tick")


def test_a_superseded_chain_between_chains_does_not_change_what_is_announced(world: World, emitted: list[str]) -> None:
    world.set_driver("soap")
    world.run()
    _superseded_chain(world)
    world.run()  # still failing: no second page
    _superseded_chain(world)
    world.set_driver("rest")
    world.run()  # the rule recovered
    assert emitted == [FAILING, RECOVERED]
