"""Pure decisions (delivery/decisions.py) and the status/policy vocabulary (delivery/domain.py)."""

from __future__ import annotations

import dataclasses
import re
from datetime import UTC, datetime, timedelta

import pytest

from delivery.decisions import (
    RETRY_AFTER_CAP_SECONDS,
    after_fault,
    awaiting_proof,
    body_digest,
    choose_verb,
    idempotency_key,
    map_payload,
    next_attempt_at,
)
from delivery.domain import TERMINAL_STATUSES, LedgerRow, LedgerStatus, Outcome, Policy, Verb
from delivery.errors import RecordFault, RecordRejected, TargetUnavailable

NOW = datetime(2026, 9, 10, 12, 0, 0, tzinfo=UTC)
SCHEDULE = (60, 300, 1800, 7200)


def ledger_row(remote_id: str | None, status: LedgerStatus = LedgerStatus.DELIVERED) -> LedgerRow:
    return LedgerRow(
        id=1,
        rule_id=1,
        record_id=1,
        status=status,
        remote_id=remote_id,
        attempts=0,
        next_attempt_at=None,
        last_error=None,
        settled_changed_at=None,
        delivered_digest=None,
        create_generation=0,
    )


def delay_of(when: datetime) -> float:
    return (when - NOW).total_seconds()


# --- choose_verb -------------------------------------------------------------------------------


def test_choose_verb_without_a_row_creates() -> None:
    assert choose_verb(None) is Verb.CREATE


@pytest.mark.parametrize("status", list(LedgerStatus))
def test_choose_verb_row_without_remote_id_creates(status: LedgerStatus) -> None:
    assert choose_verb(ledger_row(None, status)) is Verb.CREATE


def test_choose_verb_row_with_empty_remote_id_creates() -> None:
    assert choose_verb(ledger_row("")) is Verb.CREATE


@pytest.mark.parametrize("status", list(LedgerStatus))
def test_choose_verb_row_with_remote_id_updates(status: LedgerStatus) -> None:
    assert choose_verb(ledger_row("r-1", status)) is Verb.UPDATE


def test_choose_verb_remote_id_zero_string_updates() -> None:
    # "0" is a perfectly good id; only absence means create.
    assert choose_verb(ledger_row("0")) is Verb.UPDATE


# --- next_attempt_at ---------------------------------------------------------------------------


@pytest.mark.parametrize(("attempts", "expected"), [(1, 60), (2, 300), (3, 1800), (4, 7200)])
def test_next_attempt_follows_each_schedule_step(attempts: int, expected: int) -> None:
    assert next_attempt_at(NOW, attempts, SCHEDULE) == NOW + timedelta(seconds=expected)


@pytest.mark.parametrize("attempts", [5, 6, 50, 10_000])
def test_next_attempt_last_step_repeats(attempts: int) -> None:
    assert delay_of(next_attempt_at(NOW, attempts, SCHEDULE)) == 7200


@pytest.mark.parametrize("attempts", [0, -1, -100])
def test_next_attempt_clamps_low_attempts_to_first_step(attempts: int) -> None:
    assert delay_of(next_attempt_at(NOW, attempts, SCHEDULE)) == 60


def test_next_attempt_single_step_schedule_repeats() -> None:
    assert [delay_of(next_attempt_at(NOW, n, [42])) for n in (1, 2, 3)] == [42, 42, 42]


def test_next_attempt_accepts_a_list_schedule() -> None:
    assert delay_of(next_attempt_at(NOW, 2, list(SCHEDULE))) == 300


def test_next_attempt_zero_step_is_immediate() -> None:
    assert next_attempt_at(NOW, 1, [0, 10]) == NOW


def test_next_attempt_empty_schedule_falls_back_to_a_minute() -> None:
    assert delay_of(next_attempt_at(NOW, 3, [])) == 60


def test_retry_after_larger_than_step_wins() -> None:
    assert delay_of(next_attempt_at(NOW, 1, SCHEDULE, retry_after_seconds=900)) == 900


