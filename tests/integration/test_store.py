"""Config apply and mirror loading against the real databases."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from delivery.apply import apply_config
from delivery.config import parse_config
from delivery.domain import MirrorInput
from delivery.errors import ConfigError, MirrorLoadError, UnknownName
from delivery.mirror_file import parse_line
from delivery.store import catalog
from delivery.store.mirror import load_records
from delivery.store.tables import connections_table, mirror_records_table, rules_table

CONFIG = """
connections:
  - {name: crm, driver: rest, base_url: "http://127.0.0.1:9/api", token_env: CRM_TOKEN}
  - {name: shop}
rules:
  - {name: contacts-to-crm, source: shop, domain: contact, target: crm, collection: contacts}
"""


def apply(engine: sa.Engine, text: str) -> catalog.ApplyReport:
    with engine.begin() as conn:
        return apply_config(conn, parse_config(text))


def table(engine: sa.Engine, t: sa.Table) -> list[dict]:  # type: ignore[type-arg]
    with engine.connect() as conn:
        return [r._asdict() for r in conn.execute(sa.select(t).order_by(t.c.id))]


def test_apply_creates_and_reapplying_is_a_no_op(engine: sa.Engine) -> None:
    report = apply(engine, CONFIG)
    assert report.created == ["connection crm", "connection shop", "rule contacts-to-crm"]
    before = table(engine, connections_table) + table(engine, rules_table)
    again = apply(engine, CONFIG)
    assert again.created == [] and again.updated == [] and len(again.unchanged) == 3
    assert table(engine, connections_table) + table(engine, rules_table) == before


def test_apply_updates_only_what_changed_and_keeps_an_operators_status(engine: sa.Engine) -> None:
    apply(engine, CONFIG)
    with engine.begin() as conn:
        catalog.set_connection_status(conn, "crm", catalog.ConnectionStatus.ERROR)
    report = apply(engine, CONFIG.replace("collection: contacts", "collection: people"))
    assert report.updated == ["rule contacts-to-crm"]
    with engine.connect() as conn:
        rule = catalog.get_rule(conn, "contacts-to-crm")
    assert rule.collection == "people" and rule.target.status.value == "error"
    apply(engine, CONFIG.replace("token_env: CRM_TOKEN}", "token_env: CRM_TOKEN, status: active}"))
    with engine.connect() as conn:
        assert catalog.get_rule(conn, "contacts-to-crm").target.status.value == "active"


def test_refused_config_writes_nothing(engine: sa.Engine) -> None:
    bad = (
        CONFIG + "  - {name: second, source: shop, domain: contact, target: crm, collection: c, policy: update_only}\n"
    )
    bad = bad.replace("driver: rest,", "driver: rest-create-only,")
    with pytest.raises(ConfigError) as caught:
        apply(engine, bad)
    assert any("rules[1].policy" in p and "'update'" in p and "rest-create-only" in p for p in caught.value.problems)
    assert table(engine, connections_table) == [] and table(engine, rules_table) == []


def test_rule_may_refer_to_connections_saved_earlier(engine: sa.Engine) -> None:
    apply(engine, CONFIG)
    report = apply(engine, "rules:\n  - {name: r2, source: shop, domain: order, target: crm, collection: orders}\n")
    assert report.created == ["rule r2"]
    with pytest.raises(ConfigError, match="no connection named 'nowhere'"):
        apply(engine, "rules:\n  - {name: r3, source: nowhere, domain: d, target: crm, collection: c}\n")


def test_changing_a_rules_source_or_domain_resets_its_cursor(engine: sa.Engine) -> None:
    from delivery.clock import utcnow

    apply(engine, CONFIG)
    with engine.begin() as conn:
        conn.execute(rules_table.update().values(cursor_changed_at=utcnow(), cursor_record_id=5))
    apply(engine, CONFIG.replace("domain: contact", "domain: lead"))
    with engine.connect() as conn:
        assert catalog.get_rule(conn, "contacts-to-crm").cursor is None


def load(engine: sa.Engine, items: list[MirrorInput], source: str = "shop") -> object:
    with engine.begin() as conn:
        return load_records(conn, source, "contact", items)


def signals(engine: sa.Engine) -> dict[str, object]:
    return {r["external_id"]: r["changed_at"] for r in table(engine, mirror_records_table)}


def test_change_signal_moves_only_on_a_real_change(engine: sa.Engine) -> None:
    apply(engine, CONFIG)
    load(engine, [MirrorInput("a", {"x": 1}), MirrorInput("b", {"x": 1})])
    first = signals(engine)
    report = load(engine, [MirrorInput("a", {"x": 1}), MirrorInput("b", {"x": 1})])
    assert report.unchanged == 2 and signals(engine) == first  # type: ignore[attr-defined]
    load(engine, [MirrorInput("a", {"x": 1}), MirrorInput("b", {"x": 2})])
    second = signals(engine)
    assert second["a"] == first["a"] and second["b"] > first["b"]  # type: ignore[operator]
    load(engine, [MirrorInput("a", {"x": 1}, deleted=True)])
    assert signals(engine)["a"] > first["a"]  # type: ignore[operator]
    assert {r["external_id"]: r["deleted"] for r in table(engine, mirror_records_table)} == {"a": True, "b": False}


def test_a_bad_line_part_way_loads_nothing(engine: sa.Engine) -> None:
    apply(engine, CONFIG)
    load(engine, [MirrorInput("keep", {"v": 1})])
    before = table(engine, mirror_records_table)

    def lines() -> Iterator[MirrorInput]:
        for n in range(1, 1500):  # past the first chunks, which were already written in the transaction
            line = json.dumps({"id": f"r{n}", "payload": {"v": 2}}) if n != 1234 else "{oops"
            yield parse_line(n, line)

    with pytest.raises(MirrorLoadError) as caught:
        load(engine, lines())  # type: ignore[arg-type]
    assert caught.value.line == 1234
    assert table(engine, mirror_records_table) == before


def test_unknown_source_is_refused(engine: sa.Engine) -> None:
    with pytest.raises(UnknownName, match="nowhere"):
        load(engine, [MirrorInput("a", {})], source="nowhere")


def test_many_records_load_in_chunks(engine: sa.Engine) -> None:
    apply(engine, CONFIG)
    report = load(engine, [MirrorInput(f"r{n}", {"n": n}) for n in range(5000)])
    assert report.inserted == 5000  # type: ignore[attr-defined]
    report = load(engine, [MirrorInput(f"r{n}", {"n": n + (n % 2)}) for n in range(5000)])
    assert (report.changed, report.unchanged) == (2500, 2500)  # type: ignore[attr-defined]
