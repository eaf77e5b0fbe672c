"""`delivery serve` stops cleanly on SIGTERM or SIGINT, wherever its start-up or serving is.

Each run is a real `delivery serve` process, signalled at one moment of its life: as soon as its
handler is in place, in the middle of Prefect's import (where the code before this test died of
the default action: -15 for SIGTERM, 130 for SIGINT), while the Prefect server it started is not
yet answering (when it starts one), when it announces the UI (it is registering
the deployments; there the old handler's KeyboardInterrupt, raised inside a class body Prefect was
importing, came out as a RuntimeError and exit 1 now and then), when both deployments appear in
the API (the moment of the original report; it is often still registering then), when it says it
is serving, and at random delays spread over the start-up,
measured from the handler being in place (before that the interpreter itself is starting: no
program can catch a signal that early). Every run must exit 0,
say in which phase it was stopped (the test checks that the runs did land in every phase), and
leave no process behind: every process it starts inherits a marker in its environment, and after
the exit no process may carry it, orphans included.

Both ways of serving are covered: `delivery serve` starting its own Prefect server, and serving
against an existing `prefect server start` (started once for the module, and still healthy after
every run). Two more tests stop it with a chain in flight, once and twice.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from delivery import db
from tests.integration.world import World, email
from tests.prefect_server import api_call, free_port, healthy, migrated_home, prefect_server
from tests.support.databases import unique
from tests.target_server import Answer, TargetServer

DELIVERY = str(Path(sys.executable).parent / "delivery")
MARK = "DELIVERY_SERVE_TEST_MARK"
SERVED = ["deliver-rule", "delivery-preview", "delivery-record", "delivery-requeue", "delivery-tick"]
# Runs at random delays per way of serving, on top of the aimed ones and the double signal: a
# small budget in `make test` (each run with its own server costs 10-15 s), more under
# `make fuzz` (HYPOTHESIS_PROFILE=fuzz), as the property-based tests do.
RANDOM_RUNS = 8 if os.environ.get("HYPOTHESIS_PROFILE") == "fuzz" else 2
START_TIMEOUT = 150.0
EXIT_TIMEOUT = 90.0

pytestmark = pytest.mark.slow


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for `signum` (/proc's SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return False


def _maps(pid: int, library: str) -> bool:
    """Whether the process has `library` (a shared object) mapped."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return library in maps.read()
    except OSError:
        return False


def _marked(token: str) -> list[str]:
    """The processes alive whose environment carries `token` (a zombie's environment reads empty)."""
    needle = f"{MARK}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if needle not in environ.read():
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry}: {command[:200]}")
        except OSError:
            continue
    return found