def test_retry_after_fractional_larger_than_step_wins() -> None:
    assert delay_of(next_attempt_at(NOW, 1, SCHEDULE, retry_after_seconds=60.5)) == 60.5


def test_retry_after_smaller_than_step_does_not_shorten() -> None:
    assert delay_of(next_attempt_at(NOW, 3, SCHEDULE, retry_after_seconds=5)) == 1800


def test_retry_after_equal_to_step() -> None:
    assert delay_of(next_attempt_at(NOW, 2, SCHEDULE, retry_after_seconds=300)) == 300


def test_retry_after_none_means_schedule() -> None:
    assert delay_of(next_attempt_at(NOW, 2, SCHEDULE, retry_after_seconds=None)) == 300


def test_retry_after_zero_means_schedule() -> None:
    assert delay_of(next_attempt_at(NOW, 2, SCHEDULE, retry_after_seconds=0)) == 300


def test_retry_after_is_capped_at_one_day() -> None:
    assert RETRY_AFTER_CAP_SECONDS == 86_400
    assert delay_of(next_attempt_at(NOW, 1, SCHEDULE, retry_after_seconds=10 * 86_400)) == 86_400


def test_retry_after_infinite_is_capped_at_one_day() -> None:
    assert delay_of(next_attempt_at(NOW, 1, SCHEDULE, retry_after_seconds=float("inf"))) == 86_400


def test_retry_after_exactly_one_day() -> None:
    assert delay_of(next_attempt_at(NOW, 1, SCHEDULE, retry_after_seconds=86_400)) == 86_400


def test_schedule_step_beyond_the_cap_still_wins_over_a_capped_retry_after() -> None:
    # The cap limits what a target can impose; the rule's own schedule may be longer.
    week = 7 * 86_400
    assert delay_of(next_attempt_at(NOW, 1, [week], retry_after_seconds=30 * 86_400)) == week


@pytest.mark.parametrize("negative", [-1, -3600, -1e9])
def test_negative_retry_after_is_ignored(negative: float) -> None:
    assert delay_of(next_attempt_at(NOW, 2, SCHEDULE, retry_after_seconds=negative)) == 300


def test_negative_retry_after_never_schedules_in_the_past() -> None:
    assert next_attempt_at(NOW, 1, [0], retry_after_seconds=-60) == NOW


def test_next_attempt_keeps_the_timezone() -> None:
    assert next_attempt_at(NOW, 1, SCHEDULE).tzinfo is UTC


# --- map_payload -------------------------------------------------------------------------------


def test_map_payload_none_sends_the_whole_payload() -> None:
    payload = {"email": "a@x.io", "name": "A", "nested": {"k": 1}}
    body = map_payload(payload, None)
    assert body == payload


def test_map_payload_none_returns_a_copy() -> None:
    payload = {"email": "a@x.io"}
    body = map_payload(payload, None)
    assert body is not payload
    body["email"] = "changed"
    body["extra"] = 1
    assert payload == {"email": "a@x.io"}


def test_map_payload_renames_target_from_source() -> None:
    payload = {"email": "a@x.io", "full_name": "Ann", "secret": "x"}
    body = map_payload(payload, {"email": "email", "name": "full_name"})
    assert body == {"email": "a@x.io", "name": "Ann"}


def test_map_payload_missing_source_field_is_sent_as_null() -> None:
    body = map_payload({"email": "a@x.io"}, {"email": "email", "phone": "mobile"})
    assert body == {"email": "a@x.io", "phone": None}


def test_map_payload_same_source_twice() -> None:
    body = map_payload({"email": "a@x.io"}, {"login": "email", "contact": "email"})
    assert body == {"login": "a@x.io", "contact": "a@x.io"}


def test_map_payload_keeps_falsy_values() -> None:
    body = map_payload({"a": 0, "b": "", "c": False, "d": None}, {"a": "a", "b": "b", "c": "c", "d": "d"})
    assert body == {"a": 0, "b": "", "c": False, "d": None}


def test_map_payload_empty_payload_whole() -> None:
    assert map_payload({}, None) == {}


# --- body_digest --------------------------------------------------------------------------------


