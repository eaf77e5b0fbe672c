"""`delivery-requeue`: the requeue an operator starts from the Prefect UI, run as the real flow on the
Prefect test harness, on SQLite and PostgreSQL. It does what `delivery requeue` does (the same rows,
the same checks), records the same audit row with its flow run id (the CLI's stays null), and
publishes a table artifact of what it changed (`requeue-RULE`; a dry run's `requeue-dry-run-RULE`).
Its Run form explains itself (a description and a plain control per parameter), its run is named
and tagged after the rule, and a requeue refused ends Failed with one ERROR line and no traceback.
Against a real `prefect server start` through the deployment:
tests/acceptance/test_requeue_and_secrets_on_a_server.py."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from delivery.domain import LedgerStatus
from delivery.errors import InputError
from delivery.store import requeue
from delivery.store.tables import requeues_table
from flows.cli import app
from flows.parked_artifact import parked_artifact_key
from flows.requeue import ANY_TIME, DEFAULT_STATUSES, artifact_key, delivery_requeue, run_name
from tests.integration.world import RULE, World
from tests.support.ledger import park, snapshot
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
        return [r._asdict() for r in conn.execute(sa.select(requeues_table).order_by(requeues_table.c.id))]


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
    table, description = artifact(run_id, artifact_key(RULE, dry_run=True))
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
    assert state.message == "UnknownName: no rule named 'no-such-rule'" and state.name == "Failed"
    assert snapshot(rows.engine) == before and audit(rows.engine) == []


def test_a_status_that_cannot_be_requeued_is_refused(rows: World) -> None:
    before = snapshot(rows.engine)
    # The UI offers the three choices only; a run started otherwise is refused by the flow...
    state, _ = run(rule=RULE, statuses=["delivered"])
    assert state.is_failed()
    # ...with the selection's own check, as the CLI's is.
    for status in ("delivered", "suppressed"):
        with pytest.raises(InputError, match="only exhausted, remote_gone and failed rows can be requeued"):
            requeue.Selection.of([status])
    with pytest.raises(InputError, match="'parked' is not a ledger status"):
        requeue.Selection.of(["parked"])
    assert requeue.Selection.of(None).statuses == (LedgerStatus.EXHAUSTED, LedgerStatus.REMOTE_GONE)
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
    assert state.message == "InputError: by: the value is longer than 200 characters" and state.name == "Failed"
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
    assert state.message.startswith(f"InputError: {parameter}: the value holds a ") and state.name == "Failed"
    assert snapshot(rows.engine) == before and audit(rows.engine) == []


def test_a_lone_surrogate_is_refused_by_the_shared_checks() -> None:
    """What an undecodable byte of a command-line argument becomes: no database encodes it."""
    with pytest.raises(requeue.RequeueInputError, match="lone surrogate") as caught:
        requeue.Selection.of(None, ["\udcff"])
    assert caught.value.parameter == "ids"
    with pytest.raises(requeue.RequeueInputError, match="lone surrogate") as caught:
        requeue.check_request(RULE, "\udcff")
    assert caught.value.parameter == "by"


def test_the_audit_column_and_the_check_agree() -> None:
    assert requeues_table.c.requested_by.type.length == requeue.REQUESTED_BY_MAX  # type: ignore[attr-defined]


# -- the Run form ---------------------------------------------------------------------------------


def _nulls(schema: Any, path: str = "$") -> list[str]:
    """Where the schema lets a value be null: the UI shows such a property as a switch between its
    type and "None" ("Property is type None")."""
    found: list[str] = []
    if isinstance(schema, dict):
        if schema.get("type") == "null" or (isinstance(schema.get("type"), list) and "null" in schema["type"]):
            found.append(path)
        for key in ("anyOf", "oneOf", "allOf"):
            if key in schema:
                found.append(f"{path}.{key}")
        for key, value in schema.items():
            found += _nulls(value, f"{path}.{key}")
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            found += _nulls(value, f"{path}[{i}]")
    return found


def served_schema() -> dict[str, Any]:
    """The parameter schema of the deployment as `delivery serve` registers it, read back from the
    API: what the UI's Run form is drawn from."""
    from prefect import get_client

    async def register_and_read() -> dict[str, Any]:
        deployment = await delivery_requeue.ato_deployment(name="delivery-requeue")  # as `delivery serve` does
        deployment_id = await deployment.aapply()
        async with get_client() as client:
            return dict((await client.read_deployment(deployment_id)).parameter_openapi_schema or {})

    return asyncio.run(register_and_read())


