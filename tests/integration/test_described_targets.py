"""Real CRMs from configuration alone (issue 30): the `rest` driver described by request templates,
auth kinds and `nulls`, delivering to contract fakes that check what each vendor checks
(tests/vendor_targets.py). Chains run in this process, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
import yaml

from delivery.apply import apply_config
from delivery.config import parse_config
from delivery.domain import MirrorInput
from delivery.errors import Unauthorized
from delivery.store.mirror import load_records
from delivery.store.tables import oauth_refresh_tokens_table
from delivery.writers.oauth2 import forget_token_sources
from tests.support.chains import drive
from tests.vendor_targets import (
    API_KEY,
    CLIENT_ID,
    CLIENT_SECRET,
    REFRESH_TOKEN,
    ZENDESK_TOKEN,
    ZENDESK_USER,
    VendorServer,
)

RULE = "contacts-out"

HUBSPOT = {
    "requests": {
        "create": {
            "path": "crm/v3/objects/{{ collection }}",
            "body": {"properties": "{{ fields }}", "associations": []},
            "id_at": "id",
        },
        "update": {"path": "crm/v3/objects/{{ collection }}/{{ remote_id }}", "body": {"properties": "{{ fields }}"}},
        "delete": {"path": "crm/v3/objects/{{ collection }}/{{ remote_id }}"},
    },
    "auth": {
        "kind": "oauth2",
        "token_url": "{url}/oauth/v1/token",
        "grant": "refresh_token",
        "client_id_env": "HS_CLIENT_ID",
        "client_secret_env": "HS_CLIENT_SECRET",
        "refresh_token_env": "HS_REFRESH_TOKEN",
        "scope": "crm.objects.contacts.write",
    },
}
HUBSPOT_BATCH = {
    **HUBSPOT,
    "batch": {
        "max_items": 100,
        "create": {
            "path": "crm/v3/objects/{{ collection }}/batch/create",
            "body": {"inputs": "{{ items }}"},
            "item": {
                "properties": "{{ fields }}",
                "associations": [],
                "objectWriteTraceId": "{{ idempotency_key }}",
            },
            "results_at": "results",
            "match": "objectWriteTraceId",
            "id_at": "id",
        },
        "update": {
            "method": "POST",
            "path": "crm/v3/objects/{{ collection }}/batch/update",
            "body": {"inputs": "{{ items }}"},
            "item": {"id": "{{ remote_id }}", "properties": "{{ fields }}"},
            "results_at": "results",
            "match": "id",
        },
        "delete": {"path": "crm/v3/objects/{{ collection }}/batch/archive", "body": {"inputs": "{{ items }}"}},
    },
}
SALESFORCE = {
    "requests": {
        "create": {
            "method": "PATCH",
            "path": "services/data/v60.0/sobjects/Contact/External_Id__c/{{ external_id }}",
            "id_at": "id",
        },
        "update": {"path": "services/data/v60.0/sobjects/Contact/{{ remote_id }}"},
        "delete": {"path": "services/data/v60.0/sobjects/Contact/{{ remote_id }}"},
    },
    "auth": {
        "kind": "oauth2",
        "token_url": "{url}/services/oauth2/token",
        "grant": "client_credentials",
        "client_id_env": "HS_CLIENT_ID",
        "client_secret_env": "HS_CLIENT_SECRET",
    },
}
INTERCOM = {
    "headers": {"Intercom-Version": "2.11"},
    "requests": {
        "create": {
            "path": "contacts",
            "body": {
                "role": "user",
                "external_id": "{{ external_id }}",
                "email": "{{ record.email }}",
                "name": "{{ record.name }}",
            },
        },
        "update": {
            "method": "PUT",
            "path": "contacts/{{ remote_id }}",
            "body": {"email": "{{ record.email }}", "name": "{{ record.name }}"},
        },
        "delete": {"path": "contacts/{{ remote_id }}"},
    },
    "auth": {"kind": "bearer", "token_env": "IC_TOKEN"},
}
ZENDESK = {
    "requests": {
        "create": {"path": "api/v2/users", "body": {"user": "{{ fields }}"}, "id_at": "user.id"},
        "update": {"method": "PUT", "path": "api/v2/users/{{ remote_id }}", "body": {"user": "{{ fields }}"}},
    },
    "auth": {"kind": "basic", "username_env": "ZD_USER", "password_env": "ZD_TOKEN"},
}


@pytest.fixture(autouse=True)
def _secrets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name, value in {
        "HS_CLIENT_ID": CLIENT_ID,
        "HS_CLIENT_SECRET": CLIENT_SECRET,
        "HS_REFRESH_TOKEN": REFRESH_TOKEN,
        "IC_TOKEN": API_KEY,
        "ZD_USER": ZENDESK_USER,
        "ZD_TOKEN": ZENDESK_TOKEN,
    }.items():
        monkeypatch.setenv(name, value)
    forget_token_sources()
    yield
    forget_token_sources()


def _apply(engine: sa.Engine, url: str, described: dict[str, Any], **rule: Any) -> None:
    connection = yaml.safe_load(yaml.safe_dump(described).replace("{url}", url))
    config = {
        "connections": [{"name": "crm", "driver": "rest", "base_url": url, **connection}, {"name": "shop"}],
        "rules": [
            {
                "name": RULE,
                "source": "shop",
                "domain": "contact",
                "target": "crm",
                "collection": "contacts",
                "max_attempts": 2,
                "retry_schedule_seconds": [1],
                **rule,
            }
        ],
    }
    with engine.begin() as conn:
        apply_config(conn, parse_config(yaml.safe_dump(config)))


def _load(engine: sa.Engine, records: dict[str, dict[str, Any]]) -> None:
    with engine.begin() as conn:
        load_records(conn, "shop", "contact", [MirrorInput(k, v) for k, v in records.items()])


def _ledger(engine: sa.Engine) -> dict[str, dict[str, Any]]:
    from delivery.store import ledger

    with engine.connect() as conn:
        return {row["external_id"]: row for row in ledger.ledger_rows(conn, RULE)}


def _contacts(n: int, **extra: str) -> dict[str, dict[str, Any]]:
    return {f"c-{i}": {"email": f"c{i}@example.com", "firstname": f"Name {i}", **extra} for i in range(n)}


def test_hubspot_with_an_oauth2_token_refreshed_and_a_properties_wrapper(engine: sa.Engine) -> None:
    with VendorServer() as hubspot:
        _apply(engine, hubspot.url, HUBSPOT)
        _load(engine, _contacts(3))
        report = drive(engine, RULE)
        assert report.counts["delivered"] == 3, report
        held = hubspot.state.hubspot
        assert sorted(c["properties"]["email"] for c in held.values()) == [f"c{i}@example.com" for i in range(3)]
        assert len(hubspot.state.token_requests) == 1
        form = hubspot.state.token_requests[0]
        assert form == {
            "grant_type": "refresh_token",
            "refresh_token": REFRESH_TOKEN,
            "client_id": CLIENT_ID,
            "client_secret": CLIENT_SECRET,
            "scope": "crm.objects.contacts.write",
        }
        _load(engine, _contacts(3, firstname="Changed"))
        assert drive(engine, RULE).counts["delivered"] == 3
        assert {c["properties"]["firstname"] for c in held.values()} == {"Changed"}
        patches = [r for r in hubspot.state.requests if r.method == "PATCH"]
        assert len(patches) == 3 and all(set(r.body) == {"properties"} for r in patches)
        ids = {row["remote_id"] for row in _ledger(engine).values()}
        assert ids == set(held)


def test_a_token_that_expires_during_a_chain_is_renewed_once_per_expiry_and_nothing_fails(engine: sa.Engine) -> None:
    with VendorServer(token_lifetime=1) as hubspot:
        _apply(engine, hubspot.url, HUBSPOT)
        _load(engine, _contacts(2))
        assert drive(engine, RULE).counts["delivered"] == 2
        first = len(hubspot.state.token_requests)
        hubspot.expire_sessions()  # the token the process holds is refused from now on: a 401
        _load(engine, _contacts(2, firstname="Again"))
        report = drive(engine, RULE)
        assert report.counts["delivered"] == 2 and report.counts["failed"] == 0, report
        assert len(hubspot.state.token_requests) == first + 1  # renewed once, on the 401


def test_a_revoked_refresh_token_fails_the_chain_unauthorized_and_spends_no_attempt(engine: sa.Engine) -> None:
    with VendorServer() as hubspot:
        hubspot.revoke()
        _apply(engine, hubspot.url, HUBSPOT)
        _load(engine, _contacts(2))
        with pytest.raises(Unauthorized) as caught:
            drive(engine, RULE)
        message = str(caught.value)
        assert "'crm'" in message and "refresh_token grant" in message and "invalid_grant" in message
        assert CLIENT_SECRET not in message and REFRESH_TOKEN not in message
        assert _ledger(engine) == {}  # no attempt spent, no intent left


def test_a_rotated_refresh_token_is_kept_for_the_next_process(engine: sa.Engine) -> None:
    with VendorServer(rotate=True) as hubspot:
        _apply(engine, hubspot.url, HUBSPOT)
        _load(engine, _contacts(1))
        assert drive(engine, RULE).counts["delivered"] == 1
        with engine.connect() as conn:
            kept = conn.execute(sa.select(oauth_refresh_tokens_table.c.refresh_token)).scalar_one()
        assert kept != REFRESH_TOKEN and kept in hubspot.state.refresh_tokens
        forget_token_sources()  # a new process: no token in memory
        hubspot.expire_sessions()
        _load(engine, _contacts(1, firstname="Next"))
        assert drive(engine, RULE).counts["delivered"] == 1  # the configured token no longer works
        assert hubspot.state.token_requests[-1]["refresh_token"] == kept


def test_salesforce_upsert_as_the_create_verb_makes_no_copies(engine: sa.Engine) -> None:
    with VendorServer() as salesforce:
        salesforce.state.salesforce["003existing"] = {"External_Id__c": "c-0", "LastName": "Old"}
        _apply(engine, salesforce.url, SALESFORCE, fields={"LastName": "last", "Email": "email"})
        _load(engine, {f"c-{i}": {"last": f"Last {i}", "email": f"c{i}@x.io"} for i in range(2)})
        assert drive(engine, RULE).counts["delivered"] == 2
        held = salesforce.state.salesforce
        assert len(held) == 2 and held["003existing"]["LastName"] == "Last 0"  # matched, not copied
        assert _ledger(engine)["c-0"]["remote_id"] == "003existing"
        salesforce.expire_sessions()  # no expires_in: the token is kept until a 401
        _load(engine, {"c-1": {"last": "Changed", "email": "c1@x.io"}})
        assert drive(engine, RULE).counts["delivered"] == 1
        assert len(salesforce.state.token_requests) == 2


def test_intercom_flat_bodies_and_its_version_header(engine: sa.Engine) -> None:
    with VendorServer() as intercom:
        _apply(engine, intercom.url, INTERCOM)
        _load(engine, {"c-1": {"email": "a@x.io", "name": "A"}})
        assert drive(engine, RULE).counts["delivered"] == 1
        _load(engine, {"c-1": {"email": "a@x.io", "name": "B"}})
        assert drive(engine, RULE).counts["delivered"] == 1
        (held,) = intercom.state.intercom.values()
        assert held["name"] == "B" and held["external_id"] == "c-1" and held["role"] == "user"


def test_zendesk_basic_auth_and_an_id_inside_the_answer(engine: sa.Engine) -> None:
    with VendorServer() as zendesk:
        _apply(engine, zendesk.url, ZENDESK)
        _load(engine, {"c-1": {"email": "a@x.io", "name": "A"}})
        assert drive(engine, RULE).counts["delivered"] == 1
        (held,) = zendesk.state.zendesk.values()
        assert _ledger(engine)["c-1"]["remote_id"] == str(held["id"])


def test_a_value_the_template_needs_and_the_record_lacks_refuses_that_record_only(engine: sa.Engine) -> None:
    with VendorServer() as intercom:
        _apply(engine, intercom.url, INTERCOM)
        _load(engine, {"c-1": {"name": "no email"}, "c-2": {"email": "b@x.io", "name": "B"}})
        report = drive(engine, RULE)
        assert report.counts["delivered"] == 1 and report.counts["failed"] == 1
        row = _ledger(engine)["c-1"]
        assert row["status"] == "failed" and row["attempts"] == 1
        assert row["last_error"] == "POST contacts: the record has no value for {{ record.email }}; nothing was sent"
        assert [r.body["email"] for r in intercom.state.requests] == ["b@x.io"]


@pytest.mark.parametrize("nulls", ["send", "skip"])
def test_nulls_send_or_skip(engine: sa.Engine, nulls: str) -> None:
    with VendorServer() as zendesk:
        _apply(engine, zendesk.url, ZENDESK, fields={"email": "email", "phone": "phone"}, nulls=nulls)
        _load(engine, {"c-1": {"email": "a@x.io"}})
        assert drive(engine, RULE).counts["delivered"] == 1
        (sent,) = [r.body["user"] for r in zendesk.state.requests]
        assert sent == ({"email": "a@x.io", "phone": None} if nulls == "send" else {"email": "a@x.io"})


def test_the_blocks_of_docs_targets_are_the_ones_tested() -> None:
    """docs/targets.md shows each vendor's block: its requests and headers are exactly the ones
    these tests deliver with, and its auth is of the same kind and grant; each block applies."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "targets.md").read_text(encoding="utf-8")
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)]
    shown = {}
    for block in blocks:
        if "rules" not in block:
            block = {"connections": block if isinstance(block, list) else block["connections"]}
        config = {"connections": [*block["connections"], {"name": "shop"}], "rules": block.get("rules", [])}
        parse_config(yaml.safe_dump(config))
        shown[block["connections"][0]["name"]] = block["connections"][0]
    for name, tested in (
        ("hubspot", HUBSPOT_BATCH),
        ("salesforce", SALESFORCE),
        ("intercom", INTERCOM),
        ("zendesk", ZENDESK),
    ):
        assert shown[name]["requests"] == tested["requests"], name
        assert shown[name].get("batch") == tested.get("batch"), name
        assert shown[name].get("headers") == tested.get("headers"), name
        for key in ("kind", "grant"):
            assert shown[name]["auth"].get(key) == tested["auth"].get(key), name


