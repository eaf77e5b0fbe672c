"""Whether a chain or a rule lock's holder is alive: every threshold and every predicate, here.

Three parties judge liveness, each by the one rule below (a heartbeat is fresh while it is no older
than a window, alive at exactly the window), over its own window:

- the tick judges an open chain (`judge_chains`, window `dead_chain_after`: the setting
  `DELIVERY_DEAD_CHAIN_MINUTES`), cancels its run and supersedes it;
- a chain holding the rule job after job hands it to a newer chain still waiting for the lock
  (`newer_waiting`, window `handover_window`: two lock wait steps and a margin);
- a chain waiting for the lock frees the slot of a holder that died mid-job (`holder_is_dead`,
  window `holder_stale_after`, or at once for a process gone on this host), or a slot nobody holds
  on record once any lease on it has surely expired (`slot_lost`).

docs/design.md has the table: what is judged dead, by whom, after how long, and what happens then.

The windows are decided here and nowhere else; the SQL stays in the store, which is handed a
cutoff (`cutoff`) or returns heartbeats for these predicates to judge. procrastinate's stalled
workers are the model: one heartbeat column, one threshold per question.

The rule lock (a Prefect concurrency slot) can outlive the process that took it: the embedded
Prefect API runs no lease repossessor, and keeps leases in memory. Our own records say who holds
it (host, pid, a heartbeat at each job and about once a second while it settles records), so a
waiter can judge the holder and free the rule.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa

from delivery.settings import settings
from delivery.store import chains

# -- how often the living show it -------------------------------------------------------------

#: At most this often a settle also writes the chain's heartbeat (every job writes it as it
#: starts). Every judge below waits minutes, or at least seconds beyond a wait step; a write per
#: record would make the one chain row every worker's settle updates a queue of its own.
HEARTBEAT_SECONDS = 1.0
#: The rule lock's lease. Prefect's minimum, so that a killed holder's slot is repossessed soonest.
LEASE_SECONDS = 60.0
#: A holder renews its lease this often (75 % of it), never at once: a short job (most are) makes
#: no renewal call that could race its release.
LEASE_RENEW_SECONDS = LEASE_SECONDS * 0.75

# -- how long a silence means death -----------------------------------------------------------

#: A holder whose heartbeat is older than this (plus twice its target's timeout, see
#: `holder_stale_after`) is dead, wherever it runs. Heartbeats are written as each job starts and
#: about once a second with its settles, so a live holder is never silent much longer than one
#: write, and the requests between two writes are bounded by the target's timeout.
STALE_HOLDER_SECONDS = 120.0
#: A chain waiting for the rule lock beats once per wait step: one newer than the lock's holder
#: counts as waiting while it beat within two steps and this margin (`handover_window`).
HANDOVER_MARGIN_SECONDS = 10.0
#: A slot taken with nobody on record is reset (ephemeral API only) after this long: by then any
#: lease nobody renews has expired, with a margin for a holder's last renewal in flight.
UNACCOUNTED_SECONDS = LEASE_SECONDS + 15.0
#: On a Prefect server that repossesses expired leases (`prefect server start`), a slot taken with
#: nobody on record is reset after this long: an expired lease is freed within one pass of its
#: repossessor (every 15 s), so a slot still taken three passes after any lease would have expired
#: holds a lease the server no longer knows (it restarted: it keeps leases in memory) and will
#: never free by itself.
UNACCOUNTED_ON_A_SERVER_SECONDS = LEASE_SECONDS + 45.0


# -- the one rule -------------------------------------------------------------------------------


def fresh(heartbeat_at: datetime, now: datetime, window: timedelta) -> bool:
    """A heartbeat no older than `window` at `now`: alive, also at exactly `window`."""
    return now - heartbeat_at <= window


def cutoff(now: datetime, window: timedelta) -> datetime:
    """The oldest fresh heartbeat at `now`, for a query: `heartbeat_at >= cutoff(now, window)` is
    `fresh(heartbeat_at, now, window)` (datetime arithmetic is exact, in microseconds)."""
    return now - window


# -- the tick: open chains ----------------------------------------------------------------------


def dead_chain_after(minutes: float | None = None) -> timedelta:
    """How long an open chain may be silent before the tick judges it dead: `minutes` (the tick's
    override, already checked as the setting is), else `DELIVERY_DEAD_CHAIN_MINUTES`."""
    if minutes is None:
        minutes = settings().dead_chain_minutes
    return timedelta(minutes=minutes)


@dataclass(frozen=True)
class ChainLife:
    """An open chain as the tick judges it."""

    token: str
    flow_run_id: str | None
    silent_for: timedelta
    alive: bool
    #: Launched by the tick, and its run has not begun to run after `NEVER_STARTED_SECONDS`.
    never_started: bool = False


#: How long a chain the tick launched may wait for its run to begin before the tick judges it
#: dead: a worker at its limit, or one that claimed the run and lost it, must not hold the rule
#: for the whole dead-chain threshold. Generous for a loaded server (a start was seen taking 62 s).
NEVER_STARTED_SECONDS = 180.0


def judge_chains(conn: sa.Connection, rule_id: int, now: datetime, threshold: timedelta) -> list[ChainLife]:
    """The rule's open chains, newest first, judged (`judge`) at `now` within `threshold`."""
    return judge(chains.open_chains(conn, rule_id), now, threshold)


