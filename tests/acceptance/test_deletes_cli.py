"""Deletes through the console script (issue 31), on SQLite and PostgreSQL: `delivery apply`,
`delivery mirror load` (a JSONL line with `"deleted": true`), `delivery preview`, `delivery run`,
`delivery ledger --status deleted`, `delivery status`, against the real local target. A delete is
sent only for a record this rule delivered; a restored record is created again under a new key; the
guard fails the chain before its batch sends anything; a writer without the verb is refused at
apply, exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.support.cli import (
    RULE,
    as_json,
    assert_catalog_empty,
    config,
    contact,
    delivery,
    load,
    ok,
    prefect_env,
    refused,
    write_jsonl,
    write_yaml,
)
from tests.target_server import TargetServer

pytestmark = pytest.mark.through_prefect


@pytest.fixture
def workdir(prefect_api: None, tmp_path: Path) -> Path:
    path = tmp_path / "work"
    path.mkdir()
    return path


def propagating(target: TargetServer, **rule: Any) -> dict[str, Any]:
    return config(target.url, rule={"deletes": "propagate", **rule})


def held(target: TargetServer) -> list[str]:
    return sorted(str(r["email"]).split("@")[0] for r in target.records("contacts").values())


def run(workdir: Path) -> dict[str, Any]:
    result: dict[str, Any] = as_json(delivery("run", RULE, "--json", cwd=workdir, env=prefect_env()))
    return result


def test_a_record_deleted_in_the_source_is_deleted_in_the_target_and_a_restore_creates_it_again(
    workdir: Path, engine: sa.Engine, target: TargetServer
) -> None:
    ok(delivery("apply", write_yaml(workdir, "d.yaml", propagating(target)), cwd=workdir))
    ok(load(workdir, write_jsonl(workdir, "1.jsonl", [contact("a"), contact("b"), contact("c")])))
    assert run(workdir)["counts"]["delivered"] == 3
    first_b = as_json(delivery("ledger", "--rule", RULE, "--json", cwd=workdir))[1]["remote_id"]

    gone = [{**contact("b"), "deleted": True}, contact("d"), {**contact("d"), "deleted": True}]
    ok(load(workdir, write_jsonl(workdir, "2.jsonl", gone[:2])))
    ok(load(workdir, write_jsonl(workdir, "3.jsonl", gone[2:])))
    preview = as_json(delivery("preview", RULE, "--json", cwd=workdir))
    actions = {row["external_id"]: (row["action"], row["reason"]) for row in preview["rows"]}
    assert actions["b"][0] == "delete" and "deleted in the target" in actions["b"][1]
    assert actions["d"] == ("skip", "deleted in the source: this rule never delivered it, so nothing is deleted")
    assert preview["counts"]["delete"] == 1
    human = ok(delivery("preview", RULE, cwd=workdir)).stdout
    assert "counts: 0 create, 0 update, 1 delete, 0 suppress, 1 skip" in human

    result = run(workdir)
    assert result["state"] == "COMPLETED" and result["counts"]["deleted"] == 1
    assert held(target) == ["a", "c"]
    deletes = [r for r in target.requests if r.method == "DELETE"]
    assert [r.path for r in deletes] == [f"/api/contacts/{first_b}"]  # none for d: never delivered
    listed = as_json(delivery("ledger", "--rule", RULE, "--status", "deleted", "--json", cwd=workdir))
    assert [(r["external_id"], r["status"], r["remote_id"]) for r in listed] == [("b", "deleted", None)]
    (status,) = as_json(delivery("status", "--json", cwd=workdir))
    assert status["counts"]["deleted"] == 1 and status["counts"]["delivered"] == 2
    table = ok(delivery("status", cwd=workdir)).stdout
    assert "2, 1 deleted" in table

    ok(load(workdir, write_jsonl(workdir, "4.jsonl", [contact("b", note="back")])))
    assert run(workdir)["counts"]["delivered"] == 1
    assert held(target) == ["a", "b", "c"]
    keys = [r.headers["idempotency-key"] for r in target.requests if r.method == "POST" and r.key == "b@example.com"]
    assert len(keys) == 2 and keys[0] != keys[1]
    (copy,) = [r for r in target.records("contacts").values() if r["email"] == "b@example.com"]
    assert copy["id"] != first_b and copy["note"] == "back"


def test_the_guard_fails_the_chain_before_its_batch_sends_a_delete(
    workdir: Path, engine: sa.Engine, target: TargetServer
) -> None:
    ok(delivery("apply", write_yaml(workdir, "d.yaml", propagating(target, max_deletes_per_chain=1)), cwd=workdir))
    ok(load(workdir, write_jsonl(workdir, "1.jsonl", [contact("a"), contact("b"), contact("c")])))
    run(workdir)
    ok(load(workdir, write_jsonl(workdir, "2.jsonl", [{**contact(i), "deleted": True} for i in ("a", "b")])))
    proc = delivery("run", RULE, "--json", cwd=workdir, env=prefect_env())
    assert proc.returncode == 1, proc.stderr
    result = json.loads(proc.stdout)
    assert result["state"] == "FAILED" and result["ended_by"] == "rule_fault"
    assert "TooManyDeletes" in result["message"]
    assert "bring the chain's deletes to 2, past its max_deletes_per_chain of 1" in result["message"]
    assert not [r for r in target.requests if r.method == "DELETE"]
    assert held(target) == ["a", "b", "c"]
    # The operator raises the limit: the next chain deletes both.
    ok(delivery("apply", write_yaml(workdir, "d.yaml", propagating(target, max_deletes_per_chain=5)), cwd=workdir))
    assert run(workdir)["counts"]["deleted"] == 2
    assert held(target) == ["c"]


def test_apply_refuses_propagate_for_a_driver_without_the_delete_verb_exit_2(
    workdir: Path, engine: sa.Engine, target: TargetServer
) -> None:
    data = config(
        target.url, target={"driver": "rest-update-only"}, rule={"policy": "update_only", "deletes": "propagate"}
    )
    refused(
        delivery("apply", write_yaml(workdir, "bad.yaml", data), cwd=workdir),
        "rules[0].deletes: rule 'contacts-to-crm': deletes 'propagate' needs the 'delete' verb, "
        "which driver 'rest-update-only' does not offer",
    )
    assert_catalog_empty(engine)
