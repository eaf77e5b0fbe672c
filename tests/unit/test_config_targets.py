"""A target described in configuration (issue 30): request templates, auth kinds, headers and
`nulls`, as `delivery apply` checks them. Every problem is one `error:` line naming its key path."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from delivery.config import parse_config
from delivery.domain import AuthSettings, Nulls, RequestShape
from delivery.errors import ConfigError


def _config(connection: dict[str, Any], rule: dict[str, Any] | None = None) -> str:
    return yaml.safe_dump(
        {
            "connections": [
                {"name": "shop"},
                {"name": "crm", "driver": "rest", "base_url": "https://api.example.com", **connection},
            ],
            "rules": [
                {
                    "name": "r",
                    "source": "shop",
                    "domain": "contact",
                    "target": "crm",
                    "collection": "contacts",
                    **(rule or {}),
                }
            ],
        }
    )


def _problems(connection: dict[str, Any], rule: dict[str, Any] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(_config(connection, rule))
    return caught.value.problems


def test_a_described_target_is_read_into_its_connection() -> None:
    config = parse_config(
        _config(
            {
                "headers": {"Intercom-Version": "2.11"},
                "requests": {
                    "create": {
                        "path": "crm/v3/objects/{{ collection }}",
                        "body": {"properties": "{{ fields }}"},
                        "id_at": "id",
                    },
                    "update": {"method": "PUT", "path": "contacts/{{ remote_id }}"},
                },
                "auth": {"kind": "header", "header": "X-Api-Key", "token_env": "KEY"},
            },
            {"nulls": "skip"},
        )
    )
    spec = config.connections[1].spec()
    assert spec.headers == (("Intercom-Version", "2.11"),)
    assert dict(spec.requests) == {
        "create": RequestShape("POST", "crm/v3/objects/{{ collection }}", {"properties": "{{ fields }}"}, "id"),
        "update": RequestShape("PUT", "contacts/{{ remote_id }}", "{{ fields }}", None),
    }
    assert spec.auth == AuthSettings("header", (("header", "X-Api-Key"), ("token_env", "KEY")))
    assert config.rules[0].spec().nulls is Nulls.SKIP


@pytest.mark.parametrize(
    ("requests", "problem"),
    [
        ({"create": {"path": "x/{{ nope }}"}}, "connections[1].requests.create.path: unknown placeholder {{ nope }}"),
        (
            {"create": {"path": "x/{{ remote_id }}"}},
            "connections[1].requests.create.path: {{ remote_id }} is not known here",
        ),
        (
            {"update": {"path": "x/{{ idempotency_key }}"}},
            "connections[1].requests.update.path: {{ idempotency_key }} is not known here",
        ),
        (
            {"create": {"path": "x/{{ record.__class__ }}"}},
            "connections[1].requests.create.path: a placeholder's path may not hold a segment starting with _",
        ),
        ({"create": {"path": "x/{{ external_id"}}, "connections[1].requests.create.path: the template does not parse"),
        (
            {"create": {"path": "x", "method": "DELETE"}},
            "connections[1].requests.create.method: 'DELETE' is not one of POST | PUT | PATCH",
        ),
        (
            {"update": {"path": "x/{{ remote_id }}", "method": "GET"}},
            "connections[1].requests.update.method: 'GET' is not one of PATCH | PUT | POST",
        ),
        (
            {"create": {"path": "x", "body": {"a": ["{{ items }}"]}}},
            "connections[1].requests.create.body.a[0]: {{ items }} is not known here",
        ),
        (
            {"update": {"path": "x/{{ remote_id }}", "id_at": "id"}},
            "connections[1].requests.update.id_at: only a create's answer gives the record's id",
        ),
        ({"create": {"path": "/abs"}}, "connections[1].requests.create.path: a path is relative to base_url"),
    ],
)
def test_a_request_template_is_refused_naming_its_key_path(requests: dict[str, Any], problem: str) -> None:
    problems = _problems({"requests": requests})
    assert len(problems) == 1 and problems[0].startswith(problem), problems


@pytest.mark.parametrize(
    ("auth", "problem"),
    [
        ({"kind": "basic", "username_env": "U"}, "kind basic needs password_env or password_secret"),
        ({"kind": "header", "token_env": "K"}, "kind header needs header"),
        (
            {"kind": "bearer", "token_env": "K", "token_secret": "k"},
            "token_env and token_secret: name one of them, not both",
        ),
        ({"kind": "bearer", "token_env": "K", "header": "X"}, "header is not read by kind bearer"),
        (
            {
                "kind": "oauth2",
                "token_url": "https://x/token",
                "grant": "client_credentials",
                "client_id_env": "I",
                "client_secret_env": "S",
                "refresh_token_env": "R",
            },
            "refresh_token_env is not read by kind oauth2 with grant client_credentials",
        ),
        ({"kind": "oauth2", "client_id_env": "I", "client_secret_env": "S"}, "kind oauth2 needs refresh_token_env"),
        (
            {
                "kind": "oauth2",
                "token_url": "https://x/t",
                "grant": "password",
                "client_id_env": "I",
                "client_secret_env": "S",
            },
            "connections[1].auth.grant",
        ),
        ({"kind": "digest"}, "connections[1].auth.kind"),
    ],
)
def test_an_auth_is_refused_naming_what_it_lacks_or_has_too_much(auth: dict[str, Any], problem: str) -> None:
    problems = _problems({"auth": auth})
    assert any(problem in p for p in problems), problems
    assert all(p.startswith("connections[1].auth") for p in problems), problems


def test_auth_and_a_top_level_token_are_refused_together() -> None:
    problems = _problems({"auth": {"kind": "bearer", "token_env": "A"}, "token_env": "B"})
    assert problems == [
        "connections[1]: auth and token_env: name the credentials in one place (auth: {kind: bearer, token_env: ...})"
    ]


def test_a_header_that_cannot_be_sent_is_refused() -> None:
    problems = _problems({"headers": {"Bad Name": "x", "Ok": "line\nbreak"}})
    assert len(problems) == 2 and all(p.startswith("connections[1].headers") for p in problems), problems


def test_nulls_is_send_or_skip() -> None:
    assert _problems({}, {"nulls": "drop"})[0].startswith("rules[0].nulls: Input should be 'send' or 'skip'")


@pytest.mark.parametrize(
    ("batch", "problem"),
    [
        (
            {"create": {"path": "x/batch", "body": {"inputs": []}}},
            "connections[1].batch.create.body: holds no {{ items }}",
        ),
        (
            {"create": {"path": "x/batch", "item": {"id": "{{ remote_id }}"}}},
            "connections[1].batch.create.item.id: {{ remote_id }} is not known here",
        ),
        (
            {"update": {"path": "x/batch", "body": {"inputs": "{{ items }}", "x": "{{ fields }}"}}},
            "connections[1].batch.update.body.x: {{ fields }} is not known here",
        ),
        (
            {"update": {"path": "x/batch", "id_at": "id"}},
            "connections[1].batch.update.id_at: only a create's results give the records' ids",
        ),
        (
            {"create": {"path": "x/{{ external_id }}"}},
            "connections[1].batch.create.path: {{ external_id }} is not known here",
        ),
        (
            {"create": {"path": "x", "method": "GET"}},
            "connections[1].batch.create.method: 'GET' is not one of POST | PUT | PATCH",
        ),
        (
            {"create_path": "x", "create": {"path": "y"}},
            "connections[1].batch: create_path and create: describe the batch create once",
        ),
    ],
)
def test_a_batch_shape_is_refused_naming_its_key_path(batch: dict[str, Any], problem: str) -> None:
    problems = _problems({"batch": batch})
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_a_batch_shape_is_read_with_its_defaults() -> None:
    config = parse_config(_config({"batch": {"update": {"path": "crm/{{ collection }}/batch/update"}}}))
    batch = config.connections[1].spec().batch
    assert batch is not None and batch.update_path == "crm/{{ collection }}/batch/update"
    shape = batch.update_shape
    assert shape is not None and (shape.method, shape.body, shape.item, shape.results_at, shape.match) == (
        "PATCH",
        {"items": "{{ items }}"},
        "{{ fields }}",
        "results",
        None,
    )


def test_a_body_that_is_not_json_as_written_is_refused() -> None:
    text = _config({"requests": {"create": {"path": "x", "body": {"since": "DATE"}}}}).replace("DATE", "2026-12-07")
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert caught.value.problems[0].startswith("connections[1].requests.create.body: not JSON")
    problems = _problems({"batch": {"create": {"path": "x", "body": {"inputs": "x {{ items }}"}}}})
    assert problems == [
        "connections[1].batch.create.body: holds no {{ items }}: the call would carry none of its records"
    ]