def _wait(predicate: Callable[[], bool], timeout: float, what: str, poll: float = 0.01) -> float:
    """Wait for `predicate`; the monotonic time it became true."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)
    return time.monotonic()


class Served:
    """One `delivery serve` process, its output lines kept as they come."""

    def __init__(self, env: dict[str, str], cwd: Path, api: str, port: int) -> None:
        self.token = uuid.uuid4().hex
        self.api = api
        self.started_wall = time.time()
        self.proc = subprocess.Popen(
            [DELIVERY, "serve", "--port", str(port)],
            env={**env, MARK: self.token},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: object, lines: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            lines.append(line.rstrip("\n"))

    def handler_installed(self) -> bool:
        return _catches(self.proc.pid, signal.SIGTERM)

    def printed(self, text: str) -> bool:
        return any(text in line for line in self.out)

    def deployed(self) -> bool:
        """Both deployments applied by this process: an earlier run touched them (pausing their
        schedules) before it exited, so before this process started."""
        try:
            answer = httpx.post(f"{self.api}/deployments/filter", json={}, timeout=2)
        except httpx.TransportError:
            return False
        if answer.status_code != 200:
            return False
        fresh = [
            d["name"] for d in answer.json() if datetime.fromisoformat(d["updated"]).timestamp() > self.started_wall
        ]
        return sorted(fresh) == SERVED

    def finish(self) -> int:
        try:
            code = self.proc.wait(timeout=EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"delivery serve did not exit within {EXIT_TIMEOUT:.0f} s:\n{self.report()}") from None
        for reader in self._readers:
            reader.join(timeout=10)
        return code

    def report(self) -> str:
        return "stdout:\n" + "\n".join(self.out) + "\nstderr (end):\n" + "\n".join(self.err)[-3000:]


@dataclass(frozen=True)
class Shot:
    """When to signal a run, and how."""

    at: str  # "handler" | "prefect import" | "server" | "ui" | "deployed" | "serving" | "delay"
    signum: signal.Signals
    delay: float = 0.0
    second_after: float | None = None  # a second signal this long after the first was announced

    def __str__(self) -> str:
        when = f"{self.at} {self.delay:.2f}s" if self.at == "delay" else self.at
        second = "" if self.second_after is None else f" + 2nd after {self.second_after:.2f}s"
        return f"{self.signum.name} at {when}{second}"


@dataclass
class Outcome:
    shot: Shot
    code: int
    phase: str | None  # from the stop announcement
    forced: bool
    ready_after: float | None  # handler in place -> both deployments in the API, when awaited
    stop_seconds: float  # first signal -> exit
    problems: list[str]

    def __str__(self) -> str:
        ready = "" if self.ready_after is None else f", ready after {self.ready_after:.1f} s"
        forced = ", forced" if self.forced else ""
        return f"{self.shot}: exit {self.code} while {self.phase}{forced}, {self.stop_seconds:.1f} s to stop{ready}"


def _shoot(served: Served, shot: Shot) -> Outcome:
    ready_after = None
    if shot.at == "prefect import":
        # Not waiting for the handler: it must be in place by then. orjson's extension is loaded a
        # second or so before Prefect's import ends (the CLI's own imports do not load it).
        _wait(lambda: _maps(served.proc.pid, "orjson"), START_TIMEOUT, "Prefect's import", poll=0.005)
    handler_at = _wait(served.handler_installed, 30, "the signal handler") if shot.at != "prefect import" else 0.0
    if shot.at == "server":
        # Its own server started and not yet answering (it takes seconds to): the phase no other
        # aimed moment lands in, and the one random delays reached least often.
        _wait(lambda: any("prefect server start" in line for line in _marked(served.token)), START_TIMEOUT,
              "the Prefect server's process", poll=0.05)  # fmt: skip
    elif shot.at == "ui":
        _wait(lambda: served.printed("Prefect UI:"), START_TIMEOUT, "the UI line")
    elif shot.at == "serving":
        # The deployments appear in the API a moment before their registration returns: a shot
        # aimed at them lands in "serving" only now and then, this one always.
        _wait(lambda: served.printed("serving deliver-rule"), START_TIMEOUT, "the serving line")
    elif shot.at == "deployed":
        ready_after = _wait(served.deployed, START_TIMEOUT, "both deployments", poll=0.05) - handler_at
    elif shot.at == "delay":
        time.sleep(max(0.0, handler_at + shot.delay - time.monotonic()))
    served.proc.send_signal(shot.signum)
    signalled_at = time.monotonic()
    if shot.second_after is not None:
        # Once the first is seen (two pending signals would merge into one), while it stops gracefully.
        _wait(lambda: served.printed("stopping on ") or served.proc.poll() is not None, 30, "the stop announced")
        time.sleep(shot.second_after)
        if served.proc.poll() is None:
            served.proc.send_signal(shot.signum)
    code = served.finish()
    stop_seconds = time.monotonic() - signalled_at
    problems = [] if code == 0 else [f"exit code {code}"]
    announced = f"stopping on {shot.signum.name}, received while "
    stopping = [line.removeprefix(announced) for line in served.out if line.startswith(announced)]
    if len(stopping) != 1:
        problems.append(f"the stop is announced {len(stopping)} times")
    if not served.out or served.out[-1] not in ("stopped", "stopped (forced)"):
        problems.append("no 'stopped' at the end")
    forced = bool(served.out) and served.out[-1] == "stopped (forced)"
    return Outcome(shot, code, stopping[0] if stopping else None, forced, ready_after, stop_seconds, problems)


def _left_behind(token: str) -> list[str]:
    """The processes still carrying `token` a few seconds on; SIGKILLed so the next run starts clean."""
    deadline = time.monotonic() + 5
    while (left := _marked(token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for line in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
    return left


@dataclass(frozen=True)
class ExistingServer:
    api: str
    home: Path


@pytest.fixture(scope="module")
def existing_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExistingServer]:
    """A `prefect server start` of the test's own, for the runs that serve against one."""
    home = tmp_path_factory.mktemp("existing-prefect")
    with prefect_server(home) as api:
        yield ExistingServer(api, home)