def test_eight_requests_in_flight_meeting_an_expired_token_renew_it_once(engine: sa.Engine) -> None:
    with VendorServer() as hubspot:
        _apply(engine, hubspot.url, HUBSPOT, concurrency=8)
        _load(engine, _contacts(16))
        assert drive(engine, RULE).counts["delivered"] == 16
        hubspot.expire_sessions()
        _load(engine, _contacts(16, firstname="Again"))
        report = drive(engine, RULE)
        assert report.counts["delivered"] == 16 and report.counts["failed"] == 0, report
        assert len(hubspot.state.token_requests) == 2


def test_hubspot_batch_create_and_update_with_results_in_shuffled_order(engine: sa.Engine) -> None:
    with VendorServer() as hubspot:
        _apply(engine, hubspot.url, HUBSPOT_BATCH, batch_size=40)
        _load(engine, _contacts(30))
        assert drive(engine, RULE).counts["delivered"] == 30
        assert [call for call in hubspot.state.batch_calls] == [("create", 30)]
        ledger = _ledger(engine)
        held = hubspot.state.hubspot
        # Each record got the id of its own contact, whatever order the results came in.
        assert {k: held[row["remote_id"]]["properties"]["email"] for k, row in ledger.items()} == {
            f"c-{i}": f"c{i}@example.com" for i in range(30)
        }
        _load(engine, _contacts(30, firstname="Batch"))
        assert drive(engine, RULE).counts["delivered"] == 30
        assert hubspot.state.batch_calls[-1] == ("update", 30)
        assert {c["properties"]["firstname"] for c in held.values()} == {"Batch"}


