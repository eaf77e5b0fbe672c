"""A target described in configuration, as an operator meets it at the terminal (issue 30): `delivery
apply` refuses a bad template naming its key path (exit 2, nothing saved); `delivery connections`
and `connection-status` show the auth kind and where each secret comes from, never a value, and a
password in `base_url` masked. On SQLite and PostgreSQL, through the console script."""

from __future__ import annotations

import os
from pathlib import Path

import sqlalchemy as sa
import yaml

from tests.support.cli import as_json, assert_catalog_empty, delivery, ok, refused

HUBSPOT = {
    "name": "hubspot",
    "driver": "rest",
    "base_url": "https://user:pa55word@api.hubapi.com",
    "requests": {"create": {"path": "crm/v3/objects/{{ collection }}", "body": {"properties": "{{ fields }}"}}},
    "auth": {
        "kind": "oauth2",
        "token_url": "https://api.hubapi.com/oauth/v1/token",
        "grant": "refresh_token",
        "client_id_env": "HS_CLIENT_ID",
        "client_secret_env": "HS_CLIENT_SECRET",
        "refresh_token_secret": "hs-refresh",
    },
}


def _write(tmp_path: Path, name: str, connections: list[dict[str, object]]) -> str:
    (tmp_path / name).write_text(yaml.safe_dump({"connections": connections}), encoding="utf-8")
    return name


def test_connections_show_the_auth_kind_and_its_sources_never_a_value(engine: sa.Engine, tmp_path: Path) -> None:
    ok(delivery("apply", _write(tmp_path, "c.yaml", [HUBSPOT]), cwd=tmp_path))
    listed = as_json(delivery("connections", "--json", cwd=tmp_path))
    (hubspot,) = listed
    assert hubspot["auth"] == {"kind": "oauth2", **{k: v for k, v in HUBSPOT["auth"].items() if k != "kind"}}  # type: ignore[dict-item]
    assert hubspot["base_url"] == "https://user:***@api.hubapi.com"
    table = ok(delivery("connections", cwd=tmp_path, env={**os.environ, "COLUMNS": "80"})).stdout
    assert "oauth2 (env HS_CLIENT_ID, env HS_CLIENT_SECRET, secret hs-refresh)" in table
    assert "pa55word" not in table and max(len(line) for line in table.splitlines()) <= 80
    shown = as_json(delivery("connection-status", "hubspot", "--json", cwd=tmp_path))
    assert shown["auth"]["kind"] == "oauth2" and shown["base_url"] == "https://user:***@api.hubapi.com"


def test_apply_refuses_a_template_naming_its_key_path_exit_2_nothing_saved(engine: sa.Engine, tmp_path: Path) -> None:
    bad = {**HUBSPOT, "requests": {"create": {"path": "crm/{{ record.__class__ }}", "method": "GET"}}}
    refused(
        delivery("apply", _write(tmp_path, "bad.yaml", [bad]), cwd=tmp_path),
        "error: connections[0].requests.create.method: 'GET' is not one of POST | PUT | PATCH",
        "error: connections[0].requests.create.path: a placeholder's path may not hold a segment starting with _",
    )
    assert_catalog_empty(engine)