def _plan(rng: random.Random, ready_after: float, own_server: bool) -> list[Shot]:
    """The aimed moments, then random ones spread over [0, ready_after], one per slice."""
    signals = [signal.SIGTERM, signal.SIGINT]
    shots = [
        Shot("handler", signal.SIGINT),
        Shot("prefect import", signal.SIGTERM),
        Shot("prefect import", signal.SIGINT),
        Shot("ui", signal.SIGTERM),
        Shot("serving", signal.SIGINT),
    ]
    if own_server:
        shots.append(Shot("server", signal.SIGINT))
    for i in range(RANDOM_RUNS):
        delay = (i + rng.random()) / RANDOM_RUNS * ready_after
        shots.append(Shot("delay", signals[i % 2], delay))
    return shots


@pytest.mark.fuzz
@pytest.mark.parametrize("way", ["own server", "existing server"])
def test_serve_exits_0_and_leaves_nothing_whenever_the_signal_comes(
    way: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        # Shared by this test's runs: the local server migrates its database once, not per run.
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DELIVERY_DATABASE_URL": f"sqlite:///{tmp_path / 'delivery.db'}",
        "COLUMNS": "200",
    }
    env.pop("PREFECT_API_URL", None)
    existing = None
    if way == "existing server":
        server: ExistingServer = request.getfixturevalue("existing_server")
        existing = server.api
        env["PREFECT_API_URL"] = existing
    else:
        # A migrated database to start from: migrating a new one costs each local server 5-30 s.
        migrated_home(tmp_path / "prefect")
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)

    def run(shot: Shot) -> Outcome:
        port = free_port()
        api = existing or f"http://127.0.0.1:{port}/api"
        served = Served(env, tmp_path, api, port)
        outcome = _shoot(served, shot)
        if left := _left_behind(served.token):
            outcome.problems.append(f"processes left behind: {left}")
        if existing is None and healthy(api):
            outcome.problems.append("the Prefect server it started still answers")
        if existing is not None and not healthy(existing):
            outcome.problems.append("the existing Prefect server is gone")
        print(f"{way}: {outcome}")
        if outcome.problems:
            print(served.report())
        return outcome

    # The original report: SIGTERM right after both deployments appeared; then a second signal
    # while the first one's stop is under way. Both time the start-up; the second one (caches warm
    # like the later runs') sets the span of the random delays.
    outcomes = [run(Shot("deployed", signal.SIGTERM)), run(Shot("deployed", signal.SIGINT, second_after=0.05))]
    ready_after = outcomes[-1].ready_after
    assert ready_after is not None
    outcomes += [run(shot) for shot in _plan(rng, ready_after, own_server=existing is None)]
    failed = [f"{o}: {'; '.join(o.problems)}" for o in outcomes if o.problems]
    assert not failed, f"{way} (seed {seed}):\n" + "\n".join(failed)
    phases = {o.phase for o in outcomes}
    expected = {"starting", "registering the deployments", "serving"}
    if existing is None:
        expected.add("starting the Prefect server")
    assert expected <= phases, f"phases reached (seed {seed}): {phases}"
    # Whether the double signal forces the stop depends on the race it is about: the runner may be
    # done before the second arrives (0.05 s on, seen in CI), and then a plain stop is right. The
    # forced path is proven where something is certainly left to force: a chain in flight, below.


