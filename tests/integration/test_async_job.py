"""The async path (`delivery.send_loop.EventLoop`): a writer with async verbs sends from one event
loop, its calls in flight at once (counted on the real local target), a job cut by a timeout raised
into its thread leaves nothing running and every call that may have gone out recorded as unknown,
`run()` works from a thread that runs a loop of its own, and writers of third parties work either
way: one with only sync verbs on threads, one with only async verbs on the loop (grouped and per
record). The fault table, the unknown outcomes and the grouped settles run over both paths in their
own modules (`job_path`); the batch timeout through Prefect in test_chain_edges.py."""

from __future__ import annotations

import asyncio
import ctypes
import threading
from collections.abc import Mapping
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from delivery.chain import Chain
from delivery.domain import Connection, Phase, SettleMode
from delivery.errors import RecordRejected, TargetUnavailable
from delivery.send_loop import EventLoop
from delivery.send_one import OneAtATime
from delivery.send_threads import Threads
from delivery.settle import GROUP_RECORDS, SettleGroups
from delivery.store import ledger
from delivery.writers.base import Creates, CreatesAsync, Updates, UpdatesAsync, Writer
from delivery.writers.registry import register_writer, reset_registry
from tests.integration.engine_events import Commits
from tests.integration.world import RULE, World, email
from tests.support.chains import drive
from tests.target_server import TargetServer

#: Threads of a job: none may outlive it.
JOB_THREADS = ("delivery-loop", "delivery-db", "delivery-wait", "delivery-worker", "delivery-settle")


def _job_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(JOB_THREADS)]


def _wait_for(condition: Any, what: str, seconds: float = 30.0) -> None:
    done = threading.Event()
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError(f"never: {what}")


@pytest.mark.parametrize("concurrency", [8, 32])
def test_the_loop_keeps_the_rules_concurrency_in_flight_and_no_more(
    engine: sa.Engine, target: TargetServer, concurrency: int
) -> None:
    world = World(engine, target).apply(
        rule={"concurrency": concurrency, "batch_size": 200}, target={"timeout_seconds": 10}
    )
    ids = [f"r{n:03d}" for n in range(3 * concurrency)]
    world.load(*ids)
    target.latency_ms = 300  # every call outlasts the time it takes to start all of them
    chain = Chain(engine, RULE)
    assert chain.open() is None
    assert type(chain._ways()[0]) is EventLoop
    report = chain.run_batch(Phase.SCAN)
    chain.finish()
    assert report.counts["delivered"] == len(ids)
    assert target.max_in_flight == concurrency
    assert _job_threads() == []


def test_a_timeout_raised_into_the_jobs_thread_cuts_it_and_what_may_have_gone_out_stays_unknown(
    engine: sa.Engine, target: TargetServer
) -> None:
    """What Prefect does to a batch task that overruns its timeout (an exception raised into the
    task's thread): the tasks are cancelled where they wait, the job's threads are gone when
    `run_batch` raises, every record the target was sent keeps its create's intent (or its outcome,
    if its group was committed first) and no other record has a row."""
    world = World(engine, target).apply(rule={"concurrency": 8, "batch_size": 200}, target={"timeout_seconds": 10})
    ids = [f"r{n:03d}" for n in range(100)]
    world.load(*ids)
    target.latency_ms = 400
    chain = Chain(engine, RULE)
    assert chain.open() is None
    raised: list[BaseException] = []

    def job() -> None:
        try:
            chain.run_batch(Phase.SCAN)
        except BaseException as exc:
            raised.append(exc)

    runner = threading.Thread(target=job)
    runner.start()
    _wait_for(lambda: len(target.requests) >= 12, "a second round of calls in flight")
    assert runner.ident is not None
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(runner.ident), ctypes.py_object(TimeoutError))
    runner.join(30)
    assert not runner.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], TimeoutError)
    assert _job_threads() == []  # nothing of the job runs on: no call can start after the cut
    chain.finish(raised[0])
    _wait_for(lambda: target.in_flight == 0, "the target done with what it was sent")
    requested = {r.key for r in target.requests}
    rows = world.ledger()
    sent = {i for i in ids if email(i) in requested}
    assert 12 <= len(sent) < len(ids)
    # Whatever may have gone out keeps its row; the intents of the records never reached are taken back.
    assert sent <= set(rows) and len(rows) <= len(sent) + 8, (sorted(rows), sorted(sent))
    for i in rows:
        full = world.full_ledger_row(i)
        # Settled before the cut, or its outcome unknown: in flight, its retry repeating the key.
        assert full["status"] == "delivered" or full["last_error"] == ledger.CREATE_IN_FLIGHT, full
    assert any(world.full_ledger_row(i)["last_error"] == ledger.CREATE_IN_FLIGHT for i in sent)
    # The next chain sends the unknown ones again under the same key: one copy of each record.
    target.latency_ms = 0
    world.make_due()
    drive(engine, RULE)
    copies = sorted(body["email"] for body in target.records("contacts").values())
    assert copies == sorted(email(i) for i in ids)
    assert {row["status"] for row in world.ledger().values()} == {"delivered"}


def test_a_job_run_from_a_thread_that_runs_an_event_loop(engine: sa.Engine, target: TargetServer) -> None:
    """A Prefect task may run on a thread with a running loop: the job's loop runs on a thread
    of its own, never nested."""
    world = World(engine, target).apply(rule={"concurrency": 4})
    world.load("a", "b", "c")
    chain = Chain(engine, RULE)
    assert chain.open() is None

    async def inside_a_loop() -> Any:
        return chain.run_batch(Phase.SCAN)

    report = asyncio.run(inside_a_loop())
    chain.finish()
    assert report.counts["delivered"] == 3