def test_the_run_form_describes_every_parameter_and_offers_plain_controls(prefect_api: None) -> None:
    from prefect.utilities.callables import parameter_schema_from_entrypoint

    # What the deployment offers the UI: served (`delivery serve`), and deployed (`prefect deploy`,
    # which reads the signature from the source), the same.
    schema = served_schema()
    from_source = parameter_schema_from_entrypoint("flows/requeue.py:delivery_requeue").model_dump_for_openapi()
    for other in (delivery_requeue.parameters.model_dump_for_openapi(), from_source):
        assert (other["properties"], other["required"]) == (schema["properties"], schema["required"])

    properties = schema["properties"]
    assert list(properties) == ["rule", "statuses", "ids", "error_contains", "since", "dry_run", "by"]
    for name, prop in properties.items():
        assert len(prop.get("description", "")) > 20, f"{name} has no description"
    assert _nulls(schema) == []
    assert schema["required"] == ["rule"]
    # statuses: a multi-select of the three statuses, the default shown.
    assert properties["statuses"]["type"] == "array"
    assert properties["statuses"]["items"] == {"enum": ["exhausted", "remote_gone", "failed"], "type": "string"}
    assert properties["statuses"]["default"] == ["exhausted", "remote_gone"]
    assert "empty list means the same" in properties["statuses"]["description"]
    assert properties["ids"] == {**properties["ids"], "type": "array", "items": {"type": "string"}, "default": []}
    assert properties["error_contains"]["type"] == "string" and properties["error_contains"]["default"] == ""
    assert properties["since"]["format"] == "date-time" and properties["since"]["default"] == "1970-01-01T00:00:00Z"
    assert properties["dry_run"] == {**properties["dry_run"], "type": "boolean", "default": False}
    assert properties["by"]["type"] == "string" and properties["by"]["default"] == ""


def test_the_forms_default_statuses_are_what_a_requeue_takes_when_none_is_named() -> None:
    default = inspect.signature(delivery_requeue.fn).parameters["statuses"].default
    assert default == DEFAULT_STATUSES == tuple(s.value for s in requeue.DEFAULT_STATUSES)
    assert inspect.signature(delivery_requeue.fn).parameters["since"].default == ANY_TIME


def test_the_forms_defaults_select_what_the_old_none_values_did(rows: World) -> None:
    """The form's defaults (the default statuses, an empty list, "", 1970-01-01) and an empty
    statuses list select and record what None did: the CLI's semantics."""
    state, _ = run(rule=RULE, dry_run=True)
    assert state.message == f"would requeue 4 record(s) of {RULE}"
    legacy_values: list[dict[str, Any]] = [
        {"statuses": None, "ids": None, "error_contains": None, "since": None, "by": None},
        {"statuses": []},
    ]
    for legacy in legacy_values:
        state, _ = run(rule=RULE, dry_run=True, **legacy)
        assert state.is_completed() and state.message == f"would requeue 4 record(s) of {RULE}", legacy
    # As the UI sends them: JSON values, the time as text.
    state, _ = run(rule=RULE, statuses=["exhausted"], ids=[], error_contains="", since="2025-05-31T08:00:00Z", by="")
    assert state.is_completed() and state.message.startswith(f"requeued 2 record(s) of {RULE}")
    [entry] = audit(rows.engine)
    assert entry["criteria"] == {
        "statuses": ["exhausted"],
        "external_ids": [],
        "error_contains": None,
        "since": "2025-05-31T08:00:00+00:00",
    }
    state, _ = run(rule=RULE, statuses=["remote_gone"], since=ANY_TIME.isoformat())
    assert state.is_completed() and audit(rows.engine)[-1]["criteria"]["since"] is None


# -- artifacts, run names and tags -----------------------------------------------------------------


def flow_run_of(flow_run_id: str) -> Any:
    from prefect import get_client

    async def read() -> Any:
        async with get_client() as client:
            return await client.read_flow_run(UUID(flow_run_id))

    return asyncio.run(read())


def keys_of(flow_run_id: str) -> set[str]:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async def read() -> list[Any]:
        async with get_client() as client:
            return list(
                await client.read_artifacts(
                    artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(flow_run_id)]))
                )
            )

    return {a.key for a in asyncio.run(read())}


def test_dry_runs_and_requeues_publish_under_keys_of_their_own(rows: World) -> None:
    assert artifact_key(RULE) == "requeue-contacts-to-crm"
    assert artifact_key(RULE, dry_run=True) == "requeue-dry-run-contacts-to-crm"
    state, dry = run(rule=RULE, dry_run=True)
    assert state.is_completed()
    # A dry run changes nothing: the parked set is not published again.
    assert keys_of(dry) == {"requeue-dry-run-contacts-to-crm"}
    state, real = run(rule=RULE, ids=["p1"])
    assert state.is_completed()
    assert keys_of(real) == {"requeue-contacts-to-crm", parked_artifact_key(RULE)}


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_run_is_named_after_the_rule_and_tagged_with_rule_and_target(rows: World, dry_run: bool) -> None:
    state, run_id = run(rule=RULE, dry_run=dry_run, ids=["p1"])
    assert state.is_completed()
    flow_run = flow_run_of(run_id)
    assert flow_run.name == run_name(RULE, dry_run)
    assert flow_run.name == ("requeue contacts-to-crm (dry run)" if dry_run else "requeue contacts-to-crm")
    assert {"rule:contacts-to-crm", "target:crm"} <= set(flow_run.tags)


