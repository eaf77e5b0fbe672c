"""`delivery-tick` against a real `prefect server start`, deployed from prefect.yaml as an operator
deploys it (`prefect deploy`), on SQLite and PostgreSQL:

- the tick starts each chain as a run of the `deliver-rule` deployment created with its name
  (`RULE -> TARGET`), its tags and the chain token as idempotency key (not renamed afterwards);
- a second tick run while one holds the deployment's slot is cancelled (`CANCEL_NEW`);
- each tick publishes the `delivery-status` table artifact, one row per rule;
- `delivery tick --json` says per rule what the tick did.

One server and one deploy for the module (the server costs 15-20 s to start). No worker runs: the
chains' runs stay Scheduled, which is all the naming needs, and the slot test drives the tick runs'
states through the API exactly as a worker does (it proposes Pending before it starts a process).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
import sqlalchemy as sa
import yaml

from delivery.apply import apply_config
from delivery.config import parse_config
from delivery.store.tables import chains_table
from flows.deliver_rule import CHAIN_TOKEN_KEY
from tests.integration.runs import run_logs
from tests.integration.world import RULE, World
from tests.prefect_server import prefect_server
from tests.support.days import clear_of_midnight
from tests.target_server import TargetServer

ROOT = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]
PAUSED = "paused-rule-with-a-long-name"


@pytest.fixture(scope="module")
def server_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A `prefect server start` of the module's own, with prefect.yaml's two deployments on it; the
    environment a process needs to use it."""
    home = tmp_path_factory.mktemp("prefect-home")
    with prefect_server(home) as api:
        client_env = {
            **os.environ,
            "PREFECT_HOME": str(home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_API_URL": api,
        }
        for command in (
            ["work-pool", "create", "delivery", "--type", "process"],
            ["--no-prompt", "deploy", "--all"],
        ):
            done = subprocess.run([*PREFECT, *command], cwd=ROOT, env=client_env, capture_output=True, text=True)
            assert done.returncode == 0, f"prefect {' '.join(command)}:\n{done.stdout}\n{done.stderr}"
        yield client_env


@pytest.fixture
def api(server_env: dict[str, str]) -> Iterator[str]:
    """This process's Prefect client pointed at the module's server."""
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server_env["PREFECT_API_URL"]}):
        yield server_env["PREFECT_API_URL"]
        # The in-process tick's log lines go to this server: sent now, not at exit once it is gone.
        APILogWorker.drain_all(timeout=5)


def _call(work: Any) -> Any:
    async def run() -> Any:
        from prefect import get_client

        async with get_client() as client:
            return await work(client)

    return asyncio.run(run())


@pytest.fixture
def world(api: str, engine: sa.Engine, target: TargetServer) -> World:
    """contacts-to-crm enabled with a record to deliver, and a disabled rule beside it."""
    world = World(engine, target)
    config = world.config()
    config["rules"].append({**config["rules"][0], "name": PAUSED, "domain": "lead", "enabled": False})
    with engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump(config)))
    world.load("a")
    return world


def test_a_tick_names_its_chains_runs_keys_them_by_chain_token_and_publishes_the_status(
    world: World, server_env: dict[str, str], tmp_path: Path
) -> None:
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "delivery"), "tick", "--json"],
        cwd=tmp_path,
        env={**server_env, "DELIVERY_DATABASE_URL": os.environ["DELIVERY_DATABASE_URL"]},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    result = json.loads(proc.stdout)
    assert result["state"] == "COMPLETED" and result["message"].startswith("1 started, 0 idle, 0 dead replaced")
    assert (result["started"], result["alive"], result["dead_replaced"], result["failed"]) == (1, 0, 0, [])
    started, paused = result["rules"]
    assert paused == {"rule": PAUSED, "action": "disabled", "replaced": []}
    assert started["rule"] == RULE and started["action"] == "started"
    assert started["flow_run_name"] == f"{RULE} -> crm" and started["chain_state"] == "SCHEDULED"

    # The chain's run, as the server has it: created with its name, tags and the chain token as key.
    run = _call(lambda client: client.read_flow_run(UUID(started["flow_run_id"])))
    deployment = _call(lambda client: client.read_deployment_by_name("deliver-rule/deliver-rule"))
    assert run.deployment_id == deployment.id
    assert run.name == f"{RULE} -> crm"
    assert run.idempotency_key == started["chain_token"]
    assert {f"rule:{RULE}", "target:crm"} <= set(run.tags)
    # The chain goes in the run's context: the Run form (and a Retry) never carries it.
    assert run.parameters == {"rule": RULE}
    assert run.context[CHAIN_TOKEN_KEY] == started["chain_token"]
    assert set(deployment.parameter_openapi_schema["properties"]) == {"rule"}
    assert deployment.parameter_openapi_schema["properties"]["rule"]["description"]
    with world.engine.connect() as conn:
        chain = conn.execute(sa.select(chains_table).where(chains_table.c.token == started["chain_token"])).one()
    assert chain.flow_run_id == started["flow_run_id"] and chain.ended_at is None

    # The health page: one row per rule, on the tick's own run.
    rows = _status_rows(result["flow_run_id"])
    assert [r["rule"] for r in rows] == [RULE, f"{PAUSED} (disabled)"]
    contacts = rows[0]
    assert contacts["route"] == "open" and contacts["breaker"] == "closed"
    assert contacts["last chain"] == "running"  # the chain just launched, waiting for a worker
    assert {"records", "due retries", "lag"} <= set(contacts)
    assert rows[1]["last chain"] == "never ran"

    # The next tick, in process: the launched chain is alive, nothing new starts.
    from flows.tick import run_tick

    again = run_tick()
    assert again["state"] == "COMPLETED"
    assert [(r["rule"], r["action"]) for r in again["rules"]] == [(RULE, "alive"), (PAUSED, "disabled")]
    runs = _call(lambda client: client.read_flow_runs())
    assert sum(1 for r in runs if r.idempotency_key == started["chain_token"]) == 1
    assert [r["rule"] for r in _status_rows(again["flow_run_id"])] == [RULE, f"{PAUSED} (disabled)"]


