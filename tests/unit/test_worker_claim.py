"""What `delivery worker` claims from the pool, with a stand-in for the Prefect client (the real
server is in tests/acceptance/test_warm_worker.py): only runs of this package's flows, oldest
first, only those the server accepts as Pending, and never more than the limit."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any
from uuid import UUID, uuid4

import pytest
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.responses import SetStateStatus

from flows.worker import WarmWorker

T0 = datetime(2026, 12, 6, tzinfo=UTC)


@dataclass
class FakeClient:
    """The four calls `_claim` makes, answering from a script."""

    runs: list[Any]
    flow_names: dict[UUID, str]
    refused: set[UUID] = field(default_factory=set)
    proposed: list[UUID] = field(default_factory=list)
    flows_read: list[UUID] = field(default_factory=list)
    #: Runs whose Pending the server accepts but whose answer never reaches the worker.
    answer_lost: set[UUID] = field(default_factory=set)
    states: dict[UUID, str] = field(default_factory=dict)

    async def get_scheduled_flow_runs_for_work_pool(self, **_: Any) -> list[Any]:
        return [SimpleNamespace(flow_run=run) for run in self.runs]

    async def read_flow(self, flow_id: UUID) -> Any:
        self.flows_read.append(flow_id)
        return SimpleNamespace(name=self.flow_names[flow_id])

    async def set_flow_run_state(self, run_id: UUID, state: Any, force: bool) -> Any:
        if state.type.value == "SCHEDULED":  # a hand-back
            assert force is True
            self.states[run_id] = "SCHEDULED"
            return SimpleNamespace(status=SetStateStatus.ACCEPT)
        assert state.type.value == "PENDING" and force is False
        self.proposed.append(run_id)
        status = SetStateStatus.REJECT if run_id in self.refused else SetStateStatus.ACCEPT
        if status is SetStateStatus.ACCEPT:
            self.states[run_id] = "PENDING"
        if run_id in self.answer_lost:
            raise TimeoutError("the server's answer never came")
        return SimpleNamespace(status=status)

    async def read_flow_run(self, run_id: UUID) -> Any:
        state = self.states.get(run_id, "SCHEDULED")
        return SimpleNamespace(state=SimpleNamespace(type=StateType(state)))


def _run(flow_id: UUID, minutes: int) -> Any:
    return SimpleNamespace(
        id=uuid4(), flow_id=flow_id, name=f"run-{minutes}", expected_start_time=T0 + timedelta(minutes=minutes)
    )


def _worker(limit: int, said: list[str] | None = None) -> tuple[WarmWorker, list[Any]]:
    ours = object()
    say = (lambda _: None) if said is None else said.append
    worker = WarmWorker(limit=limit, say=say, flows={"deliver-rule": ours})  # type: ignore[dict-item]
    started: list[Any] = []
    worker._start = lambda flow, run: (started.append(run), worker._in_flight.__setitem__(run.id, run))  # type: ignore[method-assign,func-returns-value]
    return worker, started


def test_only_our_flows_oldest_first_and_only_what_the_server_accepts() -> None:
    chain, other = uuid4(), uuid4()
    late, foreign, refused, early = _run(chain, 3), _run(other, 0), _run(chain, 2), _run(chain, 1)
    client = FakeClient(
        [late, foreign, refused, early], {chain: "deliver-rule", other: "someone-elses-flow"}, {refused.id}
    )
    said: list[str] = []
    worker, started = _worker(limit=8, said=said)
    asyncio.run(worker._claim(client))
    assert started == [early, late]
    assert client.proposed == [early.id, refused.id, late.id]  # the foreign run is never touched
    assert sorted(client.flows_read) == sorted({chain, other})  # each flow's name read once
    # Said once, plainly, however often the foreign run is seen again.
    asyncio.run(worker._claim(client))
    foreign_lines = [line for line in said if "someone-elses-flow" in line]
    assert foreign_lines == [
        f"worker {worker.name}: runs of flow 'someone-elses-flow' are not this worker's: "
        "left for a process worker on the pool"
    ]


def test_never_more_than_the_limit_in_flight() -> None:
    chain = uuid4()
    runs = [_run(chain, minute) for minute in range(5)]
    worker, started = _worker(limit=2)
    client = FakeClient(runs, {chain: "deliver-rule"})
    asyncio.run(worker._claim(client))
    assert started == runs[:2] and client.proposed == [runs[0].id, runs[1].id]
    asyncio.run(worker._claim(client))  # full: nothing more is proposed
    assert len(client.proposed) == 2


def test_a_run_claimed_whose_answer_was_lost_is_handed_back_not_left_pending() -> None:
    """Seen under load: the server made the run Pending for this worker, the answer was lost, the
    worker never started it, and it waited in Pending for nobody until the dead-chain threshold."""
    chain = uuid4()
    lost, fine = _run(chain, 0), _run(chain, 1)
    client = FakeClient([lost, fine], {chain: "deliver-rule"}, answer_lost={lost.id})
    worker, started = _worker(limit=8)
    with pytest.raises(TimeoutError):  # the poll fails; the next one goes on
        asyncio.run(worker._claim(client))
    assert client.states[lost.id] == "SCHEDULED" and started == []
    client.answer_lost.clear()
    asyncio.run(worker._claim(client))
    assert started == [lost, fine]
