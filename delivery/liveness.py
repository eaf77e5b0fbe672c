"""Telling a dead chain or lock holder from a slow one.

The rule lock (a Prefect concurrency slot) can outlive the process that took it: the embedded
Prefect API runs no lease repossessor, and keeps leases in memory. Our own records say who holds
it (host, pid, a heartbeat at each job and about once a second while it settles records), so a
waiter can judge the holder and free the rule.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from delivery.clock import utcnow
from delivery.store import chains

#: A holder whose heartbeat is older than this is dead, wherever it runs. Heartbeats are written
#: as each job starts and about once a second with its settles, so a live holder is never silent
#: much longer than one write (bounded by the target's timeout, which is added on top).
STALE_HOLDER_SECONDS = 120.0


def this_host() -> str:
    return socket.gethostname()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Holder:
    token: str
    lease_id: str | None
    host: str | None
    pid: int | None
    heartbeat_at: datetime
    #: The holder's Prefect flow run, so a waiter can name it in the run's log.
    flow_run_id: str | None = None


def holder_is_dead(
    holder: Holder,
    now: datetime,
    stale_after: timedelta,
    host: str,
    alive: Callable[[int], bool] = pid_alive,
) -> bool:
    if holder.host == host and holder.pid is not None and not alive(holder.pid):
        return True
    return now - holder.heartbeat_at > stale_after


def lock_holders(engine: sa.Engine, rule_id: int) -> list[Holder]:
    with engine.connect().execution_options(readonly=True) as conn:
        rows = chains.lock_holders(conn, rule_id)
    return [_holder(row) for row in rows]


def _holder(row: dict[str, Any]) -> Holder:
    return Holder(
        row["token"],
        row["lease_id"],
        row["holder_host"],
        row["holder_pid"],
        row["heartbeat_at"],
        row.get("flow_run_id"),
    )


def record_lock(engine: sa.Engine, token: str, lease_id: str | None) -> None:
    with engine.begin() as conn:
        chains.record_lock(
            conn, token, lease_id, this_host() if lease_id else None, os.getpid() if lease_id else None, utcnow()
        )


def beat(engine: sa.Engine, token: str) -> None:
    """A chain waiting for the rule lock is alive: the tick must not judge it dead, and the chain
    holding the lock hands the rule over to it (`Chain.run_batch`)."""
    with engine.begin() as conn:
        chains.heartbeat(conn, token, utcnow())


def supersede(engine: sa.Engine, rule_id: int, token: str, message: str) -> None:
    with engine.begin() as conn:
        chains.supersede(conn, rule_id, token, utcnow(), message)
