"""`delivery-requeue`: the requeue an operator starts from the Prefect UI, run as the real flow on the
Prefect test harness, on SQLite and PostgreSQL. It does what `delivery requeue` does (the same rows,
the same checks), records the same audit row with its flow run id (the CLI's stays null), and
publishes a table artifact of what it changed. Against a real `prefect server start` through the
deployment: tests/acceptance/test_requeue_and_secrets_on_a_server.py."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from delivery.domain import LedgerStatus
from delivery.errors import InputError
from delivery.store import requeue as requeue_store
from delivery.store.tables import requeues
from flows.cli import app
from flows.requeue import artifact_key, delivery_requeue
from tests.integration.test_requeue_status import park, snapshot
from tests.integration.world import RULE, World
from tests.target_server import TargetServer

NEW = datetime(2025, 6, 1, 8, 0, tzinfo=UTC)
OLD = datetime(2024, 1, 1, 8, 0, tzinfo=UTC)


@pytest.fixture
def rows(prefect_api: None, engine: sa.Engine, target: TargetServer) -> World:
    world = World(engine, target).apply()
    world.load("p1", "p2", "gone", "old", "fresh-failed")
    park(world, "p1", "exhausted", last_error="HTTP 422: quota", updated_at=NEW)
    park(world, "p2", "exhausted", updated_at=NEW)
    park(world, "gone", "remote_gone", last_error="PATCH contacts/r-9: HTTP 404", updated_at=NEW)
    park(world, "old", "exhausted", updated_at=OLD)
    park(world, "fresh-failed", "failed", updated_at=NEW)
    return world


def audit(engine: sa.Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [r._asdict() for r in conn.execute(sa.select(requeues).order_by(requeues.c.id))]


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

    found = asyncio.run(read())
    assert len(found) == 1, found
    data = found[0].data
    return (json.loads(data) if isinstance(data, str) else data), found[0].description or ""


def run(**parameters: Any) -> tuple[Any, str]:
    state = delivery_requeue(**parameters, return_state=True)
    return state, str(state.state_details.flow_run_id)


def test_the_flow_requeues_records_the_audit_with_its_run_and_publishes_what_it_changed(rows: World) -> None:
    gone_generation = rows.full_ledger_row("gone")["create_generation"]
    state, run_id = run(rule=RULE, since=NEW - timedelta(days=1), by="ops-ana")
    assert state.is_completed(), state
    assert state.message == f"requeued 3 record(s) of {RULE} (recorded as requested by ops-ana)"

    for external_id in ("p1", "p2", "gone"):
        row = rows.full_ledger_row(external_id)
        assert row["status"] == "failed" and row["attempts"] == 0 and row["next_attempt_at"] is not None
    gone = rows.full_ledger_row("gone")
    assert gone["remote_id"] is None and gone["create_generation"] == gone_generation + 1
    assert rows.full_ledger_row("old")["status"] == "exhausted"  # parked before `since`
    assert rows.full_ledger_row("fresh-failed")["attempts"] == 1  # failed is not a default status

    [entry] = audit(rows.engine)
    assert entry["flow_run_id"] == run_id
    assert entry["requested_by"] == "ops-ana" and entry["count"] == 3
    assert sorted(entry["external_ids"]) == ["gone", "p1", "p2"]
    assert entry["criteria"]["statuses"] == ["exhausted", "remote_gone"]
    assert entry["criteria"]["since"] == (NEW - timedelta(days=1)).isoformat()

    table, description = artifact(run_id, artifact_key(RULE))
    assert sorted((r["external_id"], r["was"]) for r in table) == [
        ("gone", "remote_gone"),
        ("p1", "exhausted"),
        ("p2", "exhausted"),
    ]
    assert {r["external_id"]: r["last_error"] for r in table}["p1"] == "HTTP 422: quota"
    assert "requeued 3 record(s)" in description and "ops-ana" in description

    # `delivery requeues` shows it, with the run it came from.
    history = json.loads(CliRunner().invoke(app, ["requeues", "--json"]).stdout)
    assert [(h["requested_by"], h["flow_run_id"]) for h in history] == [("ops-ana", run_id)]


def test_selecting_by_status_ids_and_error_text_as_the_cli_does(rows: World) -> None:
    state, run_id = run(
        rule=RULE, statuses=["failed", "exhausted"], ids=["p1", "p2", "fresh-failed"], error_contains="quota"
    )
    assert state.is_completed()
    [entry] = audit(rows.engine)
    assert entry["external_ids"] == ["p1"] and entry["flow_run_id"] == run_id
    assert entry["criteria"] == {
        "statuses": ["failed", "exhausted"],
        "external_ids": ["p1", "p2", "fresh-failed"],
        "error_contains": "quota",
        "since": None,
    }
    # By default the run's own name stands for who asked.
    state, run_id = run(rule=RULE, statuses=["failed"], ids=["fresh-failed"])
    assert state.is_completed()
    second = audit(rows.engine)[-1]
    assert second["external_ids"] == ["fresh-failed"] and second["flow_run_id"] == run_id
    assert second["requested_by"].startswith("delivery-requeue run ")


def test_a_dry_run_lists_what_it_would_requeue_and_changes_nothing(rows: World) -> None:
    before = snapshot(rows.engine)
    state, run_id = run(rule=RULE, dry_run=True)
    assert state.is_completed() and state.message == f"would requeue 4 record(s) of {RULE}"
    assert snapshot(rows.engine) == before
    assert audit(rows.engine) == []
    table, description = artifact(run_id, artifact_key(RULE))
    assert sorted(r["external_id"] for r in table) == ["gone", "old", "p1", "p2"]
    assert "would requeue 4 record(s)" in description and "dry run" in description


def test_nothing_selected_changes_nothing_and_says_so_in_the_artifact(rows: World) -> None:
    state, run_id = run(rule=RULE, ids=["no-such-record"])
    assert state.is_completed() and state.message.startswith(f"requeued 0 record(s) of {RULE}")
    assert audit(rows.engine) == []
    table, _ = artifact(run_id, artifact_key(RULE))
    assert [r["last_error"] for r in table] == ["no record matched"]


def test_an_unknown_rule_fails_the_run_with_a_clear_message(rows: World) -> None:
    before = snapshot(rows.engine)
    state, _ = run(rule="no-such-rule")
    assert state.is_failed()
    assert state.message == "no rule named 'no-such-rule'" and state.name == "UnknownName"
    assert snapshot(rows.engine) == before and audit(rows.engine) == []


def test_a_status_that_cannot_be_requeued_is_refused(rows: World) -> None:
    before = snapshot(rows.engine)
    # Prefect checks the parameter against the three choices the UI offers...
    state, _ = run(rule=RULE, statuses=["delivered"])
    assert state.is_failed()
    # ...and the selection itself checks it again, as the CLI's does.
    for status in ("delivered", "suppressed"):
        with pytest.raises(InputError, match="only exhausted, remote_gone and failed rows can be requeued"):
            requeue_store.Selection.of([status])
    with pytest.raises(InputError, match="'parked' is not a ledger status"):
        requeue_store.Selection.of(["parked"])
    assert requeue_store.Selection.of(None).statuses == (LedgerStatus.EXHAUSTED, LedgerStatus.REMOTE_GONE)
    assert snapshot(rows.engine) == before and audit(rows.engine) == []


def test_the_cli_keeps_recording_the_same_audit_without_a_flow_run(rows: World) -> None:
    result = CliRunner().invoke(app, ["requeue", RULE, "--id", "p1", "--by", "cli-carl", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["count"] == 1
    [entry] = audit(rows.engine)
    assert entry["requested_by"] == "cli-carl" and entry["external_ids"] == ["p1"] and entry["flow_run_id"] is None
    refused = CliRunner().invoke(app, ["requeue", RULE, "--status", "delivered"])
    assert refused.exit_code != 0 and "only exhausted, remote_gone and failed" in str(refused.exception)


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_by_longer_than_the_audit_row_keeps_fails_the_run_and_writes_nothing(rows: World, dry_run: bool) -> None:
    """`requeues.requested_by` holds 200 characters: PostgreSQL used to raise
    StringDataRightTruncation mid-requeue (SQLite kept the 500). Refused before anything is read or
    written, by the same check as `delivery requeue --by`, dry run included."""
    before = snapshot(rows.engine)
    state, _ = run(rule=RULE, by="x" * 201, dry_run=dry_run)
    assert state.is_failed()
    assert state.message == "by: the value is longer than 200 characters" and state.name == "InputError"
    assert snapshot(rows.engine) == before and audit(rows.engine) == []
    state, _ = run(rule=RULE, by="x" * 200, ids=["p1"])
    assert state.is_completed(), state
    assert audit(rows.engine)[0]["requested_by"] == "x" * 200


@pytest.mark.parametrize(
    ("parameters", "parameter"),
    [
        ({"rule": "contacts\x00-to-crm"}, "rule"),
        ({"rule": RULE, "ids": ["p1", "p\x002"]}, "ids"),
        ({"rule": RULE, "error_contains": "HTTP\x00"}, "error_contains"),
        ({"rule": RULE, "by": "ops\x00"}, "by"),
    ],
    ids=["rule", "ids", "error-contains", "by"],
)
def test_a_nul_in_a_parameter_fails_the_run_naming_it(rows: World, parameters: dict[str, Any], parameter: str) -> None:
    """A NUL made PostgreSQL raise a DataError from the look-up (SQLite took it): the run crashed
    with a driver's traceback. (A lone surrogate never reaches a run: Prefect cannot send it.)"""
    before = snapshot(rows.engine)
    state, _ = run(**parameters)
    assert state.is_failed()
    assert state.message.startswith(f"{parameter}: the value holds a ") and state.name == "InputError"
    assert snapshot(rows.engine) == before and audit(rows.engine) == []


def test_a_lone_surrogate_is_refused_by_the_shared_checks() -> None:
    """What an undecodable byte of a command-line argument becomes: no database encodes it."""
    with pytest.raises(requeue_store.RequeueInputError, match="lone surrogate") as caught:
        requeue_store.Selection.of(None, ["\udcff"])
    assert caught.value.parameter == "ids"
    with pytest.raises(requeue_store.RequeueInputError, match="lone surrogate") as caught:
        requeue_store.check_request(RULE, "\udcff")
    assert caught.value.parameter == "by"


def test_the_audit_column_and_the_check_agree() -> None:
    assert requeues.c.requested_by.type.length == requeue_store.REQUESTED_BY_MAX  # type: ignore[attr-defined]
