"""A batch's records, written `count` at a time by a pool of workers.

Each worker takes the next record in the batch's order. A step can cut the batch short (`Cut`: take
no more records, let the calls in flight settle), and the first exception stops every worker and is
raised. However the job ends (that exception, or a timeout or cancellation raised into the calling
thread) every worker is stopped and waited for before `work_through` returns or raises: the rule
lock, released by the caller, is never let go while one of them still runs, and once the job has
ended (`Signals.over`) none writes anything more.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from delivery.domain import ChainEnd

T = TypeVar("T")
W = TypeVar("W")

#: How often the calling thread wakes while it waits for the workers: a timeout or a cancellation
#: raised into it is delivered only between Python steps, never inside one long wait.
WAIT_STEP_SECONDS = 0.05


@dataclass(frozen=True)
class Cut:
    """A step's word that the batch takes no more records, and why."""

    why: ChainEnd


@dataclass
class Signals:
    #: Take no more records: the batch is cut short (calls in flight still settle).
    stop: threading.Event = field(default_factory=threading.Event)
    #: The job has ended: write nothing more either.
    over: threading.Event = field(default_factory=threading.Event)


def work_through(
    size: int,
    count: int,
    new_own: Callable[[], W],
    step: Callable[[int, W, Signals], T | Cut | None],
    signals: Signals | None = None,
    *,
    pooled: bool = False,
) -> tuple[list[T | None], list[ChainEnd]]:
    """Run `step(index, own, signals)` for index 0..size-1, `count` at a time, each worker with
    what it owns from `new_own` (what may not be shared between threads: the job gives each worker
    a breaker of its own). Returns each index's
    result (None: not reached, or the step gave none) and the reasons of the cuts. With `count` 1
    the steps run in this thread, strictly in order, unless `pooled`: then on a thread of their own
    too, so that whatever is raised in this thread interrupts the job (and sets `signals.over`)
    while a step's own exception comes from the step. `signals`: the caller's, to share with what
    else serves the job (else new ones)."""
    results: list[T | None] = [None] * size
    cuts: list[ChainEnd] = []
    errors: list[BaseException] = []
    signals = signals or Signals()
    pending = iter(range(size))
    take = threading.Lock()

    def worker(own: W) -> None:
        try:
            while not signals.stop.is_set():
                with take:
                    index = next(pending, None)
                if index is None:
                    return
                result = step(index, own, signals)
                if isinstance(result, Cut):
                    cuts.append(result.why)
                    signals.stop.set()
                    return
                results[index] = result
        except BaseException as exc:
            errors.append(exc)
            signals.stop.set()

    workers = max(1, min(count, size))
    if workers == 1 and not pooled:
        worker(new_own())
    else:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="delivery-worker")
        try:
            futures = [pool.submit(worker, new_own()) for _ in range(workers)]
            not_done = set(futures)
            while not_done:
                _, not_done = concurrent.futures.wait(not_done, timeout=WAIT_STEP_SECONDS)
        except BaseException:
            signals.over.set()  # interrupted here: the job is ending now, whatever the workers hold
            raise
        finally:
            signals.stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
    if errors:
        raise errors[0]
    return results, cuts
