"""How a job's outcomes are committed (its `Settle`, the connection's `settle`): in bounded groups, or
each on its own.

Grouped settles: records' ledger writes committed together, in bounded groups.

Each record still gets its own ledger write with its own outcome; what a group shares is the commit.
A group is committed once it holds `GROUP_RECORDS` outcomes or its oldest has waited `GROUP_SECONDS`,
whichever comes first, by a thread of its own, so the workers go on sending meanwhile. A crash loses
at most the outcomes not committed yet (a group being committed and at most two waiting: `add` holds
the workers back beyond that): their records are sent again by the next chain, which is safe where
the target honours the Idempotency-Key (a repeated create is answered with the record it made) and
an update repeats the same body. A connection whose target does not honour the key is settled
`per_record` instead (`SettleMode`): each outcome committed, by the worker that reached it, before
that worker takes another record (`EachOnItsOwn`).

The settle is one axis of a job (`delivery.job.Job`), the sender the other: any sender hands its
outcomes to the `Outcomes` its job's settle opened.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from delivery.domain import SettleMode

T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)

#: A group is committed once it holds this many outcomes ...
GROUP_RECORDS = 50
#: ... or once its oldest outcome has waited this long (seconds), whichever comes first.
GROUP_SECONDS = 0.2
#: How often `close` wakes while it waits for the thread (see there).
JOIN_STEP_SECONDS = 0.05


class Outcomes(Protocol[T_contra]):
    """Where a job's outcomes go while it runs."""

    #: Each outcome is committed by the worker that reached it, before that worker takes another
    #: record (the job's `hand_over` commits it and hears at once whether the fence still holds).
    each: bool
    #: The commit's error that stopped the gathering, for the job to raise.
    error: BaseException | None

    def add(self, item: T_contra) -> None: ...

    def close(self, *, commit: bool) -> None: ...


class Settle(Protocol):
    """How a job's outcomes are committed: what `open` returns receives them while the job runs."""

    mode: SettleMode

    def open(self, commit: Callable[[list[T]], None], on_error: Callable[[], None]) -> Outcomes[T]: ...


class Grouped:
    """Outcomes committed in bounded groups, by a thread of their own (`SettleGroups`)."""

    mode = SettleMode.GROUPED

    def open(self, commit: Callable[[list[T]], None], on_error: Callable[[], None]) -> Outcomes[T]:
        return SettleGroups(commit, on_error)


class PerRecord:
    """Each outcome committed on its own, by the worker that reached it (`EachOnItsOwn`)."""

    mode = SettleMode.PER_RECORD

    def open(self, commit: Callable[[list[T]], None], on_error: Callable[[], None]) -> Outcomes[T]:
        return EachOnItsOwn(commit)


def settle_for(mode: SettleMode) -> Settle:
    """The settle of a connection set to `mode`."""
    return Grouped() if mode is SettleMode.GROUPED else PerRecord()


class EachOnItsOwn(Generic[T]):
    """Nothing gathered: an outcome added is committed at once, in the adding thread."""

    each = True

    def __init__(self, commit: Callable[[list[T]], None]) -> None:
        self._commit = commit
        self.error: BaseException | None = None

    def add(self, item: T) -> None:
        self._commit([item])

    def close(self, *, commit: bool) -> None:
        """Nothing waits to be committed: every outcome was, when it was added."""


class SettleGroups(Generic[T]):
    """Outcomes gathered from any number of worker threads and handed to `commit` in groups, on a
    thread of its own. `commit` raising stops the gathering: the error is kept for the job to raise
    (`error`), and `on_error` is called at once so the workers can stop taking records."""

    each = False

    def __init__(
        self,
        commit: Callable[[list[T]], None],
        on_error: Callable[[], None],
        *,
        records: int = GROUP_RECORDS,
        seconds: float = GROUP_SECONDS,
    ) -> None:
        self._commit = commit
        self._on_error = on_error
        self._records = records
        self._seconds = seconds
        #: (when it was added, outcome), oldest first.
        self._gathered: list[tuple[float, T]] = []
        self._ready = threading.Condition()
        self._closing = False
        self._discard = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="delivery-settle", daemon=True)
        self._thread.start()

    def add(self, item: T) -> None:
        """Gather one outcome. Blocks while two groups' worth wait for the thread, so that what a
        crash can lose stays bounded however fast the workers go."""
        with self._ready:
            while len(self._gathered) >= 2 * self._records and not self._discard:
                self._ready.wait()
            if self._discard:
                return  # the job has ended: nothing settles after it
            self._gathered.append((time.monotonic(), item))
            # The first outcome starts the clock the thread waits on; a full group ends the wait.
            if len(self._gathered) == 1 or len(self._gathered) >= self._records:
                self._ready.notify_all()

    def close(self, *, commit: bool) -> None:
        """Commit what is gathered (`commit`), or drop it (the job has ended: nothing settles after
        it), and wait for the thread: no commit of this job happens after `close` returns. The
        wait wakes every `JOIN_STEP_SECONDS`, so a timeout or cancellation raised into the calling
        thread is delivered; the caller then closes again without committing."""
        with self._ready:
            self._closing = True
            self._discard = self._discard or not commit
            self._ready.notify_all()
        while self._thread.is_alive():
            self._thread.join(JOIN_STEP_SECONDS)

    def _take(self) -> list[T] | None:
        """The next group, when it is due; None once closed and nothing is left."""
        with self._ready:
            while True:
                if self._discard:
                    self._gathered = []
                    self._ready.notify_all()
                    return None
                age = time.monotonic() - self._gathered[0][0] if self._gathered else 0.0
                if self._gathered and (self._closing or len(self._gathered) >= self._records or age >= self._seconds):
                    group, self._gathered = self._gathered[: self._records], self._gathered[self._records :]
                    self._ready.notify_all()  # room again for workers held back in `add`
                    return [item for _, item in group]
                if self._closing:
                    return None
                self._ready.wait(self._seconds - age if self._gathered else None)

    def _run(self) -> None:
        while (group := self._take()) is not None:
            if self.error is not None:
                continue  # a commit failed: the rest is dropped, the job raises that error
            try:
                self._commit(group)
            except BaseException as exc:
                self.error = exc
                self._on_error()
                # Wake workers held back in `add`: the groups after this one are dropped.
                with self._ready:
                    self._ready.notify_all()