# -- writers of third parties ----------------------------------------------------------------------


class _SyncOnlyWriter(Writer, Creates, Updates):
    """A third party's writer written for the sync protocol alone."""

    thread_safe = True

    def __init__(self, target: Connection, collection: str, *, token: str | None = None) -> None:
        super().__init__(target, collection, token=token)
        assert target.base_url
        self.client = httpx.Client(base_url=target.base_url + "/", headers={"Authorization": f"Bearer {token}"})

    def create(self, body: Mapping[str, Any], idempotency_key: str) -> str:
        answer = self.client.post(self.collection, json=dict(body), headers={"Idempotency-Key": idempotency_key})
        _judge(answer)
        return str(answer.json()["id"])

    def update(self, remote_id: str, body: Mapping[str, Any]) -> None:
        _judge(self.client.patch(f"{self.collection}/{remote_id}", json=dict(body)))

    def close(self) -> None:
        self.client.close()


class _AsyncOnlyWriter(Writer, CreatesAsync, UpdatesAsync):
    """A third party's writer with async verbs alone, as the README shows how to write one."""

    thread_safe = True  # calls may overlap on the loop

    def __init__(self, target: Connection, collection: str, *, token: str | None = None) -> None:
        super().__init__(target, collection, token=token)
        self.client: httpx.AsyncClient | None = None

    async def aopen(self) -> None:
        assert self.target.base_url
        headers = {"Authorization": f"Bearer {self.token}"}
        self.client = httpx.AsyncClient(base_url=self.target.base_url + "/", headers=headers)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def acreate(self, body: Mapping[str, Any], idempotency_key: str) -> str:
        assert self.client is not None
        headers = {"Idempotency-Key": idempotency_key}
        answer = await self.client.post(self.collection, json=dict(body), headers=headers)
        _judge(answer)
        return str(answer.json()["id"])

    async def aupdate(self, remote_id: str, body: Mapping[str, Any]) -> None:
        assert self.client is not None
        _judge(await self.client.patch(f"{self.collection}/{remote_id}", json=dict(body)))


def _judge(answer: httpx.Response) -> None:
    if answer.status_code >= 500:
        raise TargetUnavailable(f"HTTP {answer.status_code}")
    if not answer.is_success:
        raise RecordRejected(f"HTTP {answer.status_code}")


@pytest.mark.parametrize(
    ("writer", "settle", "sender"),
    [
        (_SyncOnlyWriter, "grouped", Threads),
        (_SyncOnlyWriter, "per_record", OneAtATime),
        (_AsyncOnlyWriter, "grouped", EventLoop),
        (_AsyncOnlyWriter, "per_record", EventLoop),
    ],
    ids=["sync-grouped", "sync-per-record", "async-grouped", "async-per-record"],
)
def test_a_third_partys_writer_delivers_on_the_path_its_verbs_ask_for(
    engine: sa.Engine,
    target: TargetServer,
    writer: type[Writer],
    settle: str,
    sender: type[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A group is also committed once its oldest outcome has waited 200 ms; on a loaded machine the
    # records come slower than that and every group holds one. A group held until it is full (or
    # the job closes) makes the count below say whether outcomes are grouped, not how fast they came.
    monkeypatch.setattr(SettleGroups.__init__, "__kwdefaults__", {"records": GROUP_RECORDS, "seconds": 3600.0})
    register_writer("third-party", writer)
    try:
        world = World(engine, target).apply(target={"settle": settle}, rule={"concurrency": 4, "batch_size": 200})
        world.set_driver("third-party")
        ids = [f"t{n:02d}" for n in range(30)]
        world.load(*ids)
        chain = Chain(engine, RULE)
        assert chain.open() is None
        way, way_settle = chain._ways()
        assert (type(way), way_settle.mode) == (sender, SettleMode(settle))
        chain.finish()
        with Commits(engine) as commits:
            drive(engine, RULE)
        world.load(*ids, name="changed")
        drive(engine, RULE)
    finally:
        reset_registry()
    assert {row["status"] for row in world.ledger().values()} == {"delivered"}
    assert all(target.count(email(i)) == 1 for i in ids)  # one create each (the update is keyed by its id)
    assert len([r for r in target.requests if r.method == "PATCH"]) == len(ids)
    assert {body["name"] for body in target.records("contacts").values()} == {"changed"}
    if settle == "per_record":
        assert commits.count >= len(ids)  # each outcome committed before its task's next record
    else:
        assert commits.count < len(ids)


@pytest.mark.parametrize(
    ("target_options", "sender"),
    [({}, EventLoop), ({"rate_limit": {"per_second": 10}}, Threads), ({"settle": "per_record"}, OneAtATime)],
    ids=["grouped", "rate-budget", "per-record"],
)
def test_the_rest_writer_is_sent_from_the_loop_only_on_grouped_targets_without_a_budget(
    engine: sa.Engine, target: TargetServer, target_options: dict[str, Any], sender: type[Any]
) -> None:
    World(engine, target).apply(target=target_options)
    chain = Chain(engine, RULE)
    assert chain.open() is None
    assert type(chain._ways()[0]) is sender
    chain.finish()
