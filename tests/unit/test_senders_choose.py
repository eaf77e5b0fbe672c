"""`delivery.senders.choose`, the one place a job's sender and settle are picked, over every kind
of writer (sync verbs, async verbs, both, batch verbs) and every connection (settle mode, rate
budget): the table its docstring states, checked case by case."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from delivery.domain import Connection, ConnectionStatus, RateLimit, SettleMode
from delivery.send_batches import BatchCalls
from delivery.send_loop import EventLoop
from delivery.send_one import OneAtATime
from delivery.send_threads import Threads
from delivery.senders import choose
from delivery.writers.base import (
    CreateItem,
    CreateResult,
    Creates,
    CreatesAsync,
    CreatesMany,
    Updates,
    UpdatesAsync,
    Writer,
)


class SyncOnly(Writer, Creates, Updates):
    def create(self, body: Mapping[str, Any], idempotency_key: str) -> str:
        return "r-1"

    def update(self, remote_id: str, body: Mapping[str, Any]) -> None:
        return None


class AsyncOnly(Writer, CreatesAsync, UpdatesAsync):
    async def acreate(self, body: Mapping[str, Any], idempotency_key: str) -> str:
        return "r-1"

    async def aupdate(self, remote_id: str, body: Mapping[str, Any]) -> None:
        return None


class Both(SyncOnly, CreatesAsync, UpdatesAsync):
    """The `rest` writers' shape: every verb one record per call, sync and async."""

    async def acreate(self, body: Mapping[str, Any], idempotency_key: str) -> str:
        return "r-1"

    async def aupdate(self, remote_id: str, body: Mapping[str, Any]) -> None:
        return None


class BothAndBatches(Both, CreatesMany):
    def create_many(self, items: Sequence[CreateItem]) -> list[CreateResult]:
        return ["r-1" for _ in items]


def target(settle: SettleMode, budget: bool) -> Connection:
    return Connection(
        id=1,
        name="crm",
        driver="test",
        status=ConnectionStatus.ACTIVE,
        settle=settle,
        rate_limit=RateLimit(per_second=5) if budget else None,
    )


#: (writer, settle, a rate budget) -> the sender; the settle always follows the connection.
EXPECTED: dict[tuple[type[Writer], SettleMode, bool], type] = {
    # Batch verbs on a grouped connection: batch calls, budget or not.
    (BothAndBatches, SettleMode.GROUPED, False): BatchCalls,
    (BothAndBatches, SettleMode.GROUPED, True): BatchCalls,
    # Per record, a writer with sync verbs takes them one at a time on threads (its batches unused).
    (BothAndBatches, SettleMode.PER_RECORD, False): OneAtATime,
    (BothAndBatches, SettleMode.PER_RECORD, True): OneAtATime,
    (Both, SettleMode.PER_RECORD, False): OneAtATime,
    (Both, SettleMode.PER_RECORD, True): OneAtATime,
    (SyncOnly, SettleMode.PER_RECORD, False): OneAtATime,
    (SyncOnly, SettleMode.PER_RECORD, True): OneAtATime,
    # Grouped: the loop where there is no budget, threads where there is.
    (Both, SettleMode.GROUPED, False): EventLoop,
    (Both, SettleMode.GROUPED, True): Threads,
    (SyncOnly, SettleMode.GROUPED, False): Threads,
    (SyncOnly, SettleMode.GROUPED, True): Threads,
    # Nothing but async verbs: always the loop.
    (AsyncOnly, SettleMode.GROUPED, False): EventLoop,
    (AsyncOnly, SettleMode.GROUPED, True): EventLoop,
    (AsyncOnly, SettleMode.PER_RECORD, False): EventLoop,
    (AsyncOnly, SettleMode.PER_RECORD, True): EventLoop,
}


def test_the_table_covers_every_case() -> None:
    writers = (SyncOnly, AsyncOnly, Both, BothAndBatches)
    assert set(EXPECTED) == set(itertools.product(writers, SettleMode, (False, True)))


@pytest.mark.parametrize(("writer_type", "settle", "budget"), sorted(EXPECTED, key=repr))
def test_the_sender_and_the_settle_chosen(writer_type: type[Writer], settle: SettleMode, budget: bool) -> None:
    connection = target(settle, budget)
    sender, chosen_settle = choose(writer_type(connection, "contacts"), connection)
    assert type(sender) is EXPECTED[(writer_type, settle, budget)]
    assert chosen_settle.mode is settle
