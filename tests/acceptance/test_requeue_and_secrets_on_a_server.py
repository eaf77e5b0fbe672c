"""Requeue from the UI and tokens from Secret blocks, end to end against a real `prefect server start`.

One Prefect server for the module. For each database (SQLite, PostgreSQL) one long-running process
serves the `deliver-rule` and `delivery-requeue` deployments against it, as a worker would; the test
starts runs of those deployments through the API (what pressing "Run" in the UI does) and reads back
what an operator would see there: the run's state, its artifact, and the rows in our database.

- `delivery-requeue` with parameters: the rows are requeued, the audit row carries that run's id,
  the artifact lists them.
- `deliver-rule` on a target whose token is a Secret block: delivered with the block's value (the
  target checks the bearer token); the block changed through the API, the same serving process
  delivers the next chain with the new one; the block gone, the run fails `MissingCredential`
  naming the block. The token never reaches the run's state, its logs, or our database.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import pytest
import sqlalchemy as sa

from delivery import db
from delivery.clock import utcnow
from delivery.store.tables import metadata, requeues_table
from tests.integration.world import RULE, World
from tests.prefect_server import prefect_server, stop_group
from tests.support.databases import create_postgres_database, drop_postgres_database, unique
from tests.support.ledger import park
from tests.target_server import TargetServer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 150.0
RUN_TIMEOUT = 120.0
FIRST = "token-one-from-the-ui"
SECOND = "token-two-from-the-ui"

#: The serving process: both deployments, as a worker machine would run them.
SERVE = """
from prefect import serve
from flows.deliver_rule import deliver_rule
from flows.requeue import delivery_requeue
serve(deliver_rule.to_deployment(name="deliver-rule"), delivery_requeue.to_deployment(name="delivery-requeue"))
"""


def _wait(predicate: Callable[[], bool], timeout: float, what: str, poll: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `prefect server start` of this module's own."""
    with prefect_server(tmp_path_factory.mktemp("prefect-server")) as url:
        yield url


def _call(api: str, work: Callable[[], Any]) -> Any:
    """Run `work` with this process's Prefect client pointed at the module's server."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}):
        return work()


@dataclass
class Served:
    api: str
    url: str
    engine: sa.Engine


def _deployments(api: str) -> set[str]:
    try:
        answer = httpx.post(f"{api}/deployments/filter", json={}, timeout=5)
    except httpx.TransportError:
        return set()
    return {d["name"] for d in answer.json()} if answer.status_code == 200 else set()


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def served(request: pytest.FixtureRequest, api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A database of its own and a process serving both deployments against the server with it."""
    if request.param == "sqlite":
        path = tmp_path_factory.mktemp("delivery") / "delivery.db"
        url = f"sqlite:///{path}"
        name = None
    else:
        name = f"delivery_served_{os.getpid()}"
        url = create_postgres_database(name)
    engine = db.create_engine(url)
    db.upgrade(engine)
    env = {
        **os.environ,
        "PREFECT_API_URL": api,
        "DELIVERY_DATABASE_URL": url,
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    env.pop("CRM_TOKEN", None)  # the tokens come from Secret blocks, never from the environment
    serving = subprocess.Popen(
        [sys.executable, "-c", SERVE],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        _wait(
            lambda: {"deliver-rule", "delivery-requeue"} <= _deployments(api) or serving.poll() is not None,
            START_TIMEOUT,
            "both deployments served",
        )
        assert serving.poll() is None, f"the serving process exited with {serving.returncode}"
        # The runner registers the deployments before it polls: give it its first poll.
        time.sleep(2)
        yield Served(api, url, engine)
    finally:
        stop_group(serving)
        engine.dispose()
        if name is not None:
            db.dispose_engines()
            drop_postgres_database(name)


@pytest.fixture
def world(served: Served, target: TargetServer) -> Iterator[World]:
    """An empty database (the module's) with the usual world applied; the target restored after."""
    with served.engine.begin() as conn:
        for table in reversed(metadata.sorted_tables):
            conn.execute(table.delete())
    original = target.token
    try:
        yield World(served.engine, target).apply()
    finally:
        target.token = original


def run_deployment(served: Served, name: str, parameters: dict[str, Any]) -> Any:
    """Start a run of the deployment through the API, as the UI's "Run" does; wait for its end."""
    from prefect.deployments import run_deployment as start

    def work() -> Any:
        return start(name, parameters=parameters, timeout=RUN_TIMEOUT, poll_interval=0.5)

    flow_run = _call(served.api, work)
    assert flow_run.state is not None and flow_run.state.is_final(), f"{name}: {flow_run.state}"
    return flow_run


def read(served: Served, coroutine: Callable[[Any], Any]) -> Any:
    from prefect import get_client

    async def go() -> Any:
        async with get_client() as client:
            return await coroutine(client)

    return _call(served.api, lambda: asyncio.run(go()))


def artifacts_of(served: Served, flow_run_id: UUID) -> list[Any]:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    return list(
        read(
            served,
            lambda client: client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
            ),
        )
    )


def logs_of(served: Served, flow_run_id: UUID) -> str:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    def text() -> str:
        logs = read(
            served, lambda client: client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        )
        return "\n".join(log.message for log in logs)

    _wait(lambda: "Finished in state" in text(), 30, "the run's last log line", poll=0.3)
    return text()


def save_block(served: Served, name: str, value: str) -> None:
    from prefect.blocks.system import Secret

    _call(served.api, lambda: Secret(value=value).save(name, overwrite=True))


def delete_block(served: Served, name: str) -> None:
    async def delete(client: Any) -> None:
        block = await client.read_block_document_by_name(name, block_type_slug="secret")
        await client.delete_block_document(block.id)

    read(served, delete)


def test_the_requeue_deployment_requeues_records_the_audit_with_its_run_and_lists_them(
    served: Served, world: World
) -> None:
    world.load("p1", "p2", "gone", "kept")
    parked_at = utcnow() - timedelta(hours=1)
    park(world, "p1", "exhausted", last_error="HTTP 422: quota", updated_at=parked_at)
    park(world, "p2", "exhausted", updated_at=parked_at)
    park(world, "gone", "remote_gone", updated_at=parked_at)
    park(world, "kept", "exhausted", last_error="HTTP 400: bad email", updated_at=parked_at)

    run = run_deployment(
        served,
        "delivery-requeue/delivery-requeue",
        {"rule": RULE, "statuses": ["exhausted", "remote_gone"], "error_contains": "HTTP 4", "by": "ui-operator"},
    )
    assert run.state.is_completed(), run.state
    rows = world.ledger()
    assert {k: r["status"] for k, r in rows.items()} == {
        "p1": "failed",
        "kept": "failed",
        "p2": "exhausted",
        "gone": "remote_gone",
    }
    with served.engine.connect() as conn:
        [entry] = [r._asdict() for r in conn.execute(sa.select(requeues_table))]
    assert entry["flow_run_id"] == str(run.id)
    assert entry["requested_by"] == "ui-operator" and sorted(entry["external_ids"]) == ["kept", "p1"]
    artifacts = {a.key: a for a in artifacts_of(served, run.id)}
    artifact = artifacts["requeue-contacts-to-crm"]
    assert artifact.type == "table" and "requeued 2 record(s)" in (artifact.description or "")
    assert "p1" in str(artifact.data) and "kept" in str(artifact.data)
    # The rule's parked set, refreshed: what is still parked.
    parked = artifacts["parked-contacts-to-crm"]
    assert parked.type == "markdown" and (parked.description or "").startswith("contacts-to-crm: 2 records parked")
    # Named and tagged after the rule, as a chain's run is.
    assert run.name == "requeue contacts-to-crm"
    assert {"rule:contacts-to-crm", "target:crm"} <= set(run.tags)
    # (Every refusal: tests/integration/test_requeue_flow.py.)


def log_records(served: Served, flow_run_id: UUID) -> list[Any]:
    """The run's log records, once its last line is in."""
    logs_of(served, flow_run_id)
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    return list(
        read(served, lambda client: client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))))
    )