def _status_rows(flow_run_id: str) -> list[dict[str, Any]]:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    artifacts = _call(
        lambda client: client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["delivery-status"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run_id)]),
            )
        )
    )
    assert len(artifacts) == 1 and artifacts[0].type == "table"
    data = artifacts[0].data
    rows = json.loads(data) if isinstance(data, str) else data
    assert isinstance(rows, list)
    return rows


def test_a_tick_run_started_while_another_holds_the_slot_is_cancelled(api: str) -> None:
    from prefect.client.schemas.objects import ConcurrencyLimitStrategy
    from prefect.states import Completed, Pending, Running

    deployment = _call(lambda client: client.read_deployment_by_name("delivery-tick/delivery-tick"))
    assert deployment.global_concurrency_limit is not None and deployment.global_concurrency_limit.limit == 1
    assert deployment.concurrency_options.collision_strategy == ConcurrencyLimitStrategy.CANCEL_NEW

    async def propose(client: Any, run_id: UUID, state: Any) -> str:
        result = await client.set_flow_run_state(run_id, state)
        return str(result.state.type.value)

    async def scenario(client: Any) -> list[str]:
        first = await client.create_flow_run_from_deployment(deployment.id)
        second = await client.create_flow_run_from_deployment(deployment.id)
        third = await client.create_flow_run_from_deployment(deployment.id)
        seen = [await propose(client, first.id, Pending()), await propose(client, first.id, Running())]
        seen.append(await propose(client, second.id, Pending()))  # the slot is held: cancelled at once
        seen.append(await propose(client, first.id, Completed()))
        seen.append(await propose(client, third.id, Pending()))  # the slot is free again
        await client.set_flow_run_state(third.id, Completed(), force=True)
        return seen

    assert _call(scenario) == ["PENDING", "RUNNING", "CANCELLED", "COMPLETED", "PENDING"]


