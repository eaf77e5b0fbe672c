"""The `parked-RULE` artifact (`flows.parked_artifact`): what is parked now for a rule, on SQLite and
PostgreSQL. Rows are parked as a chain leaves them (`park`), the markdown read as an operator reads
it: totals by status and by reason, the latest changed first, at most 200 rows listed, a plain
sentence when nothing is parked; published under one key per rule and refreshed by a requeue (not
by a dry run). The queries are index seeks."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from prefect import flow

from delivery.clock import utcnow
from delivery.errors import UnknownName
from delivery.store import ledger
from delivery.store.tables import ledger_table
from flows import parked_artifact
from flows.parked_artifact import parked_artifact_key, parked_markdown, publish_parked_set
from flows.requeue import delivery_requeue
from tests.integration.world import RULE, World
from tests.support.ledger import park
from tests.target_server import TargetServer

T0 = datetime(2025, 6, 1, 8, 0, 0, 123456, tzinfo=UTC)


@pytest.fixture
def world(engine: sa.Engine, target: TargetServer) -> World:
    return World(engine, target).apply()


def table(markdown: str, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header row starts with `header`."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def park_many(world: World, count: int, status: str, start: datetime, prefix: str, last_error: str) -> None:
    """`count` rows parked one second apart from `start`, in one statement."""
    world.load(*(f"{prefix}{i:03d}" for i in range(count)))
    rule_id = world.rule_row()["id"]
    terminal = status != "failed"
    rows = []
    for i in range(count):
        at = start + timedelta(seconds=i)
        rows.append(
            {
                "rule_id": rule_id,
                "record_id": world.record_id(f"{prefix}{i:03d}"),
                "status": status,
                "remote_id": None,
                "attempts": 3,
                "next_attempt_at": None if terminal else at + timedelta(hours=1),
                "last_error": last_error,
                "settled_changed_at": at,
                "fingerprint": None,
                "create_generation": 0,
                "created_at": at,
                "updated_at": at,
            }
        )
    with world.engine.begin() as conn:
        conn.execute(ledger_table.insert(), rows)


def test_nothing_parked_says_so_in_one_sentence(world: World) -> None:
    world.load("ok")
    park(world, "ok", "delivered", last_error="", updated_at=T0)  # delivered rows are not parked
    markdown, description = parked_markdown(world.engine, RULE)
    assert description == "contacts-to-crm: nothing parked, no failed row waiting"
    assert markdown.startswith("**contacts-to-crm: nothing parked, no failed row waiting.**\n\nAs of ")
    assert "(0)" not in markdown and "|" not in markdown


def test_totals_by_status_and_reason_and_the_latest_changed_first(world: World) -> None:
    world.load("a1", "a2", "g1", "f1", "f2", "ok")
    park(
        world,
        "a1",
        "exhausted",
        last_error="gave up after 3 attempts: POST contacts: HTTP 400: bad email",
        updated_at=T0,
    )
    park(
        world,
        "a2",
        "exhausted",
        last_error="gave up after 3 attempts: POST contacts: HTTP 400: no name",
        updated_at=T0 + timedelta(minutes=1),
    )
    park(
        world,
        "g1",
        "remote_gone",
        last_error="PATCH contacts/r-9: HTTP 404: gone",
        updated_at=T0 + timedelta(minutes=2),
    )
    park(
        world, "f1", "failed", last_error="POST contacts: timed out (ReadTimeout)", updated_at=T0 + timedelta(minutes=3)
    )
    park(world, "f2", "failed", last_error="requeued by ops (was exhausted: x)", updated_at=T0 + timedelta(minutes=4))
    park(world, "ok", "delivered", last_error="", updated_at=T0 + timedelta(minutes=5))

    markdown, description = parked_markdown(world.engine, RULE)
    title = (
        "contacts-to-crm: 3 records parked (2 exhausted, 1 remote_gone); 2 failed rows waiting for their next attempt"
    )
    assert description == title and markdown.startswith(f"**{title}.**")
    assert [row[:2] for row in table(markdown, "status")] == [["exhausted", "2"], ["remote_gone", "1"], ["failed", "2"]]
    assert table(markdown, "reason") == [
        ["HTTP 400 (Bad Request)", "2"],
        ["HTTP 404 (Not Found)", "1"],
        ["requeued, not sent yet", "1"],
        ["timed out (ReadTimeout)", "1"],
    ]
    listed = table(markdown, "external id")
    assert [row[0] for row in listed] == ["f2", "f1", "g1", "a2", "a1"]  # the latest changed first
    f1 = listed[1]
    assert f1 == [
        "f1",
        "failed",
        "1",
        "2025-06-01T08:03:00+00:00",
        "2025-06-01T09:03:00+00:00",
        "POST contacts: timed out (ReadTimeout)",
    ]
    assert listed[4][4] == "-"  # a parked row has no next attempt
    # How to put them back: the deployment and the command.
    assert "delivery-requeue" in markdown
    assert "delivery requeue contacts-to-crm --dry-run\ndelivery requeue contacts-to-crm\n" in markdown
    # Plain words: no Python reprs, times to the second.
    assert not re.search(r"[{}]|datetime\(|\.\d{6}|'exhausted'", markdown)


def test_only_failed_rows_waiting(world: World) -> None:
    world.load("f1")
    park(world, "f1", "failed", last_error="POST contacts: HTTP 503: busy", updated_at=T0)
    markdown, description = parked_markdown(world.engine, RULE)
    assert description == "contacts-to-crm: nothing parked; 1 failed row waiting for its next attempt"
    assert "delivery requeue contacts-to-crm --status failed --dry-run" in markdown
    assert table(markdown, "reason") == [["HTTP 503 (Service Unavailable)", "1"]]


def test_the_first_200_are_listed_the_totals_count_them_all(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    park_many(world, 230, "exhausted", T0, "x", "POST contacts: HTTP 400: no")
    park_many(world, 5, "failed", T0 - timedelta(days=1), "f", "POST contacts: HTTP 500: oops")
    park_many(
        world, 4, "remote_gone", T0 + timedelta(seconds=100, milliseconds=500), "g", "PATCH contacts/1: HTTP 404: x"
    )
    markdown, description = parked_markdown(world.engine, RULE)
    assert description.startswith("contacts-to-crm: 234 records parked (230 exhausted, 4 remote_gone); 5 failed rows")
    assert [row[:2] for row in table(markdown, "status")] == [
        ["exhausted", "230"],
        ["remote_gone", "4"],
        ["failed", "5"],
    ]
    assert table(markdown, "reason") == [
        ["HTTP 400 (Bad Request)", "230"],
        ["HTTP 500 (Internal Server Error)", "5"],
        ["HTTP 404 (Not Found)", "4"],
    ]
    listed = [row[0] for row in table(markdown, "external id")]
    assert len(listed) == parked_artifact.LISTED == 200
    # The latest 200 by last change, across the statuses: x229 .. x100 with the four remote_gone
    # rows (changed 100.5 s to 103.5 s after T0) in their places; no failed row (a day older).
    expected = sorted(
        [(T0 + timedelta(seconds=i), f"x{i:03d}") for i in range(230)]
        + [(T0 + timedelta(seconds=100 + i, milliseconds=500), f"g{i:03d}") for i in range(4)],
        reverse=True,
    )
    assert listed == [name for _, name in expected[:200]]
    assert "**The 200 changed last**, most recent first (of 239;" in markdown

    # Reasons beyond the latest REASONS_COUNTED rows are not read: the artifact says so.
    monkeypatch.setattr(parked_artifact, "REASONS_COUNTED", 140)
    markdown, _ = parked_markdown(world.engine, RULE)
    assert "counted over the 140 rows changed last" in markdown
    assert table(markdown, "reason") == [["HTTP 400 (Bad Request)", "136"], ["HTTP 404 (Not Found)", "4"]]


def test_many_reasons_keep_the_most_frequent_and_add_up_the_rest(world: World) -> None:
    for code in range(400, 420):
        park_many(world, 1 + (code == 400), "exhausted", T0 + timedelta(minutes=code), f"e{code}-", f"HTTP {code}: x")
    reasons = table(parked_markdown(world.engine, RULE)[0], "reason")
    assert len(reasons) == parked_artifact.REASONS_LISTED
    assert reasons[0] == ["HTTP 400 (Bad Request)", "2"]
    assert reasons[-1] == ["6 other reasons", "6"]


def test_an_unknown_rule_is_refused(world: World) -> None:
    with pytest.raises(UnknownName, match="no rule named 'nope'"):
        parked_markdown(world.engine, "nope")


# -- published under one key per rule, refreshed by a requeue --------------------------------------


def latest(key: str) -> Any:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    async def read() -> Any:
        async with get_client() as client:
            found = await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                sort=ArtifactSort.CREATED_DESC,
                limit=1,
            )
            return found[0] if found else None

    return asyncio.run(read())


def test_published_under_the_rules_key_and_refreshed_after_a_requeue_not_a_dry_run(
    prefect_api: None, world: World
) -> None:
    world.load("p1", "p2")
    park(world, "p1", "exhausted", last_error="POST contacts: HTTP 400: bad", updated_at=utcnow())
    park(world, "p2", "remote_gone", last_error="PATCH contacts/r-9: HTTP 404: gone", updated_at=utcnow())

    @flow(name="a-chain-ending")
    async def a_chain_ending() -> None:
        await publish_parked_set(world.engine, RULE)  # what deliver-rule does as a chain ends

    asyncio.run(a_chain_ending())
    first = latest(parked_artifact_key(RULE))
    assert first.type == "markdown" and first.key == "parked-contacts-to-crm"
    assert first.description == "contacts-to-crm: 2 records parked (1 exhausted, 1 remote_gone)"
    assert "| exhausted | 1 |" in first.data

    dry = delivery_requeue(rule=RULE, dry_run=True, return_state=True)
    assert dry.is_completed()
    assert latest(parked_artifact_key(RULE)).id == first.id  # a dry run changes nothing

    requeued = delivery_requeue(rule=RULE, ids=["p1"], by="ops", return_state=True)
    assert requeued.is_completed()
    after = latest(parked_artifact_key(RULE))
    assert after.id != first.id and after.flow_run_id == requeued.state_details.flow_run_id
    assert after.description == (
        "contacts-to-crm: 1 record parked (1 remote_gone); 1 failed row waiting for its next attempt"
    )
    assert "| requeued, not sent yet | 1 |" in after.data


# -- index seeks -----------------------------------------------------------------------------------


def _plan(engine: sa.Engine, query: Any) -> str:
    compiled = query.compile(engine, compile_kwargs={"literal_binds": True})
    prefix = "EXPLAIN QUERY PLAN " if engine.dialect.name == "sqlite" else "EXPLAIN "
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql("SET enable_seqscan = off")  # an empty table would be seq-scanned anyway
        return "\n".join(str(row) for row in conn.exec_driver_sql(prefix + str(compiled)))


def test_the_parked_set_is_read_by_index_seeks(engine: sa.Engine) -> None:
    captured: list[Any] = []

    class Spy:
        def execute(self, query: Any) -> list[Any]:
            captured.append(query)
            return []

    ledger.parked_counts(Spy(), 1)  # type: ignore[arg-type]
    ledger.parked_latest(Spy(), 1, 200)  # type: ignore[arg-type]
    ledger.parked_errors(Spy(), 1, 10_000)  # type: ignore[arg-type]
    counts, latest_rows, errors = (_plan(engine, q) for q in captured)
    for plan in (latest_rows, errors):
        assert plan.count("ix_ledger_rule_id_status_updated_at_id") == 3, plan  # one seek per status
        assert "Sort  (cost" not in plan, plan  # PostgreSQL merges the three seeks (Merge Append), sorts nothing
    assert "ix_ledger_rule_id_status" in counts
    for plan in (counts, latest_rows, errors):
        assert "Seq Scan" not in plan and "SCAN ledger" not in plan and "SCAN mirror_records" not in plan, plan


def test_the_index_serves_a_backward_seek_within_one_status(engine: sa.Engine) -> None:
    """Each status's part reads its rows in index order: no sort of the rule's parked rows."""
    query = (
        sa.select(ledger_table.c.id)
        .where(ledger_table.c.rule_id == 1, ledger_table.c.status == "exhausted")
        .order_by(ledger_table.c.updated_at.desc(), ledger_table.c.id.desc())
        .limit(200)
    )
    plan = _plan(engine, query)
    assert "ix_ledger_rule_id_status_updated_at_id" in plan
    assert "TEMP B-TREE" not in plan and "Sort" not in plan, plan
