"""`delivery serve`: the long-running job on one machine.

Prefect's ephemeral API has no scheduler, so without PREFECT_API_URL we start a real local Prefect
server first (SQLite under PREFECT_HOME) and serve the deployments against it; with PREFECT_API_URL
set we serve against that server.

Stopping. SIGTERM and SIGINT only record a stop request (`flows.stop_signals`); nothing is raised
inside Prefect's code. The main thread does nothing but start things and wait, so it notices the
request at once and stops in order: the runner through its own stop (it cancels the runs in flight
and pauses the schedules), then the Prefect server we started. The runner lives on its own thread
and event loop, which also keeps Prefect from installing its SIGTERM handler over ours. A second
signal skips the waiting: every process we started is killed and we exit at once. Either way the
exit code is 0, however early or late the signal came.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Coroutine
from typing import Any

import httpx
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.runner import Runner
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows import stop_signals
from flows.deliver_rule import deliver_rule
from flows.preview import delivery_preview
from flows.record import delivery_record
from flows.requeue import delivery_requeue
from flows.stop_signals import StopSignals
from flows.tick import delivery_tick

TICK_CRON = "*/5 * * * *"
# As prefect.yaml declares it: one tick at a time, a tick colliding with a running one is cancelled.
TICK_CONCURRENCY = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)
SERVER_START_SECONDS = 120.0
# The runner's stop gives each run in flight 30 s to end after its SIGTERM before killing it.
RUNNER_STOP_SECONDS = 45.0
SERVER_STOP_SECONDS = 20.0


class ServerExited(RuntimeError):
    """The Prefect server we started exited before it answered."""


#: One line at a time on stdout: the runner's thread and the main thread both print, and `print`
#: writes a line's text and its newline separately, so two of them could interleave mid-line.
_STDOUT = threading.Lock()


def _say(line: str) -> None:
    with _STDOUT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _start_server(port: int) -> subprocess.Popen[bytes]:
    # `prefect server start --port` does not tell its UI where the API is: the UI would call the
    # default port (4200) and show "Unable to connect". An operator's own PREFECT_UI_API_URL wins.
    ui_api_url = f"http://127.0.0.1:{port}/api"
    env = {"PREFECT_UI_API_URL": ui_api_url, **os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    return subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        # Its own session: a terminal's Ctrl-C reaches only us, and we stop the server after the runner.
        start_new_session=True,
    )


def _is_healthy(api_url: str) -> bool:
    try:
        return httpx.get(f"{api_url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _wait_healthy(api_url: str, server: subprocess.Popen[bytes], stop: StopSignals) -> bool:
    """True once the server answers; False when a stop signal came first."""

    def answered() -> bool:
        if server.poll() is not None:
            raise ServerExited(f"the Prefect server exited with code {server.returncode}")
        return _is_healthy(api_url)

    if stop.wait_until(answered, SERVER_START_SECONDS, until_count=1, poll=0.5):
        return True
    if stop.requested:
        return False
    raise RuntimeError(f"the Prefect server did not answer on {api_url} within {SERVER_START_SECONDS:.0f} s")


class _Serving:
    """Prefect's runner, serving the deployments on a thread and event loop of its own."""

    def __init__(self, api_url: str) -> None:
        self._api_url = api_url
        self._lock = threading.Lock()
        self._stop_asked = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.registered = False
        self.error: BaseException | None = None
        # Daemon: a forced stop must not wait for it at interpreter exit.
        self._thread = threading.Thread(target=self._main, name="delivery-serve-runner", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def request_stop(self) -> None:
        """Ask the runner to stop (thread-safe; before the loop exists too)."""
        with self._lock:
            self._stop_asked = True
            loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed: nothing left to stop
                loop.call_soon_threadsafe(stop.set)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:
            self.error = exc

    def _attach(self) -> asyncio.Event | None:
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            return None if self._stop_asked else self._stop

    async def _serve(self) -> None:
        stop = self._attach()
        if stop is None:
            return
        with temporary_settings({PREFECT_API_URL: self._api_url}):
            runner = Runner(pause_on_shutdown=True)
            if not await _unless_stopped(self._register(runner), stop):
                return
            self.registered = True
            _say(
                "serving deliver-rule, delivery-requeue, delivery-preview, delivery-record, "
                "delivery-tick (every 5 min); Ctrl-C stops"
            )
            started = asyncio.ensure_future(runner.start())
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({started, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not started.done():
                await _stop_runner(runner, started)
            started.result()

    async def _register(self, runner: Runner) -> None:
        await runner.aadd_deployment(await deliver_rule.ato_deployment(name="deliver-rule"))
        # Requeue from the UI: the operator's "Run" on this deployment puts parked records back.
        await runner.aadd_deployment(await delivery_requeue.ato_deployment(name="delivery-requeue"))
        # What the next chain would do, from the UI: sends and writes nothing.
        await runner.aadd_deployment(await delivery_preview.ato_deployment(name="delivery-preview"))
        await runner.aadd_deployment(await delivery_record.ato_deployment(name="delivery-record"))
        await runner.aadd_deployment(
            await delivery_tick.ato_deployment(name="delivery-tick", cron=TICK_CRON, concurrency_limit=TICK_CONCURRENCY)
        )


async def _unless_stopped(work: Coroutine[Any, Any, None], stop: asyncio.Event) -> bool:
    """Run `work` to its end (True) unless `stop` is set first: then cancel it (False)."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


async def _stop_runner(runner: Runner, started: asyncio.Future[None]) -> None:
    # The runner's stop needs a started runner: let one that is still entering finish doing so.
    while not runner.started and not started.done():
        await asyncio.sleep(0.05)
    if runner.started:
        await runner.astop()
    with contextlib.suppress(asyncio.CancelledError):
        await started


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                # The command name may hold spaces and parentheses: the parent pid follows the last ")".
                parent = int(stat.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    return children


def _kill_descendants() -> None:
    """SIGKILL every process below this one (the forced stop: the runs in flight, the server)."""
    children = _children_by_parent()
    pending, found = [os.getpid()], []
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    for pid in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _stop_server(server: subprocess.Popen[bytes], stop: StopSignals) -> None:
    if server.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        stopped = stop.wait_until(lambda: server.poll() is not None, SERVER_STOP_SECONDS, until_count=2)
        if not stopped:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def _phase(server: subprocess.Popen[bytes] | None, serving: _Serving | None) -> str:
    if serving is not None:
        return "serving" if serving.registered else "registering the deployments"
    return "starting the Prefect server" if server is not None else "starting"


def _stop_serving(serving: _Serving, stop: StopSignals) -> bool:
    """Stop the runner; False when it did not stop in time or a second signal asked for haste."""
    serving.request_stop()
    return stop.wait_until(serving.done, RUNNER_STOP_SECONDS, until_count=2)


def _forced_exit(server: subprocess.Popen[bytes] | None) -> None:
    """Kill what we started and leave now: the runner's thread may be anywhere."""
    _kill_descendants()
    if server is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    _say("stopped (forced)")
    sys.stderr.flush()
    os._exit(0)


def serve_forever(port: int = 4200, stop: StopSignals | None = None) -> None:
    stop = stop or stop_signals.claim()
    api_url = os.environ.get("PREFECT_API_URL")
    server: subprocess.Popen[bytes] | None = None
    serving: _Serving | None = None
    try:
        stop.started_something()
        if not api_url:
            api_url = f"http://127.0.0.1:{port}/api"
            server = _start_server(port)
            if not _wait_healthy(api_url, server, stop):
                return
        _say(f"Prefect UI: {api_url.removesuffix('/api')}  (API {api_url})")
        serving = _Serving(api_url)
        serving.start()
        stop.wait_until(serving.done, float("inf"), until_count=1, poll=1.0)
        if not stop.requested:
            raise serving.error or RuntimeError("the Prefect runner stopped serving on its own")
    finally:
        if stop.requested:
            _say(stop.announcement(_phase(server, serving)))
        if serving is not None and not serving.done() and not _stop_serving(serving, stop):
            _forced_exit(server)
        if serving is not None and serving.error is not None and stop.requested:
            # Asked to stop: whatever the runner's stop ran into is reported, not turned into a failure.
            sys.stderr.write(f"while stopping: {type(serving.error).__name__}: {serving.error}\n")
        if server is not None:
            _stop_server(server, stop)
        _say("stopped")
