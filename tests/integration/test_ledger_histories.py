"""Generated histories against the ledger's promises (hypothesis' stateful testing).

A state machine drives the real chain code (the real store on SQLite, the real local HTTP target,
no Prefect) through generated sequences of: a record changed, reverted to an earlier body,
deleted in the source (the rule propagates deletes) or restored; a fault the target gives one
record's next request (refused 422, gone 404, down 503, 429 with Retry-After, applied but answered
late, dropped before applying, a create answered without an id); a chain abandoned between a
send and its settle (the in-process kill -9); a requeue of what is parked; a rule saved while its
chain runs; time passing.

When the history ends the world quiesces (faults cleared, the late writes landed, time advanced,
chains run until one finds nothing to do), and then the target must hold no copy of a record
deleted in the source, and for every record that is not deleted exactly one copy with the
mirror's latest body, and the ledger row
must say delivered (or suppressed) with that copy's id, unless the row is parked (`exhausted`,
`remote_gone`) for a reason the target gave. A ledger that ever claims to know a body the target
does not hold (an answer never seen) shows up here as a stale copy.

`make test` runs a small budget; `make fuzz` (HYPOTHESIS_PROFILE=fuzz) a far larger one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from delivery import db
from delivery.apply import apply_config
from delivery.clock import utcnow
from delivery.config import parse_config
from delivery.domain import LedgerStatus, MirrorInput
from delivery.store import ledger, requeue
from delivery.store.mirror import load_records
from delivery.store.tables import breaker_states_table, ledger_table, mirror_records_table
from tests.support.chains import drive
from tests.target_server import Answer, TargetServer

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]

RULE = "contacts-to-crm"
IDS = ("r0", "r1")
#: Two bodies: every other change is a revert to the body the target last confirmed.
NAMES = ("A", "B")
TIMEOUT = 0.2
#: Longer than TIMEOUT: the target applies the write after the client gave up on it.
LATE = 0.45
#: What a change's next request meets; the answers never seen come twice as often (they are what the
#: ledger must not be fooled by).
FAULTS = ("none", "none", "late", "late", "dropped", "dropped", "refused", "down", "rate_limited", "no_id")
#: Chains run at the end to catch up; more than any history needs (each settles what is due).
QUIESCE_CHAINS = 12


class Abandoned(BaseException):
    """The in-process kill -9: the chain stops dead between a send and its settle."""


class CountingTarget(TargetServer):
    """The shared test target, counting the requests it is working on (a late write lands after
    its client gave up: the world is quiet only once none is left)."""

    def __init__(self) -> None:
        super().__init__(token="history-token")
        self.in_flight = 0
        #: Remote ids someone deletes in the target just before the next update reaches it.
        self.doomed: set[str] = set()

    def _dispatch(self, method: str, raw_path: str, headers: Any, raw: bytes) -> Any:
        with self._lock:
            self.in_flight += 1
            remote_id = raw_path.rstrip("/").rsplit("/", 1)[-1]
            if method == "PATCH" and remote_id in self.doomed:
                self.doomed.discard(remote_id)
                for store in self._collections.values():
                    store.pop(remote_id, None)
        try:
            return super()._dispatch(method, raw_path, headers, raw)
        finally:
            with self._lock:
                self.in_flight -= 1

    def wait_quiet(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            with self._lock:
                if self.in_flight == 0:
                    return
            assert time.monotonic() < deadline, "the target never went quiet"
            time.sleep(0.01)

    def reset(self) -> None:
        super().reset()
        with self._lock:
            self.doomed.clear()


def config(
    base_url: str, *, settle: str = "grouped", batch_size: int = 2, concurrency: int = 1, max_attempts: int = 4
) -> dict[str, Any]:
    return {
        "connections": [
            {
                "name": "crm",
                "driver": "rest",
                "base_url": base_url,
                "token_env": "HISTORY_TOKEN",
                "timeout_seconds": TIMEOUT,
                "settle": settle,
                "breaker": {"fail_max": 4, "reset_seconds": 60},
            },
            {"name": "shop"},
        ],
        "rules": [
            {
                "name": RULE,
                "source": "shop",
                "domain": "contact",
                "target": "crm",
                "collection": "contacts",
                "batch_size": batch_size,
                "concurrency": concurrency,
                "max_attempts": max_attempts,
                "retry_schedule_seconds": [30],
                "deletes": "propagate",
            }
        ],
    }


@contextlib.contextmanager
def settles_die_after(count: int) -> Iterator[None]:
    """The `count` settles after this pass; the next one dies before writing."""
    real = ledger.settle
    lock = threading.Lock()
    left = [count]

    def settle(*args: Any, **kwargs: Any) -> bool:
        with lock:
            if left[0] <= 0:
                raise Abandoned
            left[0] -= 1
        return real(*args, **kwargs)

    def settle_many(conn: Any, rule: Any, settles: Any, now: Any) -> list[bool]:
        return [settle(conn, rule, candidate, outcome, now) for candidate, outcome in settles]

    real_many = ledger.settle_many
    ledger.settle = settle  # type: ignore[assignment]
    ledger.settle_many = settle_many  # type: ignore[assignment]
    try:
        yield
    finally:
        ledger.settle = real  # type: ignore[assignment]
        ledger.settle_many = real_many  # type: ignore[assignment]


def histories(template: Path, workdir: Path, target: CountingTarget) -> type[RuleBasedStateMachine]:
    class Histories(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            target.reset()
            path = workdir / f"history-{time.monotonic_ns()}.db"
            shutil.copy(template, path)
            self.path = path
            self.engine = db.create_engine(f"sqlite:///{path}")
            self.apply(config(target.url))
            #: Each record's bodies in the source, oldest first (a revert goes back to one of them).
            self.bodies: dict[str, list[str]] = {}
            self.deleted: set[str] = set()

        # -- the source ----------------------------------------------------------------------------

        def apply(self, data: dict[str, Any]) -> None:
            with self.engine.begin() as conn:
                apply_config(conn, parse_config(yaml.safe_dump(data)))

        def load(self, external_id: str, name: str, *, deleted: bool = False) -> None:
            payload = {"email": f"{external_id}@example.com", "name": name}
            with self.engine.begin() as conn:
                load_records(conn, "shop", "contact", [MirrorInput(external_id, payload, deleted)])
            if deleted:
                self.deleted.add(external_id)
            else:
                self.deleted.discard(external_id)
                self.bodies.setdefault(external_id, []).append(name)

        @rule(external_id=st.sampled_from(IDS), fault=st.sampled_from(FAULTS))
        def change(self, external_id: str, fault: str) -> None:
            """A change in the source (to the other body: every other change is a revert); its
            next request to the target meets `fault`."""
            bodies = self.bodies.get(external_id)
            self.load(external_id, NAMES[(NAMES.index(bodies[-1]) + 1) % len(NAMES)] if bodies else NAMES[0])
            self.fault(external_id, fault)

        @precondition(lambda self: bool(self.bodies))
        @rule(data=st.data(), fault=st.sampled_from(FAULTS))
        def delete(self, data: st.DataObject, fault: str) -> None:
            """A record deleted in the source (a later `change` restores it); the rule propagates
            deletes, and the delete's request meets `fault`."""
            external_id = data.draw(st.sampled_from(sorted(self.bodies)))
            self.load(external_id, self.bodies[external_id][-1], deleted=True)
            self.fault(external_id, fault)

        # -- the target ----------------------------------------------------------------------------

        def fault(self, external_id: str, fault: str) -> None:
            """The record's next request meets `fault`: its update's if it has a remote id (else
            its create's), or its create's where the fault is about a create."""
            if fault == "none":
                return
            answer = {
                "refused": Answer.status(422),
                "down": Answer.status(503),
                "rate_limited": Answer.status(429, headers={"Retry-After": "5"}),
                "late": Answer.timeout(LATE),
                "dropped": Answer.drop(),
                "no_id": Answer.no_id(),
            }[fault]
            remote_id = self.remote_id(external_id)
            if remote_id is not None and fault != "no_id":
                target.program_remote(remote_id, answer)
            else:
                target.program(f"{external_id}@example.com", answer)

        @rule(external_id=st.sampled_from(IDS), name=st.sampled_from(NAMES))
        def gone(self, external_id: str, name: str) -> None:
            """Someone deletes the record in the target, and its next update meets 404."""
            remote_id = self.remote_id(external_id)
            if remote_id is not None and external_id not in self.deleted:
                with target._lock:
                    target.doomed.add(remote_id)
                self.load(external_id, name)

        # -- the engine ----------------------------------------------------------------------------

        @rule(
            how=st.sampled_from(["whole", "whole", "abandoned", "abandoned", "saved mid-chain"]),
            settles=st.integers(min_value=0, max_value=1),
            saved=st.fixed_dictionaries(
                {
                    "settle": st.sampled_from(["grouped", "per_record"]),
                    "batch_size": st.sampled_from([1, 2, 5]),
                    "concurrency": st.sampled_from([1, 3]),
                    "max_attempts": st.sampled_from([3, 4, 6]),
                }
            ),
        )
        def chain(self, how: str, settles: int, saved: dict[str, Any]) -> None:
            """A chain run whole, abandoned after `settles` settles (the next one dies before
            writing), or with the rule saved (`saved`) after its first job."""
            self.make_due()  # time passes: what failed is due, a tripped breaker has cooled down
            if how == "abandoned":
                with settles_die_after(settles), contextlib.suppress(Abandoned):
                    drive(self.engine, RULE)
            elif how == "whole":
                drive(self.engine, RULE)
            else:
                done: list[bool] = []

                def save(_chain: Any, _report: Any) -> None:
                    if not done:
                        done.append(True)
                        self.apply(config(target.url, **saved))

                drive(self.engine, RULE, between_jobs=save)
                if not done:
                    self.apply(config(target.url, **saved))

        @rule()
        def requeue(self) -> None:
            with self.engine.begin() as conn:
                requeue.requeue_or_preview(conn, RULE, requeue.Selection.of(), "history", utcnow(), dry_run=False)

        def make_due(self) -> None:
            """Time passes: longer than any retry step. So a write answered late has landed by then
            (a retry the schedule holds back for seconds never overtakes a write that timed out
            after a fraction of one), what failed is due, and a tripped breaker has cooled down."""
            target.wait_quiet()
            with self.engine.begin() as conn:
                due = utcnow() - timedelta(seconds=1)
                conn.execute(ledger_table.update().where(ledger_table.c.status == "failed").values(next_attempt_at=due))
                conn.execute(breaker_states_table.update().values(opened_at=utcnow() - timedelta(hours=1)))

        # -- what must hold ------------------------------------------------------------------------

        def remote_id(self, external_id: str) -> str | None:
            return self.rows().get(external_id, {}).get("remote_id")

        def rows(self) -> dict[str, dict[str, Any]]:
            with self.engine.connect() as conn:
                query = sa.select(mirror_records_table.c.external_id, ledger_table).join(
                    mirror_records_table, mirror_records_table.c.id == ledger_table.c.record_id
                )
                return {row.external_id: row._asdict() for row in conn.execute(query)}

        @invariant()
        def never_two_copies(self) -> None:
            emails = [r.get("email") for r in target.records("contacts").values()]
            assert len(emails) == len(set(emails)), emails

        def teardown(self) -> None:
            try:
                self.quiesce_and_check()
            finally:
                self.engine.dispose()
                self.path.unlink(missing_ok=True)

        def quiesce_and_check(self) -> None:
            target.wait_quiet()
            with target._lock:
                target._scripts.clear()
                target.doomed.clear()
            for _ in range(QUIESCE_CHAINS):
                self.make_due()
                report = drive(self.engine, RULE)
                if not any(report.counts.values()) and not any(
                    row["status"] == LedgerStatus.FAILED.value for row in self.rows().values()
                ):
                    break
            else:
                raise AssertionError(f"no quiet after {QUIESCE_CHAINS} chains: {self.rows()}")
            held = {r["email"]: r for r in target.records("contacts").values()}
            rows = self.rows()
            for external_id, bodies in self.bodies.items():
                if external_id in self.deleted:
                    # Deleted in the source: the target holds no copy of it, unless its row is
                    # parked for a reason the target gave (a delete refused, an unaddressable create).
                    row = rows.get(external_id)
                    if row is not None and LedgerStatus(row["status"]).is_terminal:
                        assert row["last_error"], row
                        continue
                    copy = held.get(f"{external_id}@example.com")
                    assert copy is None, f"{external_id}: deleted in the source, still in the target; ledger {row}"
                    assert row is None or row["status"] in ("deleted", "suppressed"), row
                    continue
                row = rows.get(external_id)
                assert row is not None, f"{external_id}: no ledger row"
                if LedgerStatus(row["status"]).is_terminal:
                    assert row["last_error"], row  # parked for a reason the target gave
                    continue
                copy = held.get(f"{external_id}@example.com")
                assert copy is not None, f"{external_id}: the target holds no copy; ledger {row}"
                assert row["status"] in ("delivered", "suppressed"), row
                assert copy["id"] == row["remote_id"], (copy, row)
                assert copy["name"] == bodies[-1], (
                    f"{external_id}: the target holds {copy['name']!r}, the mirror {bodies[-1]!r}; ledger {row}"
                )

    return Histories


