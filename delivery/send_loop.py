"""The sender whose calls in flight are tasks on one event loop (`EventLoop`), for a writer offering
its verbs as coroutines (`delivery.writers.base.CreatesAsync`, `UpdatesAsync`).

`context.workers` tasks on a loop of the job's own instead of as many threads: each task takes the
next record in the batch's order, as a thread of `delivery.send_threads` does, so at most `workers`
calls are in flight and a cut stops every task taking more. Everything else is the job's
(`delivery.job.Job`): windows of `GROUP_RECORDS` candidates whose intents are committed (one
transaction, one executemany) before any of them is sent, the fence checked in every transaction,
unsent intents taken back; outcomes settled as the job's settle says: in groups of at most 50
records or 200 ms by the gatherer's thread (`SettleGroups`), or each on its own before its task
takes the next record (`per_record`).

No database write runs on the loop: a window's intents are committed on a thread of the job's own
(`delivery-db`, one, so windows are written in order), started one window ahead so the tasks
rarely wait for it; the settles on the gatherer's thread, or (`per_record`) on `delivery-db` too. A
wait for the target's traffic goes to another pool (`off_loop`); only an admission that needs
neither wait nor read, and the breaker's bookkeeping (reads served by the row the settles read, a
write only on a failure), stay on the loop.

`send()` is called from a thread (the chain's, or a Prefect task's) that may or may not run a loop
of its own: the job's loop always runs on a dedicated thread (never a nested `asyncio.run`), and the
calling thread waits for it in short steps, so a timeout or a cancellation raised into the calling
thread is delivered at once. It then cuts the job: the tasks are cancelled where they wait (a call
in flight is abandoned, its answer never seen), no call starts after, nothing settles after, and the
intent of every call that may have gone out stays, so its outcome reads as unknown (a create's row
says in flight and its retry repeats the key; an update's row is in doubt), exactly as when the
thread path's job ends with calls in flight. Chosen for such a writer by `delivery.senders.choose`;
it sees the job and its `JobContext`, never the chain.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from delivery.breaker import TargetBreaker
from delivery.domain import ChainEnd
from delivery.job import Job, ToSettle
from delivery.settle import GROUP_RECORDS, Outcomes
from delivery.step import OffLoop
from delivery.workers import WAIT_STEP_SECONDS, Cut, Signals

T = TypeVar("T")


class EventLoop:
    """Tasks on one event loop send the batch, `context.workers` calls in flight."""

    window_size = GROUP_RECORDS

    def __init__(self) -> None:
        #: The loop's main task, once it runs: what an interruption of `send` cancels.
        self._main: tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None = None
        self._main_lock = threading.Lock()

    def send(self, job: Job, signals: Signals, outcomes: Outcomes[ToSettle]) -> list[ChainEnd]:
        done: dict[str, Any] = {}
        # Waited on instead of `Thread.join`: an exception raised into a thread inside `join` can
        # leave the joined thread marked as stopped while it still runs (CPython's join releases
        # the thread's lock on its way out).
        finished = threading.Event()

        def loop_thread() -> None:
            try:
                done["cuts"] = asyncio.run(self._send_all(job, signals, outcomes))
            except BaseException as exc:  # handed to the calling thread, raised there
                done["error"] = exc
            finally:
                finished.set()

        thread = threading.Thread(target=loop_thread, name="delivery-loop", daemon=True)
        try:
            thread.start()
            while not finished.wait(WAIT_STEP_SECONDS):  # short steps: a timeout raised here is delivered
                pass
        except BaseException:
            # Interrupted (the job's timeout, a cancellation): the job ends now. The tasks are
            # cancelled where they wait and the loop is waited for, so nothing of the job runs on.
            signals.over.set()
            signals.stop.set()
            self._cancel_main()
            if thread.ident is not None:  # it started: wait for its loop to close
                while not finished.wait(WAIT_STEP_SECONDS):
                    pass
                thread.join()
            raise
        thread.join()  # its last steps: the loop has closed
        if "error" in done:
            raise done["error"]
        cuts: list[ChainEnd] = done["cuts"]
        return cuts

    def _cancel_main(self) -> None:
        with self._main_lock:
            main = self._main
        if main is not None:
            loop, task = main
            with contextlib.suppress(RuntimeError):  # the loop has closed: it ran to its end already
                loop.call_soon_threadsafe(task.cancel)

    async def _send_all(self, job: Job, signals: Signals, outcomes: Outcomes[ToSettle]) -> list[ChainEnd]:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        with self._main_lock:
            self._main = (loop, task)
        if signals.over.is_set():
            return []  # interrupted before the loop ran: nothing is sent
        context = job.context
        db = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="delivery-db")
        waits = concurrent.futures.ThreadPoolExecutor(max_workers=context.workers, thread_name_prefix="delivery-wait")

        async def off_loop(call: Callable[..., T], *args: Any) -> T:
            return await loop.run_in_executor(waits, call, *args)

        windows: dict[int, asyncio.Future[None]] = {}

        def prepare(window: int) -> asyncio.Future[None] | None:
            """The window's intents being committed (started if they are not yet)."""
            if window not in windows:
                if job.superseded or signals.stop.is_set() or window * job.window_size >= len(job.candidates):
                    return None
                windows[window] = loop.run_in_executor(db, job.prepare_window_once, window)
            return windows[window]

        cuts: list[ChainEnd] = []
        errors: list[BaseException] = []
        pending = iter(range(len(job.candidates)))
        breaker = context.new_worker_breaker()  # one breaker for the tasks: pybreaker holds no lock across an await

        async def worker() -> None:
            try:
                while not signals.stop.is_set():
                    index = next(pending, None)
                    if index is None:
                        return
                    result = await self._one(job, index, breaker, signals, outcomes, prepare, off_loop, db)
                    if isinstance(result, Cut):
                        cuts.append(result.why)
                        signals.stop.set()
                        return
            except Exception as exc:
                errors.append(exc)
                signals.stop.set()

        writer: Any = context.writer
        tasks: list[asyncio.Task[None]] = []
        try:
            await writer.aopen()
            tasks = [asyncio.create_task(worker()) for _ in range(max(1, min(context.workers, len(job.candidates))))]
            await asyncio.gather(*tasks)
        finally:
            signals.stop.set()  # also ends any wait for the target's traffic on `waits`
            for pending_task in tasks:
                pending_task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*windows.values(), return_exceptions=True)  # a window prefetched, never reached
            try:
                await writer.aclose()
            finally:
                # Blocking the loop is harmless here: nothing else runs on it any more.
                db.shutdown(wait=True)
                waits.shutdown(wait=True)
        if errors:
            raise errors[0]
        return cuts

    async def _one(
        self,
        job: Job,
        index: int,
        breaker: TargetBreaker,
        signals: Signals,
        outcomes: Outcomes[ToSettle],
        prepare: Callable[[int], asyncio.Future[None] | None],
        off_loop: OffLoop,
        db: concurrent.futures.Executor,
    ) -> Cut | None:
        """`delivery.send_threads.send_one_in_window` on the loop: its window's intents committed
        first (the next window's started meanwhile), then the send, then its outcome handed to the
        settle."""
        window = index // job.window_size
        if window not in job.windows:
            preparing = prepare(window)
            if preparing is not None:
                await preparing
        prepare(window + 1)  # under way while this window is sent
        ready = job.ready_to_send(index, window, signals)
        if not isinstance(ready, tuple):
            return ready
        candidate, plan, intent = ready
        bounds = job.context.bounds(signals.stop)
        with job.unsent_on_rule_fault(index):
            done = await job.context.step.carry_out_async(candidate, plan, intent, breaker, bounds, off_loop)
        item = job.to_settle(index, done, signals)
        if not isinstance(item, ToSettle):
            return item
        if not outcomes.each:
            outcomes.add(item)  # holds the loop back while two groups wait: what a crash loses stays bounded
            return None
        # Committed off the loop, before this task takes its next record.
        return await asyncio.get_running_loop().run_in_executor(db, job.hand_over, item, outcomes)