def _execute(flow_run_id: str, env: dict[str, str]) -> None:
    """Run a flow run of the deployment as a worker's process does (`prefect flow-run execute`)."""
    done = subprocess.run(
        [*PREFECT, "flow-run", "execute", flow_run_id], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode in (0, 1), f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"


def test_retry_from_the_ui_starts_a_fresh_chain_that_delivers(
    world: World, server_env: dict[str, str], tmp_path: Path
) -> None:
    from prefect.states import Scheduled

    from flows.tick import run_tick

    without_token = {k: v for k, v in server_env.items() if k != "CRM_TOKEN"}
    without_token["DELIVERY_DATABASE_URL"] = os.environ["DELIVERY_DATABASE_URL"]
    env = {**without_token, "CRM_TOKEN": os.environ["CRM_TOKEN"]}
    started = next(r for r in run_tick()["rules"] if r["rule"] == RULE)
    run_id = started["flow_run_id"]

    _execute(run_id, without_token)  # the token is missing: the chain fails
    run = _call(lambda client: client.read_flow_run(UUID(run_id)))
    assert (run.state.type.value, run.state.name) == ("FAILED", "Failed")
    assert "fault:MissingCredential" in run.tags and run.state.message.startswith("MissingCredential:")
    assert world.target.records("contacts") == {}
    # One ERROR line with the fault and what to do: no traceback, no "exited with unexpected exception".
    logs = run_logs(run_id)
    assert [m for m in logs if "What to do:" in m], logs
    assert not [m for m in logs if "Traceback" in m or "unexpected exception" in m], logs

    # The operator fixes the token and presses Retry: the UI proposes this very state.
    _call(
        lambda client: client.set_flow_run_state(
            UUID(run_id), Scheduled(name="AwaitingRetry", message="Retry from the UI"), force=False
        )
    )
    _execute(run_id, env)
    run = _call(lambda client: client.read_flow_run(UUID(run_id)))
    assert (run.state.type.value, run.state.name) == ("COMPLETED", "CaughtUp"), run.state
    assert run.run_count == 2
    # Its tags say how it ended now: the first attempt's fault is gone.
    assert "ended:caught_up" in run.tags and not [t for t in run.tags if t.startswith(("fault:", "ended:rule"))]
    assert len(world.target.records("contacts")) == 1  # delivered by the retry
    with world.engine.connect() as conn:
        mine = conn.execute(
            sa.select(chains_table).where(chains_table.c.flow_run_id == run_id).order_by(chains_table.c.started_at)
        ).all()
    # The launch's chain ended with the fault; the retry ran a fresh chain of its own, which caught up.
    assert [c.token == started["chain_token"] for c in mine] == [True, False]
    assert mine[-1].ended_by == "caught_up"


def test_a_deployment_run_against_a_spent_budget_ends_rate_limited(
    world: World, server_env: dict[str, str], tmp_path: Path
) -> None:
    from flows.tick import run_tick

    # The job's deadline a minute on, and midnight beyond the test: the spent budget (reset at
    # midnight) ends the chain instead of being waited out.
    clear_of_midnight(180)
    world.apply(target={"rate_limit": {"per_day": 1}})
    world.load("b")
    env = {
        **server_env,
        "DELIVERY_DATABASE_URL": os.environ["DELIVERY_DATABASE_URL"],
        "CRM_TOKEN": os.environ["CRM_TOKEN"],
        "DELIVERY_BATCH_TIMEOUT_SECONDS": "60",
    }
    run_id = next(r for r in run_tick()["rules"] if r["rule"] == RULE)["flow_run_id"]
    _execute(run_id, env)
    run = _call(lambda client: client.read_flow_run(UUID(run_id)))
    assert (run.state.type.value, run.state.name) == ("COMPLETED", "RateLimited"), run.state
    assert "ended:rate_limited" in run.tags
    assert "rate budget" in run.state.message
    assert len(world.target.requests) == 1


def _nulls(schema: Any) -> list[Any]:
    """Every place in a JSON schema that allows null: the UI renders those as 'Property is type None'."""
    if isinstance(schema, dict):
        found = [schema] if schema.get("type") == "null" or schema.get("type") == ["null"] else []
        return found + [n for value in schema.values() for n in _nulls(value)]
    if isinstance(schema, list):
        return [n for value in schema for n in _nulls(value)]
    return []


def test_every_deployment_form_describes_each_parameter_with_a_control_the_ui_renders(api: str) -> None:
    names = ["deliver-rule/deliver-rule", "delivery-tick/delivery-tick"]
    names += ["delivery-requeue/delivery-requeue", "delivery-preview/delivery-preview"]
    names += ["delivery-record/delivery-record"]
    schemas = {
        name: _call(lambda client, n=name: client.read_deployment_by_name(n)).parameter_openapi_schema for name in names
    }
    for name, schema in schemas.items():
        assert schema["properties"], name
        for parameter, spec in schema["properties"].items():
            assert spec.get("description"), f"{name}: {parameter} has no description"
        assert _nulls(schema) == [], f"{name}: a parameter may be null: {_nulls(schema)}"
    assert list(schemas["deliver-rule/deliver-rule"]["properties"]) == ["rule"]  # no chain_token
    requeue = schemas["delivery-requeue/delivery-requeue"]
    statuses = requeue["properties"]["statuses"]
    assert statuses["type"] == "array" and statuses["default"] == ["exhausted", "remote_gone"]
    items = statuses["items"]
    if "$ref" in items:  # an enum of its own in definitions
        items = requeue["definitions"][items["$ref"].rsplit("/", 1)[-1]]
    assert sorted(items["enum"]) == ["exhausted", "failed", "remote_gone"]
    tick = schemas["delivery-tick/delivery-tick"]["properties"]["dead_after_minutes"]
    assert tick["type"] == "number" and tick["default"] == 0