def test_a_batch_update_item_no_result_speaks_for_is_in_doubt_and_sent_again(engine: sa.Engine) -> None:
    with VendorServer() as hubspot:
        _apply(engine, hubspot.url, HUBSPOT_BATCH)
        _load(engine, _contacts(3))
        assert drive(engine, RULE).counts["delivered"] == 3
        gone = _ledger(engine)["c-1"]["remote_id"]
        del hubspot.state.hubspot[gone]  # HubSpot leaves it out of the results
        _load(engine, _contacts(3, firstname="New"))
        report = drive(engine, RULE)
        assert report.counts["delivered"] == 2 and report.counts["failed"] == 1, report
        row = _ledger(engine)["c-1"]
        assert row["status"] == "failed" and row["in_doubt"] and "no result has id" in row["last_error"]


def test_a_chain_running_across_token_expiries_renews_once_per_expiry_and_fails_nothing(engine: sa.Engine) -> None:
    """Tokens living 2 s, renewed 0.2 s before they run out, a chain of about 3 s: each renewal is
    one token request, and no request meets an expired token (no 401, nothing failed)."""
    import time

    with VendorServer(token_lifetime=2) as hubspot:
        hubspot.state.latency = 0.1
        _apply(engine, hubspot.url, HUBSPOT)
        _load(engine, _contacts(30))
        started = time.monotonic()
        report = drive(engine, RULE)
        seconds = time.monotonic() - started
        assert report.counts["delivered"] == 30 and report.counts["failed"] == 0, report
        tokens = len(hubspot.state.token_requests)
        assert 2 <= tokens <= seconds / 1.8 + 1, (tokens, seconds)