@pytest.fixture(scope="module")
def history_target() -> Iterator[CountingTarget]:
    server = CountingTarget().start()
    yield server
    server.stop()


def test_generated_histories_leave_the_target_on_the_mirrors_latest_bodies(
    sqlite_template: Path, tmp_path: Path, history_target: CountingTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HISTORY_TOKEN", "history-token")
    fuzz = os.environ.get("HYPOTHESIS_PROFILE") == "fuzz"
    budget = settings(
        settings.default,
        max_examples=400 if fuzz else 14,
        stateful_step_count=40 if fuzz else 25,
        deadline=None,
    )
    run_state_machine_as_test(histories(sqlite_template, tmp_path, history_target), settings=budget)


#: The histories that once left the target stale while the ledger said delivered, written
#: out step by step through the same machine, so each is checked on every run whatever the
#: generator happens to draw.
STALE_PATHS = {
    "an update applied but answered late, then a revert": [
        ("change", {"external_id": "r0", "fault": "none"}),
        ("chain", {"how": "whole"}),
        ("change", {"external_id": "r0", "fault": "late"}),
        ("chain", {"how": "whole"}),
        ("change", {"external_id": "r0", "fault": "none"}),
        ("chain", {"how": "whole"}),
    ],
    "an update killed before its settle, then a revert": [
        ("change", {"external_id": "r0", "fault": "none"}),
        ("chain", {"how": "whole"}),
        ("change", {"external_id": "r0", "fault": "none"}),
        ("chain", {"how": "abandoned", "settles": 0}),
        ("change", {"external_id": "r0", "fault": "none"}),
        ("chain", {"how": "whole"}),
    ],
    "a replayed create's follow-up killed before its settle, then a revert": [
        ("change", {"external_id": "r0", "fault": "none"}),
        ("chain", {"how": "abandoned", "settles": 0}),
        ("change", {"external_id": "r0", "fault": "none"}),
        ("chain", {"how": "abandoned", "settles": 0}),
        ("change", {"external_id": "r0", "fault": "none"}),
        ("chain", {"how": "whole"}),
    ],
    # The key's first body was never applied: a later body under the same key, answered late,
    # made the record, and the revert to the first body must not be taken for what it holds.
    "a create refused, then its replay with a newer body applied but answered late, then a revert": [
        ("change", {"external_id": "r0", "fault": "refused"}),
        ("chain", {"how": "whole"}),
        ("change", {"external_id": "r0", "fault": "late"}),
        ("chain", {"how": "whole"}),
        ("change", {"external_id": "r0", "fault": "none"}),
        ("chain", {"how": "whole"}),
    ],
    "a create met the target down, then its replay with a newer body applied but answered late, then a revert": [
        ("change", {"external_id": "r0", "fault": "down"}),
        ("chain", {"how": "whole"}),
        ("change", {"external_id": "r0", "fault": "late"}),
        ("chain", {"how": "whole"}),
        ("change", {"external_id": "r0", "fault": "none"}),
        ("chain", {"how": "whole"}),
    ],
}


@pytest.mark.parametrize("settle", ["grouped", "per_record"])
@pytest.mark.parametrize("path", list(STALE_PATHS))
def test_the_histories_that_once_left_the_target_stale(
    sqlite_template: Path,
    tmp_path: Path,
    history_target: CountingTarget,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    settle: str,
) -> None:
    monkeypatch.setenv("HISTORY_TOKEN", "history-token")
    machine = histories(sqlite_template, tmp_path, history_target)()
    machine.apply(config(history_target.url, settle=settle))
    defaults = {"settles": 0, "saved": {}}
    for step, arguments in STALE_PATHS[path]:
        getattr(machine, step)(**({**defaults, **arguments} if step == "chain" else arguments))
        machine.never_two_copies()
    machine.teardown()
