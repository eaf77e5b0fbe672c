"""`delivery worker`: chains in a warm, long-lived process instead of a fresh process per chain.

A process worker (`prefect worker start`) starts a new Python process for every flow run: seconds
of CPU (imports, engine start, the pull step) before a record moves, which caps one machine at about
a hundred busy rules per tick. This worker claims the same scheduled runs from the same work pool
and runs each in this process, on a thread of its own with its own event loop, up to `limit` at a
time. Each chain stays its own `deliver-rule` flow run of the deployment, created by the tick with
its name, tags and chain token, with its drain and scan subflows, named state and artifacts. More
machines: start more workers on the pool; a run goes to the first that claims it.

Claiming is Prefect's own: a scheduled run is proposed Pending, and the server accepts that for one
claimant only (a process worker on the same pool included), and applies the deployment's concurrency
limit on the way. Only runs of the flows this package defines are claimed; anything else on the pool
is left for a process worker.

Cancelling. A run set Cancelling (Cancel in the UI, or the tick judging a chain dead) is seen at the
next poll; its flow is cancelled where it awaits, which the chain answers by ending Cancelled and
writing nothing more. A batch in progress finishes first, as on a first Ctrl-C: a sync Prefect task
cannot be interrupted mid-step from another thread, and the batch is bounded by its own timeout.

Suspending a run (Suspend in the UI) is not watched for: a chain is cancelled, never paused, and
the observer Prefect would start for it costs a thread and an event subscription per run
(`flows.prefect_private.skip_suspension_observers`).

A killed worker (kill -9) leaves its runs Running; the tick judges their chains dead once their
heartbeat is older than the dead-chain threshold, sets them Cancelling, supersedes their tokens and
starts new chains, as for a killed process worker; the Prefect server marks them Cancelled after its
cancelling timeout (300 s unless set), there being no worker to finish the cancellation. Stopping
it with SIGTERM/SIGINT cancels the runs in flight (each ends Cancelled) and waits for them; a second
signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from prefect import get_client
from prefect.client.schemas import State
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterState, FlowRunFilterStateType
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.client.schemas.responses import SetStateStatus
from prefect.flow_engine import run_flow
from prefect.flows import Flow
from prefect.states import Pending, Scheduled

DEFAULT_POOL = "delivery"
DEFAULT_LIMIT = 16
DEFAULT_POLL_SECONDS = 5.0
#: How long a stop waits for the runs in flight to end Cancelled before giving up on them.
STOP_SECONDS = 60.0
#: A chain's end publishes the delivery-status artifact (every rule's row: its cost grows with the
#: rules) at most this often, and always when the worker's last chain in flight ends.
STATUS_EVERY_SECONDS = 30.0


def known_flows() -> dict[str, Flow[Any, Any]]:
    """The flows this worker runs in process, by flow name: those of prefect.yaml's deployments."""
    from flows.deliver_rule import deliver_rule
    from flows.preview import delivery_preview
    from flows.record import delivery_record
    from flows.requeue import delivery_requeue
    from flows.tick import delivery_tick

    return {f.name: f for f in (deliver_rule, delivery_tick, delivery_requeue, delivery_preview, delivery_record)}


@dataclass
class _InFlight:
    run: FlowRun
    flow: Flow[Any, Any]
    runner: _ChainThread
    task: asyncio.Task[Any] | None = None
    cancel_asked: bool = False

    def cancel(self) -> None:
        """Cancel the flow where it awaits (thread-safe; before it started, as soon as it starts)."""
        self.cancel_asked = True
        if self.task is not None:
            self.runner.loop.call_soon_threadsafe(self.task.cancel)


class _ChainThread:
    """One thread with one event loop for its whole life, running one chain at a time.

    The loop holds Prefect's client contexts open for all the chains it runs, so a chain does not
    pay for new API clients (each builds a TLS context: tens of ms of CPU). One chain at a time,
    because a job's batch is a sync Prefect task that holds the loop while it runs."""

    def __init__(self, number: int, done: Callable[[_InFlight], None], say: Callable[[str], None]) -> None:
        self.number = number
        self._done = done
        self._say = say
        self.loop = asyncio.new_event_loop()
        self._queue: asyncio.Queue[_InFlight | None] | None = None
        self._ready = threading.Event()
        self.busy = False
        self.thread = threading.Thread(target=self._main, name=f"chain-thread-{number}", daemon=True)
        self.thread.start()
        self._ready.wait()

    def give(self, flight: _InFlight) -> None:
        self.busy = True
        assert self._queue is not None
        self.loop.call_soon_threadsafe(self._queue.put_nowait, flight)

    def close(self) -> None:
        if self._queue is not None:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, None)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        from prefect.context import AsyncClientContext, SyncClientContext

        self._queue = asyncio.Queue()
        self._ready.set()
        with SyncClientContext.get_or_create():
            async with AsyncClientContext.get_or_create():
                while (flight := await self._queue.get()) is not None:
                    try:
                        await self._run(flight)
                    except BaseException as exc:  # the engine records the run's state; this is our log
                        self._say(f"run {flight.run.name} ({flight.run.id}) ended on {type(exc).__name__}: {exc}")
                    finally:
                        self.busy = False
                        self._done(flight)

    async def _run(self, flight: _InFlight) -> None:
        running = run_flow(flight.flow, flow_run=flight.run, return_type="state")
        if not asyncio.iscoroutine(running):
            # A sync flow (delivery-requeue) has run already, on this thread: it holds this loop,
            # which serves one run at a time anyway; it is short, and cannot be cancelled midway.
            if isinstance(running, State):
                self._say(f"{flight.run.name} ended {running.type.value} ({running.name})")
            return
        flight.task = asyncio.ensure_future(running)
        if flight.cancel_asked:
            flight.task.cancel()
        state = await flight.task
        self._say(f"{flight.run.name} ended {state.type.value} ({state.name})")


