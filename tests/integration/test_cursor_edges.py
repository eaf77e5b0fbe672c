"""The cursor's edges: the overlap window catching a change that committed late behind the cursor,
and a breaker trip during the drain keeping the scan (and so the cursor) where they are."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import pytest

from delivery.clock import utcnow
from delivery.store.mirror import record_digest, source_id
from delivery.store.tables import mirror_records_table
from tests.integration.world import World, email
from tests.target_server import Answer

OVERLAP_SECONDS = 300


@pytest.fixture
def world(world: World) -> World:
    # fail_max 3, batch_size 10, max_attempts 3 (World's defaults); the window is set here on purpose.
    return world.apply(rule={"overlap_seconds": OVERLAP_SECONDS})


def _payload(external_id: str, name: str) -> dict[str, Any]:
    return {"email": email(external_id), "name": name}


def _commit_late(world: World, external_id: str, changed_at: datetime) -> None:
    """A mirror row that becomes visible only now but carries an earlier change signal: what a
    source transaction that committed after a later one leaves behind the cursor. Written directly,
    because the loader stamps every change with the time of the load."""
    payload = _payload(external_id, f"Late {external_id}")
    with world.engine.begin() as conn:
        conn.execute(
            mirror_records_table.insert().values(
                source_id=source_id(conn, "shop"),
                domain="contact",
                external_id=external_id,
                payload=payload,
                content_hash=record_digest(payload, False),
                deleted=False,
                changed_at=changed_at,
                created_at=utcnow(),
            )
        )


def _change_late(world: World, external_id: str, changed_at: datetime) -> None:
    """A change of an existing record that commits late, with a signal behind the cursor."""
    payload = _payload(external_id, "changed late")
    with world.engine.begin() as conn:
        conn.execute(
            mirror_records_table.update()
            .where(mirror_records_table.c.external_id == external_id)
            .values(payload=payload, content_hash=record_digest(payload, False), changed_at=changed_at)
        )


def _writes(world: World) -> list[tuple[str, str | None]]:
    return sorted((r.method, r.key) for r in world.target.requests)


# -- the overlap window -------------------------------------------------------------------------------


def test_the_overlap_window_delivers_a_late_commit_behind_the_cursor_and_nothing_older(world: World) -> None:
    """The window's contract: a change whose signal is at most `overlap_seconds` behind the cursor
    is delivered by the next chain even though it committed after the cursor passed it; a change
    further behind is not, the scan never reads that far back (only a change that moves its signal
    again brings it into view). The cursor itself never moves back for a late change."""
    world.load("a", "b", "c")
    world.run()
    cursor = world.cursor()
    assert cursor is not None and cursor.record_id == world.record_id("c")
    window = timedelta(seconds=OVERLAP_SECONDS)
    _commit_late(world, "late-inside", cursor.changed_at - window + timedelta(seconds=1))
    _commit_late(world, "late-at-the-edge", cursor.changed_at - window)
    _commit_late(world, "late-outside", cursor.changed_at - window - timedelta(seconds=1))
    _change_late(world, "a", cursor.changed_at - timedelta(seconds=10))
    remote_a = world.ledger()["a"]["remote_id"]
    world.target.requests.clear()

    result = world.run()

    assert _writes(world) == sorted(
        [("POST", world.key("late-inside")), ("POST", world.key("late-at-the-edge")), ("PATCH", remote_a)]
    )
    assert result["scanned"]["delivered"] == 3
    rows = world.ledger()
    assert {rows[i]["status"] for i in ("late-inside", "late-at-the-edge", "a")} == {"delivered"}
    assert "late-outside" not in rows
    assert world.target.records("contacts")[remote_a]["name"] == "changed late"
    assert world.cursor() == cursor

    # Outside the window it stays out, chain after chain: nothing re-reads that far back.
    world.target.requests.clear()
    assert world.run()["counts"] == {s: 0 for s in result["counts"]}
    assert world.target.requests == [] and "late-outside" not in world.ledger()


# -- a breaker trip during the drain ------------------------------------------------------------------


async def _subflows(flow_run_id: str) -> list[str]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[UUID(flow_run_id)]))
        )
        return sorted([(await client.read_flow(run.flow_id)).name for run in runs])


@pytest.mark.through_prefect  # which subflows ran
def test_a_breaker_trip_during_the_drain_keeps_the_scan_from_running(world: World) -> None:
    due = [f"due-{n}" for n in range(5)]
    world.load(*due)
    for external_id in due:  # rejected records: failed rows, and no count against the breaker
        world.target.program(world.key(external_id), Answer.status(422))
    first = world.run()
    assert first["ended_by"] == "caught_up" and first["scanned"]["failed"] == 5
    assert asyncio.run(_subflows(first["flow_run_id"])) == ["drain", "scan"]  # what a full chain runs
    world.make_due()
    cursor = world.cursor()
    assert cursor is not None
    fresh = ["fresh-1", "fresh-2"]
    world.load(*fresh)  # never delivered: only the scan would offer them
    world.target.requests.clear()
    world.target.down = True

    result = world.run()

    assert result["state"] == "COMPLETED" and result["ended_by"] == "breaker_open"
    assert result["drained"]["failed"] == 3  # fail_max 3: the third failure tripped it mid-drain
    assert result["scanned"] == {s: 0 for s in result["scanned"]}
    assert asyncio.run(_subflows(result["flow_run_id"])) == ["drain"]
    sent = [r.key for r in world.target.requests]
    assert len(sent) == 3 and set(sent) <= {world.key(i) for i in due}
    assert all(world.target.count(world.key(i)) == 0 for i in fresh)
    rows = world.ledger()
    assert not set(fresh) & set(rows)
    assert {rows[i]["status"] for i in due} == {"failed"}
    assert world.cursor() == cursor and result["cursor_after"] == result["cursor_before"]
