"""Chains and the fence: the rule row holds the token of the one chain allowed to write for it."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from delivery.domain import ChainReport, Cursor
from delivery.store.tables import breaker_states_table, chains_table, rules_table


@dataclass(frozen=True)
class ChainRow:
    """One row of the `chains` table, as the store reads it."""

    token: str
    rule_id: int
    flow_run_id: str | None
    started_at: datetime
    heartbeat_at: datetime
    ended_at: datetime | None
    ended_by: str | None
    message: str | None
    #: The chain's report as recorded at its end (`ChainReport.as_json`), None before.
    report: dict[str, Any] | None
    #: The holder of the rule lock while one of the chain's jobs runs (see the table).
    lease_id: str | None
    holder_host: str | None
    holder_pid: int | None
    #: When its run began to run; None for a run the tick launched that no worker started yet.
    running_at: datetime | None = None


def _chain_row(row: sa.Row[Any]) -> ChainRow:
    return ChainRow(**row._asdict())


def start_chain(
    conn: sa.Connection, rule_id: int, flow_run_id: str | None, now: datetime, *, running: bool = True
) -> str:
    """Record a new chain: running now, or (`running` False) launched by the tick for a run no
    worker has started yet. It becomes the rule's current chain only when its first job claims the
    rule under the lock (`claim`), so a chain in the middle of a job is never cut off mid-record."""
    token = uuid.uuid4().hex
    conn.execute(
        chains_table.insert().values(
            token=token,
            rule_id=rule_id,
            flow_run_id=flow_run_id,
            started_at=now,
            heartbeat_at=now,
            running_at=now if running else None,
        )
    )
    return token


def adopt_chain(
    conn: sa.Connection, token: str, rule_id: int, flow_run_id: str | None, now: datetime | None = None
) -> datetime:
    """Take over a chain row the tick recorded when it launched this run: it runs from `now` (a
    heartbeat too). Returns its start."""
    row = conn.execute(
        sa.select(chains_table).where(chains_table.c.token == token, chains_table.c.rule_id == rule_id)
    ).one_or_none()
    if row is None or row.ended_at is not None:
        raise LookupError(f"chain {token} of this rule does not exist or has already ended")
    running = {"running_at": now, "heartbeat_at": now} if now is not None else {}
    conn.execute(chains_table.update().where(chains_table.c.token == token).values(flow_run_id=flow_run_id, **running))
    return row.started_at  # type: ignore[no-any-return]


def claim(conn: sa.Connection, rule_id: int, token: str, started_at: datetime) -> bool:
    """Make `token` the rule's current chain unless it has ended already or a chain started after
    it already holds the rule: of two chains racing, the most recently started one goes on, the
    other is superseded.
    Called under the rule lock, with the rule row locked (PostgreSQL) or the database write-locked
    (SQLite), so no other job can be between a fence check and its write."""
    current = conn.execute(
        sa.select(rules_table.c.chain_token).where(rules_table.c.id == rule_id).with_for_update()
    ).scalar()
    # A chain ended already (the tick judged it dead and superseded it before its first job got
    # the lock) claims nothing: the rule may have a newer chain, or none, and either way not this one.
    if conn.execute(sa.select(chains_table.c.ended_at).where(chains_table.c.token == token)).scalar() is not None:
        return False
    if current == token:
        return True
    if current is not None:
        other = conn.execute(
            sa.select(chains_table.c.started_at, chains_table.c.ended_at).where(chains_table.c.token == current)
        ).one_or_none()
        if other is not None and other.ended_at is None and (other.started_at, current) > (started_at, token):
            return False
    conn.execute(rules_table.update().where(rules_table.c.id == rule_id).values(chain_token=token))
    return True


def newer_waiting(
    conn: sa.Connection, rule_id: int, token: str, started_at: datetime, alive_since: datetime
) -> ChainRow | None:
    """A chain of the rule started after `token`, not ended, with a heartbeat since `alive_since`:
    one waiting for the rule lock while `token` holds it job after job. A range seek on
    (rule_id, started_at) over the few chains newer than this one."""
    row = conn.execute(
        sa.select(chains_table)
        .where(
            chains_table.c.rule_id == rule_id,
            chains_table.c.started_at >= started_at,
            # Started in the same instant: the token breaks the tie, as in `claim`.
            sa.or_(chains_table.c.started_at > started_at, chains_table.c.token > token),
            chains_table.c.ended_at.is_(None),
            chains_table.c.heartbeat_at >= alive_since,
        )
        .order_by(chains_table.c.started_at.desc())
        .limit(1)
    ).first()
    return None if row is None else _chain_row(row)


def holds_fence(conn: sa.Connection, rule_id: int, token: str) -> bool:
    """True while `token` is the rule's current chain. On PostgreSQL the rule row stays locked until
    the caller's transaction ends, so a supersede cannot slip between this check and the writes it
    guards; on SQLite the write transaction (BEGIN IMMEDIATE) already excludes every other writer."""
    current = conn.execute(
        sa.select(rules_table.c.chain_token).where(rules_table.c.id == rule_id).with_for_update()
    ).scalar()
    return current == token


_FENCE_FOR_SETTLE = (
    sa.select(
        rules_table.c.chain_token,
        breaker_states_table.c.state,
        breaker_states_table.c.fail_counter,
        breaker_states_table.c.success_counter,
        breaker_states_table.c.opened_at,
    )
    .select_from(
        rules_table.outerjoin(breaker_states_table, breaker_states_table.c.connection_id == sa.bindparam("target_id"))
    )
    .where(rules_table.c.id == sa.bindparam("rule_id"))
    .with_for_update(read=True, of=rules_table)
)


def holds_fence_for_settle(
    conn: sa.Connection, rule_id: int, token: str, target_id: int
) -> tuple[bool, Mapping[str, Any] | None]:
    """The fence check before one record's settle, and the target's breaker row read in the same
    statement (see `DatabaseBreakerStorage.observe`). On PostgreSQL the rule row is taken FOR SHARE:
    a supersede or a claim (an UPDATE of that row) still waits until this transaction ends, but the
    workers of one batch settle side by side instead of queueing on the rule row. The statement is
    built once: it runs once per record."""
    row = conn.execute(_FENCE_FOR_SETTLE, {"rule_id": rule_id, "target_id": target_id}).one()
    breaker = None if row.state is None else {k: v for k, v in row._asdict().items() if k != "chain_token"}
    return row.chain_token == token, breaker


def supersede(conn: sa.Connection, rule_id: int, token: str, now: datetime, message: str) -> None:
    """End a chain judged dead and close the fence on it: a late job of it writes nothing."""
    # The rule row first, then the chain row: the order a settle takes them in (fence, then
    # heartbeat), so the two can wait for each other but never deadlock.
    conn.execute(
        rules_table.update()
        .where(rules_table.c.id == rule_id, rules_table.c.chain_token == token)
        .values(chain_token=None)
    )
    conn.execute(
        chains_table.update()
        .where(chains_table.c.token == token, chains_table.c.ended_at.is_(None))
        .values(ended_at=now, ended_by="superseded", message=message)
    )
    # The lock holder stays on record (lease, host, pid): a superseded chain may still be inside a
    # job holding the rule lock, and a waiter must go on judging that holder, not a slot held by
    # nobody. Its own release clears the record; a waiter that frees a dead holder clears it too.


_HEARTBEAT = chains_table.update().where(chains_table.c.token == sa.bindparam("chain_token"))


def ended_message(conn: sa.Connection, token: str) -> str | None:
    """Why the chain `token` was ended by someone else (the tick judging it dead, `apply` moving
    its rule), or None while it has not ended."""
    row = conn.execute(
        sa.select(chains_table.c.ended_at, chains_table.c.message).where(chains_table.c.token == token)
    ).one_or_none()
    return None if row is None or row.ended_at is None else row.message


def heartbeat(conn: sa.Connection, token: str, now: datetime) -> None:
    conn.execute(_HEARTBEAT, {"chain_token": token, "heartbeat_at": now})


def move_cursor(conn: sa.Connection, rule_id: int, to: Cursor) -> Cursor:
    """Move the cursor forward to `to`; never backwards. Returns where it stands."""
    row = conn.execute(
        sa.select(rules_table.c.cursor_changed_at, rules_table.c.cursor_record_id).where(rules_table.c.id == rule_id)
    ).one()
    if row.cursor_changed_at is not None:
        current = Cursor(row.cursor_changed_at, int(row.cursor_record_id))
        if current >= to:
            return current
    conn.execute(
        rules_table.update()
        .where(rules_table.c.id == rule_id)
        .values(cursor_changed_at=to.changed_at, cursor_record_id=to.record_id)
    )
    return to


def end_chain(conn: sa.Connection, report: ChainReport, now: datetime) -> None:
    conn.execute(
        chains_table.update()
        .where(chains_table.c.token == report.token)
        .values(
            ended_at=now,
            heartbeat_at=now,
            ended_by=report.ended_by.value,
            message=report.message,
            report=report.as_json(),
        )
    )


def chain_by_flow_run(conn: sa.Connection, flow_run_id: str) -> ChainRow | None:
    row = conn.execute(sa.select(chains_table).where(chains_table.c.flow_run_id == flow_run_id)).one_or_none()
    return None if row is None else _chain_row(row)


def last_chain(conn: sa.Connection, rule_id: int) -> ChainRow | None:
    row = conn.execute(
        sa.select(chains_table)
        .where(chains_table.c.rule_id == rule_id)
        .order_by(chains_table.c.started_at.desc())
        .limit(1)
    ).one_or_none()
    return None if row is None else _chain_row(row)


def open_chains(conn: sa.Connection, rule_id: int) -> list[ChainRow]:
    """Chains of the rule that have not ended, newest first."""
    rows = conn.execute(
        sa.select(chains_table)
        .where(chains_table.c.rule_id == rule_id, chains_table.c.ended_at.is_(None))
        .order_by(chains_table.c.started_at.desc())
    )
    return [_chain_row(row) for row in rows]


def record_lock(
    conn: sa.Connection, token: str, lease_id: str | None, host: str | None, pid: int | None, now: datetime
) -> None:
    """Who holds the rule lock (Prefect lease id, host, pid), so that a waiter can tell a dead holder."""
    conn.execute(
        chains_table.update()
        .where(chains_table.c.token == token)
        .values(lease_id=lease_id, holder_host=host, holder_pid=pid, heartbeat_at=now)
    )


def lock_holders(conn: sa.Connection, rule_id: int) -> list[ChainRow]:
    rows = conn.execute(
        sa.select(chains_table).where(chains_table.c.rule_id == rule_id, chains_table.c.lease_id.is_not(None))
    )
    return [_chain_row(row) for row in rows]


def attach_flow_run(conn: sa.Connection, token: str, flow_run_id: str) -> None:
    conn.execute(chains_table.update().where(chains_table.c.token == token).values(flow_run_id=flow_run_id))


def previous_end(conn: sa.Connection, rule_id: int, token: str, telling: Iterable[str]) -> str | None:
    """How the rule's last chain before `token` that ended in one of the `telling` ways ended."""
    value = conn.execute(
        sa.select(chains_table.c.ended_by)
        .where(
            chains_table.c.rule_id == rule_id,
            chains_table.c.token != token,
            chains_table.c.ended_at.is_not(None),
            chains_table.c.ended_by.in_(list(telling)),
        )
        .order_by(chains_table.c.ended_at.desc())
        .limit(1)
    ).scalar()
    return None if value is None else str(value)