def judge(rows: Iterable[chains.ChainRow], now: datetime, threshold: timedelta) -> list[ChainLife]:
    """Open chains as the tick judges them at `now`, in the order given: each alive while its
    heartbeat is `fresh` within `threshold` and, if the tick launched it, once its run began within
    `NEVER_STARTED_SECONDS`. A chain's heartbeat is written at launch (so a run still waiting for
    a worker counts), when its run begins, at every wait step for the lock, as each job starts, as
    the cursor moves and about once a second while it settles; a warm worker killed with its runs
    leaves them Running, and only their silence tells."""
    lives = []
    for row in rows:
        waiting = row.running_at is None and row.ended_at is None
        never_started = waiting and not fresh(row.started_at, now, timedelta(seconds=NEVER_STARTED_SECONDS))
        alive = fresh(row.heartbeat_at, now, threshold) and not never_started
        lives.append(ChainLife(row.token, row.flow_run_id, now - row.heartbeat_at, alive, never_started))
    return lives


# -- the handover: a newer chain waiting for the lock -------------------------------------------


def lock_wait_step_seconds() -> float:
    """How long a job waits for the rule lock before it looks for a dead holder, and beats
    (`DELIVERY_LOCK_WAIT_STEP_SECONDS`)."""
    return settings().lock_wait_step_seconds


def handover_window() -> timedelta:
    """How recently a waiting chain must have beaten to be handed the rule: it beats once per wait
    step, so two steps and a margin tell a waiter from one that died waiting."""
    return timedelta(seconds=2 * lock_wait_step_seconds() + HANDOVER_MARGIN_SECONDS)


def newer_waiting(
    conn: sa.Connection, rule_id: int, token: str, started_at: datetime, now: datetime
) -> chains.ChainRow | None:
    """A chain of the rule started after `token` (started at `started_at`), not ended, alive within
    the `handover_window` at `now`: one waiting for the rule lock while `token` holds it job after
    job. Its token and flow run, or None."""
    return chains.newer_waiting(conn, rule_id, token, started_at, cutoff(now, handover_window()))


# -- the lock's holder --------------------------------------------------------------------------


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


def holder_stale_after(target_timeout_seconds: float) -> timedelta:
    """How long a lock holder delivering to a target with this timeout may be silent: a live
    holder's heartbeat can wait behind requests to its target, each bounded by the target's
    timeout, and two of them are allowed for on top of `STALE_HOLDER_SECONDS`."""
    return timedelta(seconds=STALE_HOLDER_SECONDS + 2 * target_timeout_seconds)


def holder_is_dead(
    holder: Holder,
    now: datetime,
    stale_after: timedelta,
    host: str,
    alive: Callable[[int], bool] = pid_alive,
) -> bool:
    """Its process is gone (judged only on its own host: a pid elsewhere means nothing here), or
    its heartbeat is no longer `fresh` within `stale_after`."""
    if holder.host == host and holder.pid is not None and not alive(holder.pid):
        return True
    return not fresh(holder.heartbeat_at, now, stale_after)


def slot_lost(unaccounted_for_seconds: float, repossessor: bool = False) -> bool:
    """A slot that has stood taken with nobody on record this long holds no live lease any more,
    and nothing but a reset will free it: on the ephemeral API (no repossessor) after
    `UNACCOUNTED_SECONDS`, on a server with one after `UNACCOUNTED_ON_A_SERVER_SECONDS`."""
    return unaccounted_for_seconds >= (UNACCOUNTED_ON_A_SERVER_SECONDS if repossessor else UNACCOUNTED_SECONDS)


def lock_holders(engine: sa.Engine, rule_id: int) -> list[Holder]:
    with engine.connect().execution_options(readonly=True) as conn:
        rows = chains.lock_holders(conn, rule_id)
    return [_holder(row) for row in rows]


def _holder(row: chains.ChainRow) -> Holder:
    return Holder(row.token, row.lease_id, row.holder_host, row.holder_pid, row.heartbeat_at, row.flow_run_id)


def record_lock(engine: sa.Engine, token: str, lease_id: str | None, now: datetime) -> None:
    with engine.begin() as conn:
        chains.record_lock(
            conn, token, lease_id, this_host() if lease_id else None, os.getpid() if lease_id else None, now
        )


def beat(engine: sa.Engine, token: str, now: datetime) -> None:
    """A chain waiting for the rule lock is alive: the tick must not judge it dead, and the chain
    holding the lock hands the rule over to it (`newer_waiting`)."""
    with engine.begin() as conn:
        chains.heartbeat(conn, token, now)


def supersede(engine: sa.Engine, rule_id: int, token: str, message: str, now: datetime) -> None:
    with engine.begin() as conn:
        chains.supersede(conn, rule_id, token, now, message)