def _serve_with_a_chain_in_flight(
    api: str, engine: sa.Engine, target: TargetServer, tmp_path: Path
) -> tuple[Served, str]:
    """`delivery serve` against `api`, one deliver-rule run of it waiting on the target; the run's id.

    A rule of its own: the rule lock of a run stopped here stays taken on the server until Prefect
    repossesses its lease (60-75 s), and the next test's chain would wait for it."""
    rule = unique("serve")
    World(engine, target).apply(target={"timeout_seconds": 60}, rule={"name": rule}).load("c-1")
    target.program(email("c-1"), Answer.timeout(60))
    env = {
        **os.environ,
        "PREFECT_API_URL": api,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        # The runner looks for runs to start every 10 s by default.
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",
    }
    started = time.monotonic()
    served = Served(env, tmp_path, api, free_port())
    _wait(served.deployed, START_TIMEOUT, "both deployments", poll=0.1)
    deployed = time.monotonic()
    deployments = api_call("POST", f"{api}/deployments/filter", json={})
    assert isinstance(deployments, list)
    deployment = next(d for d in deployments if d["name"] == "deliver-rule")
    run = api_call("POST", f"{api}/deployments/{deployment['id']}/create_flow_run", json={"parameters": {"rule": rule}})
    assert isinstance(run, dict)
    try:
        _wait(lambda: target.count(email("c-1")) > 0, 60, "the chain's request to the target", poll=0.1)
    except AssertionError:
        state = httpx.get(f"{api}/flow_runs/{run['id']}", timeout=10).text
        served.proc.kill()
        served.finish()
        raise AssertionError(f"run {state}\n{served.report()}") from None
    print(f"deployed after {deployed - started:.1f} s, the chain's request {time.monotonic() - deployed:.1f} s later")
    return served, str(run["id"])


@pytest.fixture
def sqlite_engine(sqlite_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[sa.Engine]:
    """SQLite only: stopping serve does nothing to the database, and each run here costs ~20 s."""
    path = tmp_path / "delivery.db"
    shutil.copy(sqlite_template, path)
    monkeypatch.setenv(db.DATABASE_URL_ENV, f"sqlite:///{path}")
    engine = db.create_engine(f"sqlite:///{path}")
    yield engine
    engine.dispose()


def test_a_chain_in_flight_is_stopped_with_serve(
    existing_server: ExistingServer, sqlite_engine: sa.Engine, target: TargetServer, tmp_path: Path
) -> None:
    """SIGTERM while a served deliver-rule run waits on the target: exit 0, the run's process gone
    and the run Cancelled in the API by the runner's own stop."""
    api = existing_server.api
    served, run_id = _serve_with_a_chain_in_flight(api, sqlite_engine, target, tmp_path)
    served.proc.send_signal(signal.SIGTERM)
    code = served.finish()
    left = _left_behind(served.token)
    flow_run = api_call("GET", f"{api}/flow_runs/{run_id}")
    assert isinstance(flow_run, dict)
    state = flow_run["state"]
    assert code == 0, served.report()
    assert not left, served.report()
    assert state["type"] == "CANCELLED", state
    assert served.out[-1] == "stopped", served.report()


def test_a_second_signal_kills_the_chain_in_flight_and_still_exits_0(
    existing_server: ExistingServer, sqlite_engine: sa.Engine, target: TargetServer, tmp_path: Path
) -> None:
    served, _ = _serve_with_a_chain_in_flight(existing_server.api, sqlite_engine, target, tmp_path)
    served.proc.send_signal(signal.SIGTERM)
    _wait(lambda: served.printed("stopping on SIGTERM"), 30, "the stop announced")
    in_flight = [line for line in _marked(served.token) if "prefect.engine" in line]
    served.proc.send_signal(signal.SIGINT)
    code = served.finish()
    assert in_flight, "the run's process was gone before the second signal: nothing left to force"
    assert code == 0, served.report()
    assert not _left_behind(served.token), served.report()
    assert served.out[-1] == "stopped (forced)", served.report()
