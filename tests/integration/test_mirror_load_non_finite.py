"""`load_records` refuses a payload holding NaN or ±Infinity: the record could never be sent (JSON has
neither), so it is stopped at the mirror, by its position, with nothing of the load kept."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from delivery.apply import apply_config
from delivery.config import parse_config
from delivery.domain import MirrorInput
from delivery.errors import InputError, MirrorLoadError
from delivery.store.mirror import CHUNK, MirrorInputError, load_records
from delivery.store.tables import mirror_records_table

CONFIG = """
connections:
  - name: shop
"""


def rows(engine: sa.Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [r._asdict() for r in conn.execute(sa.select(mirror_records_table).order_by(mirror_records_table.c.id))]


def load(engine: sa.Engine, items: list[MirrorInput]) -> None:
    with engine.begin() as conn:
        load_records(conn, "shop", "contact", items)


@pytest.fixture
def shop(engine: sa.Engine) -> sa.Engine:
    with engine.begin() as conn:
        apply_config(conn, parse_config(CONFIG))
    return engine


@pytest.mark.parametrize(
    ("value", "label"), [(float("nan"), "NaN"), (float("inf"), "Infinity"), (float("-inf"), "-Infinity")]
)
def test_a_non_finite_payload_is_refused_by_position_and_nothing_is_loaded(
    shop: sa.Engine, value: float, label: str
) -> None:
    items = [MirrorInput("a", {"n": 1}), MirrorInput("b", {"n": 2}), MirrorInput("c", {"geo": {"lat": value}})]
    with pytest.raises(MirrorLoadError) as caught:
        load(shop, items)
    assert caught.value.line == 3
    assert str(caught.value).startswith(f"line 3: payload.geo.lat is {label}, which JSON cannot carry")
    assert isinstance(caught.value, InputError)  # the CLI's exit 2
    assert rows(shop) == []


def test_a_refusal_after_the_first_chunk_still_loads_nothing(shop: sa.Engine) -> None:
    load(shop, [MirrorInput("kept", {"n": 0})])
    before = rows(shop)
    items = [MirrorInput(f"c{i}", {"n": i}) for i in range(CHUNK + 10)]
    items.append(MirrorInput("kept", {"n": float("nan")}))
    with pytest.raises(MirrorLoadError) as caught:
        load(shop, items)
    assert caught.value.line == CHUNK + 11
    assert rows(shop) == before  # the first chunk went in, and was rolled back with the rest


def test_finite_payloads_still_load(shop: sa.Engine) -> None:
    load(shop, [MirrorInput("a", {"max": 1.7976931348623157e308, "s": "NaN", "l": [0.5, -0.0]})])
    assert rows(shop)[0]["payload"] == {"max": 1.7976931348623157e308, "s": "NaN", "l": [0.5, -0.0]}


# --- text no database stores alike, and ids that do not fit -----------------------------------


NUL = "holds a NUL character (\\u0000), which PostgreSQL cannot store"


@pytest.mark.parametrize(
    ("item", "problem"),
    [
        (MirrorInput("a\x00b", {"v": 1}), f"'id' {NUL}"),
        (MirrorInput("a", {"v": "x\x00"}), f"payload.v {NUL}"),
        (MirrorInput("a", {"k\x00": 1}), f'the key payload["k\\u0000"] {NUL}'),
        (
            MirrorInput("a", {"l": ["\ud800"]}),
            "payload.l[0] holds a lone surrogate (\\ud800), which is not valid Unicode",
        ),
        (MirrorInput("\udcff", {}), "'id' holds a lone surrogate (\\udcff), which is not valid Unicode"),
        (MirrorInput("x" * 501, {}), "'id' is longer than 500 characters"),
        (MirrorInput(" ", {}), "'id' must be a non-empty string"),
    ],
    ids=["nul-id", "nul-value", "nul-key", "surrogate-value", "surrogate-id", "long-id", "blank-id"],
)
def test_a_record_no_database_stores_alike_is_refused_by_position(
    shop: sa.Engine, item: MirrorInput, problem: str
) -> None:
    """The same refusal on SQLite and PostgreSQL: before, PostgreSQL raised a DataError (NUL) or
    StringDataRightTruncation (501 characters) where SQLite stored the record, and a lone
    surrogate loaded on both only to be parked by every chain as a body that cannot be encoded."""
    with pytest.raises(MirrorLoadError) as caught:
        load(shop, [MirrorInput("fine", {"n": 1}), item])
    assert str(caught.value) == f"line 2: {problem}"
    assert rows(shop) == []


@pytest.mark.parametrize(
    ("source", "domain", "named", "parameter"),
    [("sh\x00op", "contact", "source connection", "source"), ("shop", "\udc80", "record domain", "domain")],
)
def test_a_source_or_domain_no_database_takes_is_refused(
    shop: sa.Engine, source: str, domain: str, named: str, parameter: str
) -> None:
    """The store names the input in the domain's words, never a command-line option (`delivery
    mirror load` names its --source or --domain from `parameter`)."""
    with pytest.raises(MirrorInputError, match=f"^{named} name: holds a") as caught, shop.begin() as conn:
        load_records(conn, source, domain, [MirrorInput("a", {})])
    assert isinstance(caught.value, InputError)  # the CLI's exit 2
    assert caught.value.parameter == parameter
    assert "--" not in str(caught.value)
    assert rows(shop) == []


# --- an id given more than once in one load -----------------------------------------------------


def report_of(engine: sa.Engine, items: list[MirrorInput]) -> tuple[int, int, int, int]:
    with engine.begin() as conn:
        report = load_records(conn, "shop", "contact", items)
    return report.inserted, report.changed, report.unchanged, report.repeated


def payloads(engine: sa.Engine) -> dict[str, Any]:
    return {r["external_id"]: r["payload"] for r in rows(engine)}


def test_an_id_repeated_in_one_load_is_counted_once_as_what_its_last_record_did(shop: sa.Engine) -> None:
    """`{"id": "a", v: 1}` then `{"id": "a", v: 2}` used to read "1 new, 0 changed, 1 unchanged"
    while v: 2 was stored: the repeat counted as unchanged."""
    assert report_of(shop, [MirrorInput("a", {"v": 1}), MirrorInput("a", {"v": 2})]) == (1, 0, 0, 1)
    assert payloads(shop) == {"a": {"v": 2}}
    # Against stored rows: a changed last, an unchanged one repeated, a new one repeated three times.
    items = [MirrorInput("a", {"v": 2}), MirrorInput("a", {"v": 3}), MirrorInput("b", {"v": 1})]
    items += [MirrorInput("b", {"v": 1}), MirrorInput("b", {"v": 2}), MirrorInput("b", {"v": 1})]
    assert report_of(shop, items) == (1, 1, 0, 4)
    assert report_of(shop, [MirrorInput("a", {"v": 3}), MirrorInput("a", {"v": 3})]) == (0, 0, 1, 1)
    assert payloads(shop) == {"a": {"v": 3}, "b": {"v": 1}}


def test_a_repeat_in_a_later_chunk_is_not_counted_again(shop: sa.Engine) -> None:
    """Each chunk reads the rows the earlier chunks of the same load wrote: a repeat there must
    neither count again nor turn a record this load inserted into a change."""
    load(shop, [MirrorInput("kept", {"v": 1}), MirrorInput("edited", {"v": 1})])
    filler = [MirrorInput(f"f{i}", {"n": i}) for i in range(CHUNK)]
    first = [MirrorInput("new", {"v": 1}), MirrorInput("kept", {"v": 1}), MirrorInput("edited", {"v": 2})]
    later = [MirrorInput("new", {"v": 2}), MirrorInput("kept", {"v": 5}), MirrorInput("edited", {"v": 1})]
    # new: inserted, then changed by the load itself -> 1 new; kept: unchanged, then changed ->
    # 1 changed; edited: changed, then back to what it was -> still 1 changed (its signal moved).
    assert report_of(shop, first + filler + later) == (1 + CHUNK, 2, 0, 3)
    assert {k: v for k, v in payloads(shop).items() if not k.startswith("f")} == {
        "kept": {"v": 5},
        "edited": {"v": 1},
        "new": {"v": 2},
    }
