"""How the `parked-RULE` artifact groups last errors into reasons (`flows.parked_artifact.error_reason`)
and words its first sentence: pure functions, no database."""

from __future__ import annotations

import pytest

from delivery.store.ledger import CREATE_IN_FLIGHT
from flows.parked_artifact import error_reason, headline, parked_artifact_key


@pytest.mark.parametrize(
    ("last_error", "reason"),
    [
        ('gave up after 5 attempts: POST contacts: HTTP 400: {"error": "bad email"}', "HTTP 400 (Bad Request)"),
        ("gave up after 1 attempt: POST contacts: HTTP 409: taken", "HTTP 409 (Conflict)"),
        ("PATCH contacts/r-9: HTTP 404: not here", "HTTP 404 (Not Found)"),
        ("PATCH contacts/a%3Ab: HTTP 410: gone", "HTTP 410 (Gone)"),
        ("POST contacts: HTTP 503: down for maintenance", "HTTP 503 (Service Unavailable)"),
        ("POST contacts: HTTP 599: odd", "HTTP 599"),
        ("POST contacts: timed out (ReadTimeout)", "timed out (ReadTimeout)"),
        ("POST contacts: connection error: [Errno 111] Connection refused", "connection error"),
        ("POST contacts: body cannot be encoded as JSON: Out of range float values", "body cannot be encoded as JSON"),
        (
            "POST contacts: HTTP 201 answer has no usable 'id': {}",
            "HTTP 201 answer has no usable 'id'",
        ),
        ("requeued by ops-ana (was exhausted: POST contacts: HTTP 400: x)", "requeued, not sent yet"),
        (CREATE_IN_FLIGHT, "create sent, outcome not recorded yet"),
        ("HTTP 500", "HTTP 500 (Internal Server Error)"),
        ("HTTP 502: bad gateway", "HTTP 502 (Bad Gateway)"),
        ("DELETE x: HTTP 409: no", "HTTP 409 (Conflict)"),
        ("first line only\nsecond: line", "first line only"),
        ("x" * 500, "x" * 80),
        (None, "no error recorded"),
        ("   ", "no error recorded"),
    ],
)
def test_a_last_error_counts_under_its_first_words(last_error: str | None, reason: str) -> None:
    assert error_reason(last_error) == reason


def test_the_headline_says_plainly_what_is_parked_and_waiting() -> None:
    none = {"exhausted": 0, "remote_gone": 0, "failed": 0}
    assert headline("contacts-to-crm", none) == "contacts-to-crm: nothing parked, no failed row waiting"
    assert (
        headline("contacts-to-crm", {**none, "failed": 1})
        == "contacts-to-crm: nothing parked; 1 failed row waiting for its next attempt"
    )
    assert headline("r", {**none, "exhausted": 1}) == "r: 1 record parked (1 exhausted)"
    assert (
        headline("r", {"exhausted": 2, "remote_gone": 1, "failed": 3})
        == "r: 3 records parked (2 exhausted, 1 remote_gone); 3 failed rows waiting for their next attempt"
    )


def test_the_key_is_one_per_rule_in_prefects_key_characters() -> None:
    assert parked_artifact_key("contacts-to-crm") == "parked-contacts-to-crm"
    assert parked_artifact_key("Orders_To ERP") == "parked-orders-to-erp"
    assert parked_artifact_key("__") == "parked-rule"
