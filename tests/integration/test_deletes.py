"""Deletes (issue 31), in process on SQLite and PostgreSQL, against the real local target: with
`deletes: propagate` a record deleted in the source is deleted in the target only where this rule
delivered it (its ledger row holds a remote id); 2xx and 404 both end `deleted`; a timeout is
retried; a restored record is created again under a new Idempotency-Key; a delete waits for a
create in doubt; the guard stops a chain before a batch would pass `max_deletes_per_chain`, that
batch sending nothing. Each way of sending: one record per transaction, grouped on threads and on
an event loop, and batch calls."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from delivery.apply import apply_config
from delivery.config import parse_config
from delivery.errors import ConfigError, TooManyDeletes
from delivery.requeue import requeue
from delivery.store.requeue import RequeueInputError, Selection
from delivery.store.tables import ledger_table
from tests.integration.world import SHORT_TIMEOUT_SECONDS, World, email
from tests.support import chains
from tests.target_server import Answer, TargetServer

PROPAGATE = {"deletes": "propagate", "retry_schedule_seconds": [60]}

#: The ways a rule's records are sent: settled one by one, grouped (threads or the event loop, as
#: `job_path` chooses), and in batch calls.
SENDING: dict[str, dict[str, Any]] = {
    "per_record": {"settle": "per_record"},
    "grouped": {"settle": "grouped"},
    "batch": {
        "settle": "grouped",
        "batch": {
            "create_path": "contacts/batch",
            "update_path": "contacts/batch",
            "delete_path": "contacts/batch-delete",
        },
    },
}


@pytest.fixture(params=sorted(SENDING))
def sending(request: pytest.FixtureRequest) -> dict[str, Any]:
    return SENDING[str(request.param)]


def world(engine: sa.Engine, target: TargetServer, sending: dict[str, Any], **rule: Any) -> World:
    return World(engine, target, through_prefect=False).apply(target=sending, rule={**PROPAGATE, **rule})


def held_by(target: TargetServer, external_id: str) -> list[dict[str, Any]]:
    return [r for r in target.records("contacts").values() if r.get("email") == email(external_id)]


def deletes_sent(target: TargetServer) -> int:
    """DELETE requests, and items of batch delete calls."""
    return sum(len(r.item_keys) if r.batch else 1 for r in target.requests if r.method == "DELETE")


def test_a_deleted_record_is_deleted_in_the_target_only_where_this_rule_delivered_it(
    engine: sa.Engine, target: TargetServer, sending: dict[str, Any], job_path: str
) -> None:
    w = world(engine, target, sending)
    w.load("a", "b", "c")
    assert w.run()["counts"]["delivered"] == 3
    remote_b = w.ledger()["b"]["remote_id"]
    # d was never delivered by this rule: deleted before any chain saw it.
    w.load("d")
    w.load("d", deleted=True)
    w.load("b", deleted=True)
    report = w.run()
    assert report["counts"]["deleted"] == 1 and report["ended_by"] == "caught_up"
    ledger = w.ledger()
    assert ledger["b"]["status"] == "deleted" and ledger["b"]["remote_id"] is None
    assert "d" not in ledger  # no row, no request
    assert held_by(target, "b") == [] and len(held_by(target, "a")) == 1
    assert deletes_sent(target) == 1
    if not sending.get("batch"):
        (delete,) = [r for r in target.requests if r.method == "DELETE"]
        assert (
            delete.path == f"/api/contacts/{remote_b}" and delete.json is None and "content-type" not in delete.headers
        )
    # Nothing more to do: the deleted row is settled at this change.
    assert sum(w.run()["counts"].values()) == 0
    assert deletes_sent(target) == 1


def test_deletes_ignore_leaves_the_target_as_it_was(engine: sa.Engine, target: TargetServer) -> None:
    w = World(engine, target, through_prefect=False).apply()
    w.load("a")
    w.run()
    w.load("a", deleted=True)
    w.run()
    assert w.ledger()["a"]["status"] == "delivered" and len(held_by(target, "a")) == 1
    assert deletes_sent(target) == 0


def test_a_404_ends_deleted_as_gone_already(engine: sa.Engine, target: TargetServer, sending: dict[str, Any]) -> None:
    w = world(engine, target, sending)
    w.load("a")
    w.run()
    remote = w.ledger()["a"]["remote_id"]
    target.program_remote(remote, Answer.status(404, {"error": "not found"}))
    w.load("a", deleted=True)
    assert w.run()["counts"]["deleted"] == 1
    assert w.ledger()["a"]["status"] == "deleted"


@pytest.mark.parametrize("settle", ["per_record", "grouped"])
def test_a_delete_timed_out_is_sent_again_and_a_refused_one_is_the_records_fault(
    engine: sa.Engine, target: TargetServer, settle: str
) -> None:
    """One record per call (in a batch call a stalled item stalls its neighbours alike)."""
    w = world(engine, target, SENDING[settle], max_attempts=2)
    w.load("a", "b")
    w.run()
    rows = w.ledger()
    w.set_timeout(SHORT_TIMEOUT_SECONDS)
    target.program_remote(rows["a"]["remote_id"], Answer.given_up())
    target.program_remote(rows["b"]["remote_id"], Answer.status(422, {"error": "cannot delete"}))
    w.load("a", "b", deleted=True)
    w.run()
    rows = w.ledger()
    assert rows["a"]["status"] == "failed" and rows["a"]["deleting"]  # its answer never came
    assert rows["b"]["status"] == "failed" and not rows["b"]["deleting"]  # refused: still there
    w.make_due()
    target.program_remote(rows["b"]["remote_id"], Answer.status(422, {"error": "cannot delete"}))
    w.run()
    rows = w.ledger()
    assert rows["a"]["status"] == "deleted" and held_by(target, "a") == []
    assert rows["b"]["status"] == "exhausted" and len(held_by(target, "b")) == 1


def test_a_restored_record_is_created_again_under_a_new_key(
    engine: sa.Engine, target: TargetServer, sending: dict[str, Any]
) -> None:
    w = world(engine, target, sending)
    w.load("a")
    w.run()
    first = w.ledger()["a"]["remote_id"]
    w.load("a", deleted=True)
    w.run()
    w.load("a", deleted=False, note="back")
    assert w.run()["counts"]["delivered"] == 1
    (copy,) = held_by(target, "a")
    assert copy["id"] != first and copy["note"] == "back"
    assert w.ledger()["a"]["remote_id"] == copy["id"]
    keys = [r.headers.get("idempotency-key") for r in target.requests if r.method == "POST" and not r.batch]
    batch_keys = [
        item["idempotency_key"] for r in target.requests if r.method == "POST" and r.batch for item in r.json["items"]
    ]
    assert len(set(keys + batch_keys) - {None}) == 2


def test_a_delete_waits_for_a_create_in_doubt(engine: sa.Engine, target: TargetServer, sending: dict[str, Any]) -> None:
    """The create went out and its answer never came (the target made the record all the same);
    the record is deleted in the source meanwhile: the create is replayed under its key, answered
    with the record it made, which the next chain deletes. No copy is left behind."""
    w = world(engine, target, sending)
    w.set_timeout(SHORT_TIMEOUT_SECONDS)
    if sending.get("batch"):
        target.program_batch(Answer.given_up(), method="POST")
    else:
        target.program(email("a"), Answer.given_up())
    w.load("a")
    w.run()
    row = w.ledger()["a"]
    assert row["status"] == "failed" and row["remote_id"] is None
    _wait_until_held(target, "a")
    w.load("a", deleted=True)
    w.make_due()
    w.run()
    (copy,) = held_by(target, "a")
    row = w.ledger()["a"]
    assert row["status"] == "failed" and row["remote_id"] == copy["id"]  # learnt, to be deleted
    assert deletes_sent(target) == 0
    assert w.run()["counts"]["deleted"] == 1
    assert held_by(target, "a") == [] and w.ledger()["a"]["status"] == "deleted"
    assert len([r for r in target.requests if r.method == "POST"]) == 2  # the create and its replay


def _wait_until_held(target: TargetServer, external_id: str) -> None:
    """The stalled create is applied by the target after its stall: wait for it, not for time."""
    import time

    deadline = time.monotonic() + 30
    while not held_by(target, external_id):
        assert time.monotonic() < deadline, "the stalled create was never applied"
        time.sleep(0.02)


def test_a_restore_after_a_delete_in_doubt_finishes_the_delete_then_creates_anew(
    engine: sa.Engine, target: TargetServer, sending: dict[str, Any]
) -> None:
    w = world(engine, target, sending)
    w.load("a")
    w.run()
    first = w.ledger()["a"]["remote_id"]
    w.set_timeout(SHORT_TIMEOUT_SECONDS)
    if sending.get("batch"):
        target.program_batch(Answer.given_up(), method="DELETE")
    else:
        target.program_remote(first, Answer.given_up())
    w.load("a", deleted=True)
    w.run()
    assert w.ledger()["a"]["deleting"]
    w.load("a", deleted=False, note="back")  # restored before the next chain
    w.make_due()
    w.run()  # the delete is finished first (its answer: 404, done already)
    assert held_by(target, "a") == [] and w.ledger()["a"]["status"] == "failed"
    w.run()  # then the record is created anew
    (copy,) = held_by(target, "a")
    assert copy["id"] != first and copy["note"] == "back"
    row = w.ledger()["a"]
    assert row["status"] == "delivered" and row["remote_id"] == copy["id"] and not row["deleting"]


def test_a_record_deleted_again_before_its_restore_was_created_is_suppressed(
    engine: sa.Engine, target: TargetServer, sending: dict[str, Any]
) -> None:
    """Its copy deleted (a delete in doubt finished), the record restored, then deleted again
    before the next chain created it anew: nothing is sent, and its row ends `suppressed` with no
    remote id (the path the kill test met)."""
    w = world(engine, target, sending)
    w.load("a")
    w.run()
    w.set_timeout(SHORT_TIMEOUT_SECONDS)
    if sending.get("batch"):
        target.program_batch(Answer.given_up(), method="DELETE")
    else:
        target.program_remote(w.ledger()["a"]["remote_id"], Answer.given_up())
    w.load("a", deleted=True)
    w.run()
    w.load("a", deleted=False, note="back")
    w.make_due()
    w.run()  # the delete is finished; the restored record is due to be created anew
    assert w.ledger()["a"]["status"] == "failed" and held_by(target, "a") == []
    w.load("a", deleted=True)
    w.make_due()
    sent = len(target.requests)
    w.run()
    row = w.ledger()["a"]
    assert (row["status"], row["remote_id"]) == ("suppressed", None), row
    assert len(target.requests) == sent and held_by(target, "a") == []


@pytest.mark.parametrize("limit", [0, 2])
def test_the_guard_stops_the_chain_before_a_batch_that_would_pass_the_limit(
    engine: sa.Engine, target: TargetServer, limit: int
) -> None:
    w = world(engine, target, SENDING["grouped"], batch_size=2, max_deletes_per_chain=limit)
    ids = ["a", "b", "c", "d"]
    w.load(*ids)
    w.run()
    w.load(*ids, deleted=True)
    with pytest.raises(TooManyDeletes) as caught:
        chains.drive(engine, w_rule := "contacts-to-crm")
    # The first batch (2 deletes) fits a limit of 2 and went out; the second would make 4.
    sent = 0 if limit == 0 else 2
    assert deletes_sent(target) == sent
    assert str(caught.value) == (
        f"rule {w_rule!r}: this batch would bring the chain's deletes to {sent + 2}, past its "
        f"max_deletes_per_chain of {limit}; the batch sent nothing"
    )
    statuses = sorted(row["status"] for row in w.ledger().values())
    assert statuses == ["deleted"] * sent + ["delivered"] * (4 - sent)
    # The operator raises the limit: the next chain goes on.
    w.apply(target=SENDING["grouped"], rule={**PROPAGATE, "batch_size": 2, "max_deletes_per_chain": 10})
    w.run()
    assert all(row["status"] == "deleted" for row in w.ledger().values())
    assert target.records("contacts") == {}


def test_apply_refuses_propagate_for_a_writer_without_the_delete_verb(engine: sa.Engine, target: TargetServer) -> None:
    w = World(engine, target, through_prefect=False)
    data = w.config(target={"driver": "rest-create-only"}, rule={"policy": "create_only", "deletes": "propagate"})
    with pytest.raises(ConfigError) as caught, engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump(data)))
    assert caught.value.problems == [
        "rules[0].deletes: rule 'contacts-to-crm': deletes 'propagate' needs the 'delete' verb, which driver "
        "'rest-create-only' does not offer (set deletes: ignore, or use a driver that deletes)"
    ]


def test_a_requeue_never_touches_deleted_rows(engine: sa.Engine, target: TargetServer) -> None:
    w = world(engine, target, SENDING["grouped"])
    w.load("a")
    w.run()
    w.load("a", deleted=True)
    w.run()
    with engine.begin() as conn:
        before = conn.execute(sa.select(ledger_table)).one()._asdict()
    assert before["status"] == "deleted"
    with pytest.raises(RequeueInputError, match="only exhausted, remote_gone and failed rows can be requeued"):
        Selection.of(["deleted"])
    with engine.begin() as conn:
        taken = requeue(
            conn, "contacts-to-crm", Selection.of(["exhausted", "remote_gone", "failed"]), "test", dry_run=False
        )
        assert taken == []
        assert conn.execute(sa.select(ledger_table)).one()._asdict() == before


class _Abandoned(BaseException):
    """The in-process kill -9: the chain stops dead between a send and its settle."""


def test_a_record_deleted_again_while_its_new_create_went_unsettled_leaves_no_copy(
    engine: sa.Engine, target: TargetServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleted, restored, its create under the new key sent and the chain killed before the
    settle (the row still says `deleted`), then deleted again: the scan offers it all the same
    (a create went out under its key), the create is replayed to learn the id, and that copy is
    deleted."""
    from delivery.store import ledger as ledger_store

    w = world(engine, target, SENDING["grouped"])
    w.load("a")
    w.run()
    w.load("a", deleted=True)
    w.run()
    w.load("a", note="back")

    def dies(*_args: Any, **_kwargs: Any) -> Any:
        raise _Abandoned

    with monkeypatch.context() as patched:
        patched.setattr(ledger_store, "settle_many", dies)
        patched.setattr(ledger_store, "settle", dies)
        with pytest.raises(_Abandoned):
            chains.drive(engine, "contacts-to-crm")
    assert len(held_by(target, "a")) == 1 and w.ledger()["a"]["status"] == "deleted"
    w.load("a", deleted=True)
    w.run()
    w.run()
    assert held_by(target, "a") == []
    assert w.ledger()["a"]["status"] == "deleted"