def test_a_requeue_refused_on_a_worker_logs_one_error_line_and_no_traceback(served: Served, world: World) -> None:
    """Run by the serving process, as from the UI's Run: Prefect's engine raises a Failed run's fault
    again as the run ends and would log "Engine execution exited with unexpected exception" and a
    traceback to the run. A refused requeue's run holds one ERROR line: the fault and what to do."""
    run = run_deployment(served, "delivery-requeue/delivery-requeue", {"rule": "no-such-rule", "dry_run": True})
    assert run.state.is_failed() and run.state.name == "Failed" and "fault:UnknownName" in run.tags
    assert run.state.message == "UnknownName: no rule named 'no-such-rule'"
    assert run.name == "requeue no-such-rule (dry run)"
    records = log_records(served, run.id)
    errors = [r.message for r in records if r.level >= logging.ERROR]
    assert errors == [
        "requeue of no-such-rule not done: no rule named 'no-such-rule'. Nothing was changed; check the rule's "
        "name (`delivery status` or the delivery-status artifact lists the rules), then run it again."
    ]
    text = "\n".join(r.message for r in records)
    assert "Traceback" not in text and "unexpected exception" not in text


def test_a_token_from_a_secret_block_changed_in_prefect_is_used_by_the_next_chain(served: Served, world: World) -> None:
    block = unique("crm-token")
    world.apply(target={"token_env": None, "token_secret": block})
    world.target.token = FIRST
    save_block(served, block, FIRST)
    world.load("c-1")
    first = run_deployment(served, "deliver-rule/deliver-rule", {"rule": RULE})
    assert first.state.is_completed(), first.state
    assert world.ledger()["c-1"]["status"] == "delivered"
    assert [r.headers["authorization"] for r in world.target.requests] == [f"Bearer {FIRST}"]

    # Rotated at the target and in Prefect; the serving process is the same one.
    world.target.token = SECOND
    save_block(served, block, SECOND)
    world.load("c-2")
    second = run_deployment(served, "deliver-rule/deliver-rule", {"rule": RULE})
    assert second.state.is_completed(), second.state
    assert world.ledger()["c-2"]["status"] == "delivered"
    assert world.target.requests[-1].headers["authorization"] == f"Bearer {SECOND}"

    delete_block(served, block)
    world.load("c-3")
    missing = run_deployment(served, "deliver-rule/deliver-rule", {"rule": RULE})
    assert missing.state.is_failed()
    assert "MissingCredential" in (missing.state.message or "") and repr(block) in (missing.state.message or "")
    assert "c-3" not in world.ledger()

    for run in (first, second, missing):
        shown = f"{run.state.message}\n{logs_of(served, run.id)}"
        assert FIRST not in shown and SECOND not in shown
    with served.engine.connect() as conn:
        written = [repr(tuple(r)) for t in metadata.sorted_tables for r in conn.execute(sa.select(t))]
    assert not any(FIRST in w or SECOND in w for w in written)
