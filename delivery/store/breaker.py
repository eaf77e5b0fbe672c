"""pybreaker state in the database, so every process and worker delivering to a target shares one
breaker for it (process memory would give each worker its own, and a down target would be hit
fail_max times per worker)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pybreaker
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from delivery.clock import SYSTEM, Clock
from delivery.store.tables import breaker_states_table

#: How long a row the engine read alongside a settle stands in for a read of our own.
SNAPSHOT_SECONDS = 1.0
_STATES = (pybreaker.STATE_CLOSED, pybreaker.STATE_OPEN, pybreaker.STATE_HALF_OPEN)

_RESET = (
    breaker_states_table.update()
    .where(breaker_states_table.c.connection_id == sa.bindparam("id"), breaker_states_table.c.fail_counter != 0)
    .values(fail_counter=0)
)


class DatabaseBreakerStorage(pybreaker.CircuitBreakerStorage):
    """Every write is its own short transaction, so other processes see a failure or a trip at once.

    A read is its own transaction too, unless the engine has just read the row for us: it reads the
    breaker row in the same statement as each record's fence check and hands it to `observe`, and
    pybreaker's reads before and after the next call use that row instead of round trips of their
    own (they cost as much as the settle itself), while the reset after a success waits for that
    next read. The row is dropped at our next write, and after `SNAPSHOT_SECONDS`; a trip by
    another process is therefore seen one record later, the same race that exists anyway between
    reading the state and making the call.

    Time is read from `clock` (see `delivery.clock`): the moment the breaker opened is stored as the
    clock has it (`opened_on_clock`), and told to pybreaker (`opened_at`) shifted into the system's
    wall time it compares it with, so an open breaker's cooldown runs on the engine's clock."""

    def __init__(self, engine: sa.Engine, connection_id: int, clock: Clock = SYSTEM) -> None:
        super().__init__(f"connection-{connection_id}")
        self._engine = engine
        self._id = connection_id
        self.clock = clock
        self._snapshot: Mapping[str, Any] | None = None
        self._snapshot_at = 0.0
        self._reset_due = False
        #: Writes this storage made; with grouped settles another thread observes rows for it.
        self._writes = 0
        self._guard = threading.Lock()
        self._ensure_row()

    @property
    def write_mark(self) -> int:
        """Read before the statement whose row `observe` gets: a row read before a write of ours
        is older than that write and must not stand in for the state."""
        return self._writes

    def observe(
        self, conn: sa.Connection, row: Mapping[str, Any] | None, mark: int | None = None
    ) -> Mapping[str, Any] | None:
        """Take `row`, just read in the engine's transaction `conn`, as the current state; and write
        there the reset a success since the last row put off, if the row shows failures (made by
        other workers or processes in the meantime: a success must clear them, as pybreaker's
        consecutive-failure count wants). `mark`: `write_mark` as it was before the row was read
        (grouped settles observe from another thread than the worker's): if this storage wrote
        since, the row is older than its own write and is not taken. Returns the row as it stands
        after the reset, for the next worker's storage."""
        with self._guard:
            if mark is not None and mark != self._writes:
                return row
            reset_due, self._reset_due = self._reset_due, False
            if row is not None and reset_due and row["fail_counter"] != 0:
                conn.execute(_RESET, {"id": self._id})
                row = {**row, "fail_counter": 0}
            self._snapshot = row
            self._snapshot_at = self.clock.monotonic()
            return row

    def _fresh(self) -> Mapping[str, Any] | None:
        if self._snapshot is not None and self.clock.monotonic() - self._snapshot_at < SNAPSHOT_SECONDS:
            return self._snapshot
        return None

    def _ensure_row(self) -> None:
        with self._engine.begin() as conn:
            exists = conn.execute(
                sa.select(breaker_states_table.c.connection_id).where(breaker_states_table.c.connection_id == self._id)
            ).first()
            if exists is None:
                try:
                    with conn.begin_nested():
                        conn.execute(
                            breaker_states_table.insert().values(
                                connection_id=self._id,
                                state=pybreaker.STATE_CLOSED,
                                fail_counter=0,
                                success_counter=0,
                                opened_at=None,
                            )
                        )
                except IntegrityError:
                    pass  # another process created it first: the same row serves us both

    def _get(self, column: str) -> Any:
        snapshot = self._fresh()
        if snapshot is not None:
            return snapshot[column]
        with self._engine.connect().execution_options(readonly=True) as conn:
            return conn.execute(
                sa.select(breaker_states_table.c[column]).where(breaker_states_table.c.connection_id == self._id)
            ).scalar_one()

    def _set(self, **values: Any) -> None:
        with self._guard:
            self._writes += 1
            self._snapshot = None
            self._reset_due = False
        with self._engine.begin() as conn:
            conn.execute(
                breaker_states_table.update().where(breaker_states_table.c.connection_id == self._id).values(**values)
            )

    @property
    def state(self) -> str:
        return str(self._get("state"))

    @state.setter
    def state(self, state: str) -> None:
        self._set(state=state)

    def change_state(self, state: str) -> str | None:
        """Write `state` and return the state it replaced, or None when the row held it already.
        Each step is a compare-and-set, so when several processes make the same change at once
        exactly one of them is told it did (the one whose write changed the row)."""
        with self._guard:
            self._writes += 1
            self._snapshot = None
            self._reset_due = False
        table = breaker_states_table
        with self._engine.begin() as conn:
            for before in (s for s in _STATES if s != state):
                changed = conn.execute(
                    table.update().where(table.c.connection_id == self._id, table.c.state == before).values(state=state)
                )
                if changed.rowcount == 1:
                    return before
        return None

    def increment_counter(self) -> None:
        # A success whose reset was put off (`reset_counter`) came before this failure: the
        # failures before it are no longer consecutive, so the count starts again at this one.
        with self._guard:
            reset_due = self._reset_due
        self._set(fail_counter=1 if reset_due else breaker_states_table.c.fail_counter + 1)

    def fresh_counter(self) -> int:
        """The stored failure count read from the database, never from a row observed earlier, with
        a success whose reset is put off counted as that reset."""
        with self._guard:
            if self._reset_due:
                return 0
        with self._engine.connect().execution_options(readonly=True) as conn:
            return int(
                conn.execute(
                    sa.select(breaker_states_table.c.fail_counter).where(
                        breaker_states_table.c.connection_id == self._id
                    )
                ).scalar_one()
            )

    def reset_counter(self) -> None:
        # Called after every success. With a fresh row the reset is put off to the engine's next
        # read of the row (`observe`, in the transaction that settles this record), which writes
        # it only if there are failures to clear: no write transaction per success.
        # Without one (records slower than SNAPSHOT_SECONDS, as on a loaded machine), a read decides
        # whether there is anything to clear, so a success costs no write transaction (on SQLite,
        # the database's one write lock) unless there is.
        with self._guard:
            if self._fresh() is not None:
                self._reset_due = True
                return
        if self.counter == 0:
            return
        with self._guard:
            self._writes += 1
            self._snapshot = None
        with self._engine.begin() as conn:
            conn.execute(_RESET, {"id": self._id})

    def increment_success_counter(self) -> None:
        self._set(success_counter=breaker_states_table.c.success_counter + 1)

    def reset_success_counter(self) -> None:
        self._set(success_counter=0)

    @property
    def counter(self) -> int:
        return int(self._get("fail_counter"))

    @property
    def success_counter(self) -> int:
        return int(self._get("success_counter"))

    @property
    def opened_on_clock(self) -> datetime | None:
        """When the breaker last opened, on the engine's clock (as stored)."""
        value: datetime | None = self._get("opened_at")
        return value

    def mark_opened(self, now: datetime) -> None:
        """Store `now` (read from the engine's clock) as the moment the breaker opened."""
        self._set(opened_at=now)

    @property
    def opened_at(self) -> datetime | None:
        """pybreaker's view: `opened_on_clock` in the system's wall time, which pybreaker's open
        state compares with `datetime.now(UTC)`; the cooldown so ends when the clock says."""
        value = self.opened_on_clock
        return None if value is None else value - self.clock.skew()

    @opened_at.setter
    def opened_at(self, value: datetime) -> None:
        # pybreaker's own `open` writes the system's wall time here; stored on the engine's clock.
        self.mark_opened(value + self.clock.skew())


@dataclass(frozen=True)
class BreakerStateRow:
    """One row of the `breaker_states` table: a target's stored breaker."""

    connection_id: int
    state: str
    fail_counter: int
    success_counter: int
    opened_at: datetime | None


def breaker_state(conn: sa.Connection, connection_id: int) -> BreakerStateRow | None:
    row = conn.execute(
        sa.select(breaker_states_table).where(breaker_states_table.c.connection_id == connection_id)
    ).one_or_none()
    return None if row is None else BreakerStateRow(**row._asdict())