@dataclass
class WarmWorker:
    pool: str = DEFAULT_POOL
    name: str = field(default_factory=lambda: f"delivery-worker-{socket.gethostname()}-{os.getpid()}")
    limit: int = DEFAULT_LIMIT
    poll_seconds: float = DEFAULT_POLL_SECONDS
    say: Callable[[str], None] = print
    flows: dict[str, Flow[Any, Any]] = field(default_factory=known_flows)

    def __post_init__(self) -> None:
        self._in_flight: dict[UUID, _InFlight] = {}
        self._lock = threading.Lock()
        self._threads: list[_ChainThread] = []
        self._flow_names: dict[UUID, str | None] = {}
        self._left_alone: set[str] = set()
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ran = 0

    def _tell(self, line: str) -> None:
        self.say(f"worker {self.name}: {line}")

    # -- the loop ---------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Poll, claim and start runs until `stop` is set; then cancel what is in flight and wait."""
        self._loop = asyncio.get_running_loop()
        async with get_client() as client:
            while not stop.is_set():
                try:
                    await client.send_worker_heartbeat(
                        work_pool_name=self.pool, worker_name=self.name, heartbeat_interval_seconds=self.poll_seconds
                    )
                    await self._cancel_asked(client)
                    await self._claim(client)
                except Exception as exc:  # a server restarting: try again at the next poll
                    self._tell(f"poll failed: {type(exc).__name__}: {exc}")
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(_first(stop.wait(), self._wake.wait()), self.poll_seconds)
        await self.stop()

    async def stop(self, timeout: float = STOP_SECONDS) -> None:
        with self._lock:
            flights = list(self._in_flight.values())
        if flights:
            self._tell(f"stopping, cancelling {len(flights)} run(s) in flight")
        for flight in flights:
            flight.cancel()
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for runner in self._threads:
            runner.close()

    @property
    def busy(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def _free_thread(self) -> _ChainThread | None:
        for runner in self._threads:
            if not runner.busy:
                return runner
        if len(self._threads) < self.limit:  # threads start as they are first needed
            self._threads.append(_ChainThread(len(self._threads) + 1, self._ended, self._tell))
            return self._threads[-1]
        return None

    # -- claiming ---------------------------------------------------------------------------------

    async def _claim(self, client: Any) -> None:
        if self.busy >= self.limit:
            return
        scheduled = await client.get_scheduled_flow_runs_for_work_pool(
            work_pool_name=self.pool, scheduled_before=datetime.now(UTC) + timedelta(seconds=1)
        )
        oldest_first = sorted(scheduled, key=lambda r: r.flow_run.expected_start_time or _EPOCH)
        for response in oldest_first:
            if self.busy >= self.limit:
                break
            run = response.flow_run
            name = await self._flow_name(client, run.flow_id) or ""
            flow = self.flows.get(name)
            if flow is None:  # not ours: left for a process worker on the pool, said once per flow
                if name not in self._left_alone:
                    self._left_alone.add(name)
                    self._tell(f"runs of flow {name!r} are not this worker's: left for a process worker on the pool")
                continue
            try:
                answer = await client.set_flow_run_state(run.id, Pending(), force=False)
                if answer.status != SetStateStatus.ACCEPT:
                    continue  # another worker took it, or the server holds it back (a concurrency limit)
                self._start(flow, run)
            except Exception:
                # The server may have made it ours (its answer lost on a loaded machine): a run left
                # Pending would wait for nobody. It goes back to Scheduled, for whoever claims next.
                await self._hand_back(client, run)
                raise

    async def _hand_back(self, client: Any, run: FlowRun) -> None:
        """Set `run` Scheduled again if it is Pending and not running here: claimed, never started."""
        with self._lock:
            if run.id in self._in_flight:
                return
        try:
            current = await client.read_flow_run(run.id)
            if current.state is not None and current.state.type == StateType.PENDING:
                await client.set_flow_run_state(run.id, Scheduled(), force=True)
                self._tell(f"{run.name} ({run.id}) was claimed but not started here: handed back (Scheduled)")
        except Exception as exc:
            self._tell(f"could not hand back {run.name} ({run.id}): {type(exc).__name__}: {exc}")

    async def _flow_name(self, client: Any, flow_id: UUID) -> str | None:
        if flow_id not in self._flow_names:
            self._flow_names[flow_id] = (await client.read_flow(flow_id)).name
        return self._flow_names[flow_id]

    # -- running ----------------------------------------------------------------------------------

    def _start(self, flow: Flow[Any, Any], run: FlowRun) -> None:
        runner = self._free_thread()
        assert runner is not None, "busy < limit leaves a thread free"
        flight = _InFlight(run, flow, runner)
        with self._lock:
            self._in_flight[run.id] = flight
        self._tell(f"running {run.name} ({run.id}) on chain thread {runner.number}")
        runner.give(flight)

    def _ended(self, flight: _InFlight) -> None:
        with self._lock:
            self._in_flight.pop(flight.run.id, None)
            self.ran += 1
        if self._loop is not None:  # a free thread: claim at once rather than at the next poll
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _cancel_asked(self, client: Any) -> None:
        """Cancel the runs in flight that someone set Cancelling (one query for all of them)."""
        with self._lock:
            flights = {run_id: f for run_id, f in self._in_flight.items() if not f.cancel_asked}
        if not flights:
            return
        runs = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=list(flights)),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CANCELLING])),
            )
        )
        for run in runs:
            self._tell(f"{run.name} was set Cancelling: cancelling it")
            flights[run.id].cancel()