def test_body_digest_is_key_order_independent() -> None:
    assert body_digest({"a": 1, "b": 2}) == body_digest({"b": 2, "a": 1})


def test_body_digest_nested_key_order_independent() -> None:
    assert body_digest({"x": {"a": 1, "b": 2}}) == body_digest({"x": {"b": 2, "a": 1}})


def test_body_digest_differs_on_value_change() -> None:
    assert body_digest({"a": 1}) != body_digest({"a": 2})


def test_body_digest_differs_on_key_change() -> None:
    assert body_digest({"a": 1}) != body_digest({"b": 1})


def test_body_digest_differs_between_null_and_absent() -> None:
    assert body_digest({"a": 1, "b": None}) != body_digest({"a": 1})


def test_body_digest_differs_on_type_change() -> None:
    assert body_digest({"a": 1}) != body_digest({"a": "1"})


def test_body_digest_is_a_sha256_hex_digest() -> None:
    assert re.fullmatch(r"[0-9a-f]{64}", body_digest({"a": 1}))


def test_body_digest_tolerates_non_json_values() -> None:
    when = datetime(2026, 1, 1, tzinfo=UTC)
    assert body_digest({"at": when}) == body_digest({"at": when})


# --- idempotency_key ---------------------------------------------------------------------------


# Literal keys, computed once. A key must never change between releases: a create in flight across
# an upgrade is retried under the key it was first sent with, and a key-honouring target only
# recognises that exact string. The epoch-0 values are what the three-argument form (before key
# epochs existed) gave: sha256(json.dumps(["delivery", rule, external_id, generation]))[:32].
PINNED_KEYS = [
    (("contacts-to-crm", "c-1", 0, 0), "dc0734b7492d7fe80c4ba1fe21319aa5"),
    (("contacts-to-crm", "c-1", 1, 0), "6cb93b612f2edae69911b55db54f8f27"),
    (("contacts-to-crm", "c-2", 0, 0), "0662f8b35131f13bc6773a05e6994671"),
    (("orders-to-erp", "c-1", 0, 0), "f56b2f2052427f6d0cc4a7dcdb7ff9c0"),
    (("contacts-to-crm", "c-1", 0, 1), "ace7cf9096471be977b813f755333766"),
    (("contacts-to-crm", "c-1", 1, 1), "cda491d904e5c131d355d118bd21c344"),
    (("contacts-to-crm", "c-1", 0, 2), "49ae7e358c4b352055041ca2363eecd4"),
]


@pytest.mark.parametrize(("args", "key"), PINNED_KEYS)
def test_idempotency_key_is_pinned_across_releases(args: tuple[str, str, int, int], key: str) -> None:
    rule, external_id, generation, epoch = args
    assert idempotency_key(rule, external_id, generation, epoch=epoch) == key


def test_epoch_zero_is_the_key_of_the_three_argument_form() -> None:
    assert idempotency_key("contacts-to-crm", "c-1", 0) == "dc0734b7492d7fe80c4ba1fe21319aa5"
    assert idempotency_key("contacts-to-crm", "c-1", 0, epoch=0) == idempotency_key("contacts-to-crm", "c-1", 0)


def test_pinned_keys_are_all_different() -> None:
    # Rule, external id, generation and epoch each change the key on their own.
    assert len({key for _, key in PINNED_KEYS}) == len(PINNED_KEYS)


def test_idempotency_key_differs_by_epoch() -> None:
    keys = {idempotency_key("r", "e-1", 3, epoch=epoch) for epoch in (0, 1, 2)}
    assert len(keys) == 3


def test_idempotency_key_is_32_hex_chars() -> None:
    assert re.fullmatch(r"[0-9a-f]{32}", idempotency_key("contacts-to-crm", "e-1", 0))


def test_idempotency_key_differs_by_generation() -> None:
    assert idempotency_key("r", "e-1", 0) != idempotency_key("r", "e-1", 1)


def test_idempotency_key_differs_by_rule() -> None:
    assert idempotency_key("r1", "e-1", 0) != idempotency_key("r2", "e-1", 0)