def test_an_auth_secret_from_a_prefect_secret_block_and_a_missing_one(engine: sa.Engine) -> None:
    """`*_secret` names a Prefect Secret block, read through the reader the flows layer gives the
    chain (a dict here; through Prefect in test_secret_tokens); a block that holds nothing fails the
    chain `MissingCredential` naming it, before anything is sent."""
    from delivery.chain import Chain
    from delivery.domain import Phase
    from delivery.errors import MissingCredential
    from delivery.phase import run_phase

    with_block = {**ZENDESK, "auth": {"kind": "basic", "username_env": "ZD_USER", "password_secret": "zd-token"}}
    with VendorServer() as zendesk:
        _apply(engine, zendesk.url, with_block)
        _load(engine, {"c-1": {"email": "a@x.io", "name": "A"}})
        chain = Chain(engine, RULE)
        assert chain.open(secrets={"zd-token": ZENDESK_TOKEN}.get) is None
        for phase in (Phase.DRAIN, Phase.SCAN):
            run_phase(chain, phase, chain.run_batch)
        assert chain.finish().counts["delivered"] == 1
        with pytest.raises(MissingCredential) as caught:
            Chain(engine, RULE).open(secrets={}.get)
        assert "the Prefect Secret block 'zd-token'" in str(caught.value)
        assert len(zendesk.state.requests) == 1