_EPOCH = datetime.min.replace(tzinfo=UTC)


async def _first(*waits: Any) -> None:
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


class _NoThreadTimeoutWarning(logging.Filter):
    """Drops Prefect's warning that a task's timeout cannot interrupt it off the main thread.

    On a chain thread every batch runs off the main thread, so Prefect would log it at every batch of every
    chain, into the run's log in the UI. The chain does not rely on it: its own job deadline stops
    a job from sending in time (`delivery.chain`), every call has its own timeout, and Prefect's
    timeout still fails a batch between two Python steps, as the backstop it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "running in a worker thread" not in str(record.msg)


class NoServer(RuntimeError):
    """No Prefect server to take runs from (PREFECT_API_URL is not set)."""


class NoPool(RuntimeError):
    """The work pool named does not exist on the server."""


async def _check_pool(pool: str) -> None:
    from prefect.exceptions import ObjectNotFound

    async with get_client() as client:
        try:
            await client.read_work_pool(pool)
        except ObjectNotFound:
            raise NoPool(
                f"work pool {pool!r} does not exist on {os.environ.get('PREFECT_API_URL')}; "
                f"create it with: prefect work-pool create {pool} --type process"
            ) from None


def run_worker(
    pool: str = DEFAULT_POOL,
    name: str | None = None,
    limit: int = DEFAULT_LIMIT,
    poll_seconds: float = DEFAULT_POLL_SECONDS,
    say: Callable[[str], None] = print,
) -> int:
    """`delivery worker`: serve the pool until SIGTERM/SIGINT; a second signal exits at once."""
    from flows import prefect_private, stop_signals
    from flows.chain_reporting import throttle_status

    if not os.environ.get("PREFECT_API_URL"):
        raise NoServer(
            "delivery worker takes runs from a Prefect server: set PREFECT_API_URL "
            "(`delivery serve` starts one on this machine)"
        )
    signals = stop_signals.claim()
    logging.getLogger("prefect.task_runs").addFilter(_NoThreadTimeoutWarning())
    prefect_private.skip_suspension_observers()
    throttle_status(STATUS_EVERY_SECONDS)
    worker = WarmWorker(pool=pool, limit=limit, poll_seconds=poll_seconds, say=say)
    if name:
        worker.name = name

    async def _main() -> None:
        await _check_pool(pool)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def _watch() -> None:
            while not signals.requested:
                signals.wait(1.0)
            say(signals.announcement(f"running {worker.busy} run(s)"))
            loop.call_soon_threadsafe(stop.set)
            while signals.count < 2:
                signals.wait(1.0)
            say("second signal: exiting at once")
            os._exit(0)

        signals.started_something()
        threading.Thread(target=_watch, name="stop-signals", daemon=True).start()
        say(f"worker {worker.name}: taking runs from pool {pool!r} ({limit} at a time)")
        await worker.run(stop)
        say(f"worker {worker.name}: stopped after {worker.ran} run(s)")

    asyncio.run(_main())
    return 0