def test_idempotency_key_differs_by_external_id() -> None:
    assert idempotency_key("r", "e-1", 0) != idempotency_key("r", "e-2", 0)


def test_idempotency_key_has_no_concatenation_ambiguity() -> None:
    assert idempotency_key("ab", "c", 0) != idempotency_key("a", "bc", 0)


# --- LedgerStatus.is_terminal / Policy.verbs ---------------------------------------------------


@pytest.mark.parametrize(
    ("status", "terminal"),
    [
        (LedgerStatus.DELIVERED, False),
        (LedgerStatus.SUPPRESSED, False),
        (LedgerStatus.FAILED, False),
        (LedgerStatus.EXHAUSTED, True),
        (LedgerStatus.REMOTE_GONE, True),
    ],
)
def test_is_terminal(status: LedgerStatus, terminal: bool) -> None:
    assert status.is_terminal is terminal


def test_terminal_set_is_exactly_exhausted_and_remote_gone() -> None:
    assert {s for s in LedgerStatus if s.is_terminal} == {LedgerStatus.EXHAUSTED, LedgerStatus.REMOTE_GONE}
    assert frozenset({LedgerStatus.EXHAUSTED, LedgerStatus.REMOTE_GONE}) == TERMINAL_STATUSES


def test_ledger_status_values() -> None:
    assert [s.value for s in LedgerStatus] == [
        "delivered",
        "suppressed",
        "failed",
        "exhausted",
        "remote_gone",
        "deleted",
    ]


@pytest.mark.parametrize(
    ("policy_value", "verbs"),
    [
        (Policy.CREATE_AND_UPDATE, {Verb.CREATE, Verb.UPDATE}),
        (Policy.CREATE_ONLY, {Verb.CREATE}),
        (Policy.UPDATE_ONLY, {Verb.UPDATE}),
    ],
)
def test_policy_verbs(policy_value: Policy, verbs: set[Verb]) -> None:
    assert policy_value.verbs == frozenset(verbs)
    assert isinstance(policy_value.verbs, frozenset)


def test_policy_from_string() -> None:
    assert Policy("create_only") is Policy.CREATE_ONLY
    with pytest.raises(ValueError):
        Policy("create_onl")


# -- an outage never parks a record (issue 29, point 1) ---------------------------------------------


def _failed(attempts: int) -> LedgerRow:
    return dataclasses.replace(ledger_row(None, LedgerStatus.FAILED), attempts=attempts)


def _after(row: LedgerRow | None, fault: RecordFault, *, healthy: bool, max_attempts: int = 2) -> Outcome:
    return after_fault(
        row, fault, message="m", max_attempts=max_attempts, schedule=[60], now=NOW, target_healthy=healthy
    )


@pytest.mark.parametrize("healthy", [True, False])
def test_the_failure_that_spends_the_last_attempt_never_parks_a_target_failure(healthy: bool) -> None:
    outcome = _after(_failed(1), TargetUnavailable("HTTP 503"), healthy=healthy)
    assert outcome.status is LedgerStatus.FAILED and outcome.attempts == 2
    assert awaiting_proof(_failed(2), max_attempts=2)


def test_awaiting_proof_parks_only_with_the_target_seen_healthy() -> None:
    assert _after(_failed(2), TargetUnavailable("HTTP 503"), healthy=False).status is LedgerStatus.FAILED
    parked = _after(_failed(2), TargetUnavailable("HTTP 503"), healthy=True)
    assert parked.status is LedgerStatus.EXHAUSTED and parked.last_error == "gave up after 3 attempts: m"


def test_a_refusal_on_the_last_attempt_parks_at_once() -> None:
    outcome = _after(_failed(1), RecordRejected("HTTP 422"), healthy=False)
    assert outcome.status is LedgerStatus.EXHAUSTED


def test_max_attempts_one_awaits_proof_after_the_first_target_failure() -> None:
    outcome = _after(None, TargetUnavailable("timed out"), healthy=True, max_attempts=1)
    assert outcome.status is LedgerStatus.FAILED and outcome.attempts == 1