@pytest.mark.parametrize("vendor", ["hubspot", "hubspot-batch", "salesforce", "intercom"])
def test_a_propagated_delete_reaches_each_vendor_as_it_documents(engine: sa.Engine, vendor: str) -> None:
    """HubSpot archives with DELETE (204, no body) or its batch archive (204, no results);
    Salesforce deletes with DELETE (204); Intercom answers 200 `{deleted: true}`. The rest stays."""
    described = {"hubspot": HUBSPOT, "hubspot-batch": HUBSPOT_BATCH, "salesforce": SALESFORCE, "intercom": INTERCOM}
    records = {
        f"c-{i}": {"email": f"c{i}@example.com", "firstname": f"Name {i}", "name": f"Name {i}", "LastName": f"L{i}"}
        for i in range(4)
    }
    fields = {"salesforce": {"LastName": "LastName"}, "intercom": None}.get(
        vendor, {"email": "email", "firstname": "firstname"}
    )
    with VendorServer() as server:
        _apply(engine, server.url, described[vendor], deletes="propagate", fields=fields)
        _load(engine, records)
        drive(engine, RULE)
        stores = {"salesforce": server.state.salesforce, "intercom": server.state.intercom}
        held = stores.get(vendor, server.state.hubspot)
        assert len(held) == 4
        with engine.begin() as conn:
            load_records(conn, "shop", "contact", [MirrorInput(k, records[k], True) for k in ("c-1", "c-2")])
        report = drive(engine, RULE)
        ledger = _ledger(engine)
        assert report.counts == {"deleted": 2}, {k: r["last_error"] for k, r in ledger.items()}
        assert {k: r["status"] for k, r in ledger.items()} == {
            "c-0": "delivered",
            "c-1": "deleted",
            "c-2": "deleted",
            "c-3": "delivered",
        }
        assert sorted(held) == sorted(ledger[k]["remote_id"] for k in ("c-0", "c-3"))
        if vendor == "hubspot-batch":
            assert ("archive", 2) in server.state.batch_calls
