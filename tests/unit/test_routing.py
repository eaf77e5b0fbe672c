"""The record-fault table (ADR-0029) as a pure function: every fault, with and without a ledger row,
at and below max attempts; and the health gate."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest

from delivery import decisions
from delivery.domain import ChainEnd, Connection, ConnectionStatus, LedgerRow, LedgerStatus, Policy, Rule
from delivery.errors import (
    RecordFault,
    RecordRejected,
    RemoteGone,
    TargetUnavailable,
    Unaddressable,
    UnsendablePayload,
)

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
SCHEDULE = (60, 600)


def _row(**changes: object) -> LedgerRow:
    row = LedgerRow(
        id=1,
        rule_id=1,
        record_id=1,
        status=LedgerStatus.FAILED,
        remote_id=None,
        attempts=1,
        next_attempt_at=NOW,
        last_error="before",
        settled_changed_at=NOW,
        delivered_digest=None,
        create_generation=2,
    )
    return dataclasses.replace(row, **changes)


def _after(row: LedgerRow | None, fault: RecordFault, max_attempts: int = 3, remote_id: str | None = None):  # type: ignore[no-untyped-def]
    return decisions.after_fault(
        row, fault, message="why", max_attempts=max_attempts, schedule=SCHEDULE, now=NOW, remote_id=remote_id
    )


@pytest.mark.parametrize("fault", [TargetUnavailable("503"), RecordRejected("422")])
def test_a_passing_failure_is_failed_with_the_next_attempt_from_the_schedule(fault: RecordFault) -> None:
    first = _after(None, fault)
    assert (first.status, first.attempts, first.next_attempt_at) == (
        LedgerStatus.FAILED,
        1,
        NOW + timedelta(seconds=60),
    )
    second = _after(_row(attempts=1), fault)
    assert (second.status, second.attempts) == (LedgerStatus.FAILED, 2)
    assert second.next_attempt_at == NOW + timedelta(seconds=600)
    assert second.create_generation == 2 and second.last_error == "why"


def test_the_refusal_that_reaches_max_attempts_is_exhausted() -> None:
    outcome = _after(_row(attempts=2), RecordRejected("422"), max_attempts=3)
    assert (outcome.status, outcome.attempts, outcome.next_attempt_at) == (LedgerStatus.EXHAUSTED, 3, None)
    assert outcome.last_error == "gave up after 3 attempts: why"


def test_a_target_failure_that_reaches_max_attempts_awaits_proof() -> None:
    """It may be an outage the breaker has not tripped on yet (ADR-0039): the record stays failed,
    its attempts at the limit, and is parked only if it fails again with the target seen healthy."""
    outcome = _after(_row(attempts=2), TargetUnavailable("503"), max_attempts=3)
    assert (outcome.status, outcome.attempts) == (LedgerStatus.FAILED, 3)
    assert outcome.next_attempt_at is not None


def test_retry_after_defers_the_next_attempt() -> None:
    outcome = _after(None, TargetUnavailable("429", retry_after_seconds=3600))
    assert outcome.next_attempt_at == NOW + timedelta(seconds=3600)


def test_an_update_answered_gone_is_remote_gone_and_keeps_its_remote_id() -> None:
    outcome = _after(_row(remote_id="r-1", delivered_digest="f", status=LedgerStatus.DELIVERED), RemoteGone("404"))
    assert (outcome.status, outcome.remote_id, outcome.delivered_digest) == (LedgerStatus.REMOTE_GONE, "r-1", "f")
    assert outcome.next_attempt_at is None


@pytest.mark.parametrize("fault", [Unaddressable("no id"), UnsendablePayload("NaN")])
def test_unaddressable_and_unsendable_are_exhausted_at_once(fault: RecordFault) -> None:
    outcome = _after(None, fault, max_attempts=5)
    assert (outcome.status, outcome.attempts, outcome.next_attempt_at) == (LedgerStatus.EXHAUSTED, 1, None)


def test_a_create_whose_follow_up_update_failed_keeps_the_id_and_no_delivered_digest() -> None:
    outcome = _after(_row(delivered_digest=None), TargetUnavailable("503"), remote_id="r-9")
    assert (outcome.status, outcome.remote_id, outcome.delivered_digest) == (LedgerStatus.FAILED, "r-9", None)
    assert decisions.choose_verb(_row(remote_id=outcome.remote_id)).value == "update"


def test_a_fault_of_no_known_kind_has_no_outcome() -> None:
    with pytest.raises(TypeError):
        _after(None, RecordFault("?"))


def test_delivered_resets_attempts_and_clears_the_error() -> None:
    outcome = decisions.delivered(_row(attempts=2), "r-1", "digest")
    assert (outcome.status, outcome.attempts, outcome.last_error) == (LedgerStatus.DELIVERED, 0, None)
    assert (outcome.remote_id, outcome.delivered_digest, outcome.create_generation) == ("r-1", "digest", 2)


def _rule(*, enabled: bool = True, source: str = "active", target: str = "active") -> Rule:
    def connection(name: str, status: str) -> Connection:
        return Connection(id=1, name=name, driver="rest", status=ConnectionStatus(status))

    return Rule(
        id=1,
        name="r",
        source=connection("shop", source),
        domain="contact",
        target=connection("crm", target),
        collection="contacts",
        policy=Policy.CREATE_AND_UPDATE,
        batch_size=10,
        overlap_seconds=0,
        max_attempts=3,
        retry_schedule_seconds=SCHEDULE,
        fields=None,
        enabled=enabled,
        cursor=None,
    )


def test_the_gate() -> None:
    assert decisions.gate(_rule()) is None
    assert decisions.gate(_rule(enabled=False)) == (ChainEnd.DISABLED, "rule 'r' is disabled")
    assert decisions.gate(_rule(source="error")) == (
        ChainEnd.ROUTE_CLOSED,
        "route closed: source connection 'shop' is error",
    )
    assert decisions.gate(_rule(target="disabled")) == (
        ChainEnd.ROUTE_CLOSED,
        "route closed: target connection 'crm' is disabled",
    )


def test_create_may_be_a_replay() -> None:
    assert not decisions.create_may_be_a_replay(None, "b")
    assert not decisions.create_may_be_a_replay(_row(create_digest="b"), "b")
    assert decisions.create_may_be_a_replay(_row(create_digest="a"), "b")
    assert not decisions.create_may_be_a_replay(_row(create_digest="a", remote_id="r-1"), "b")
    assert decisions.create_may_be_a_replay(_row(create_digest=None, attempts=1), "b")  # from before intents
    assert not decisions.create_may_be_a_replay(_row(create_digest=None, attempts=0), "b")