def test_a_refused_run_is_named_after_what_was_asked_and_tagged_with_no_rule(rows: World) -> None:
    state, run_id = run(rule="no-such-rule", dry_run=True)
    assert state.is_failed()
    flow_run = flow_run_of(run_id)
    assert flow_run.name == "requeue no-such-rule (dry run)"
    assert not any(t.startswith(("rule:", "target:")) for t in flow_run.tags)


# -- a requeue refused: one ERROR line, no traceback -----------------------------------------------

REFUSALS = [
    ({"rule": "no-such-rule"}, "UnknownName", "no rule named 'no-such-rule'", "check the rule's name"),
    ({"rule": RULE, "statuses": ["delivered"]}, "InputError", "statuses: only exhausted", "correct that parameter"),
    ({"rule": RULE, "statuses": "exhausted"}, "InputError", "statuses: Input should be a valid list", "correct"),
    ({"rule": RULE, "since": "last tuesday"}, "InputError", "since: 'last tuesday' is not a time", "correct"),
    ({"rule": RULE, "by": "x" * 201}, "InputError", "by: the value is longer than 200", "correct"),
    ({"rule": "contacts\x00-to-crm"}, "InputError", "rule: the value holds a ", "correct"),
]


def _errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize(("parameters", "name", "fault", "remedy"), REFUSALS, ids=lambda v: str(v)[:30])
def test_a_refused_requeue_logs_one_error_line_without_a_traceback_and_fails(
    rows: World, caplog: pytest.LogCaptureFixture, parameters: dict[str, Any], name: str, fault: str, remedy: str
) -> None:
    before = snapshot(rows.engine)
    with caplog.at_level(logging.INFO):
        state, _ = run(**parameters)
    # Plainly Failed (Prefect's Failed filter and a Failed automation see it), the fault's class the
    # message's first word and the run's tag `fault:CLASS`.
    assert state.is_failed() and state.name == "Failed"
    message = f"{name}: {fault}"
    assert state.message.startswith(message) if name == "InputError" else state.message == message
    assert f"fault:{name}" in flow_run_of(str(state.state_details.flow_run_id)).tags
    [error] = _errors(caplog)
    line = error.getMessage()
    assert "\n" not in line and error.exc_info is None
    assert line.startswith("requeue of ") and fault in line and "Nothing was changed" in line and remedy in line
    assert "Traceback" not in caplog.text
    assert snapshot(rows.engine) == before and audit(rows.engine) == []


def test_a_refused_requeue_run_by_a_worker_logs_no_engine_exception(
    rows: World, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker or `delivery serve` runs the deployment through Prefect's engine, which raises a
    Failed run's fault once more as the run ends and logs it to the run ("Engine execution exited
    with unexpected exception", with a traceback). Run the flow as that engine does; the one line
    stays one line. Through a real served deployment: tests/acceptance/test_requeue_and_secrets_on_a_server.py."""
    from prefect.flow_engine import run_flow
    from prefect.logging.loggers import flow_run_logger

    from delivery.errors import UnknownName

    engine_logger = flow_run_logger(flow_run_id=UUID(int=0))
    with caplog.at_level(logging.INFO), pytest.raises(UnknownName, match="no rule named 'no-such-rule'"):
        run_flow(delivery_requeue, parameters={"rule": "no-such-rule"}, error_logger=engine_logger)  # type: ignore[arg-type]
    [error] = _errors(caplog)
    assert "no rule named 'no-such-rule'" in error.getMessage() and error.exc_info is None
    assert "unexpected exception" not in caplog.text and "Traceback" not in caplog.text


def test_a_caller_of_the_flow_gets_the_refusal_raised(rows: World) -> None:
    from delivery.errors import UnknownName

    with pytest.raises(UnknownName, match="no rule named 'no-such-rule'"):
        delivery_requeue(rule="no-such-rule")
    with pytest.raises(InputError, match="statuses: only exhausted, remote_gone and failed"):
        delivery_requeue(rule=RULE, statuses=["delivered"])  # type: ignore[list-item]
    # A requeue done: its result is the Completed state's data.
    assert delivery_requeue(rule=RULE, ids=["p1"], by="ops")["count"] == 1  # type: ignore[index]
