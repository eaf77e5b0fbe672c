"""One chain of one rule in a process of its own, for a test to SIGKILL at any moment.

The chain runs the way `flows/deliver_rule.py` runs it (open, drain, scan, finish) without Prefect:
starting the Prefect CLI costs seconds a round, and what a kill must hit is the chain's own writes,
not the orchestration. There is no rule lock here: the test runs one chain at a time and closes the
fence on a killed one, as the tick does for a dead chain.

`python -m tests.acceptance.chain_child DATABASE_URL RULE` runs one chain (with more rules, one
chain of each side by side, on threads). With `--fork-server` it
imports everything once and then forks a process per `run DATABASE_URL RULE` line read from stdin
(a fresh interpreter per round would spend about a second importing, on every one of them). Each
chain process writes `pid N`, then `open` once its chain is open (a kill is timed from there), then
`done SECONDS ATTEMPTED ENDED_BY`; the server writes `exit STATUS` when that process is gone
(`exit -9`: it was SIGKILLed).

With `DELIVERY_TEST_SEND_LOG` set to a file, every request the target's traffic admits appends
the wall-clock time it left the budget to that file (one line each; several processes may share
the file): where the rate budget's promise is made (see `record_sends`). A slot its sender woke
too late for (a busy machine), and so gave up for a new one, appends `late TIME`. A sender
entering the budget's wait appends `ask TIME`, and `done TIME` as it leaves it, admitted or not:
between the two it wants to send.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from delivery import db
from delivery import phase as phase_rule
from delivery.chain import Chain
from delivery.domain import BatchReport, ChainEnd, Phase
from delivery.traffic import JobBounds, TargetTraffic

SEND_LOG = "DELIVERY_TEST_SEND_LOG"


def record_sends(path: str) -> None:
    """Append to `path` the time each request leaves the target's budget (its admission, on a
    thread or on the event loop). One `os.write` per line on an `O_APPEND` descriptor, so lines
    from several threads and processes never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    admit, admit_async, too_late = TargetTraffic.admit, TargetTraffic.admit_async, TargetTraffic._too_late

    def sent() -> None:
        os.write(fd, f"{time.time():.6f}\n".encode())

    def missed(self: TargetTraffic, slot: Any) -> bool:
        if too_late(self, slot):
            mark("late")
            return True
        return False

    def mark(what: str) -> None:
        os.write(fd, f"{what} {time.time():.6f}\n".encode())

    def admitted(self: TargetTraffic, bounds: JobBounds) -> bool:
        mark("ask")
        try:
            if admit(self, bounds):
                sent()
                return True
            return False
        finally:
            mark("done")

    async def admitted_async(self: TargetTraffic, bounds: JobBounds, off_loop: Any) -> bool:
        mark("ask")
        try:
            if await admit_async(self, bounds, off_loop):
                sent()
                return True
            return False
        finally:
            mark("done")

    TargetTraffic.admit = admitted  # type: ignore[method-assign]
    TargetTraffic.admit_async = admitted_async  # type: ignore[method-assign]
    TargetTraffic._too_late = missed  # type: ignore[method-assign]


def run_phase(chain: Chain, phase: Phase) -> tuple[ChainEnd | None, int]:
    """The phase's jobs by the flow's rule (`delivery.phase`). Returns how the chain ended, if it
    did, and how many records the phase attempted."""
    attempted = 0

    def job(phase: Phase) -> BatchReport:
        nonlocal attempted
        report = chain.run_batch(phase)
        attempted += report.attempted
        return report

    return phase_rule.run_phase(chain, phase, job), attempted


def run_chain(url: str, rule: str) -> None:
    print(f"pid {os.getpid()}", flush=True)
    engine = db.create_engine(url)
    chain = Chain(engine, rule)
    try:
        ended = chain.open()
        print("open", flush=True)
        began = time.monotonic()
        attempted = 0
        for phase in (Phase.DRAIN, Phase.SCAN):
            if ended is not None:
                break
            ended, count = run_phase(chain, phase)
            attempted += count
    except BaseException as exc:
        chain.finish(exc)
        raise
    report = chain.finish()
    # No `engine.dispose()`: the process ends with `os._exit` right after this line, which closes
    # its connections with it; everything the chain writes is committed by now.
    print(f"done {time.monotonic() - began:.3f} {attempted} {report.ended_by.value}", flush=True)


def fork_server() -> None:
    """Fork a chain process per `run URL RULE` line until stdin closes. Nothing here opens a
    connection or starts a thread before forking, so each chain process starts clean."""
    for line in sys.stdin:
        command, url, rule = line.split()
        assert command == "run", line
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            # SIGUSR1 writes every thread's stack to stderr (the test's log): what the test sends
            # a chain process that has not ended long after it said `done`.
            faulthandler.register(signal.SIGUSR1, all_threads=True)
            status = 0
            try:
                run_chain(url, rule)
            except BaseException:
                traceback.print_exc()
                status = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        _, wait_status = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(wait_status)}", flush=True)


def run_chains(url: str, rules: list[str]) -> None:
    """One chain per rule, side by side on threads of this process: a worker running several."""
    threads = [threading.Thread(target=run_chain, args=(url, rule)) for rule in rules]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def main(argv: list[str]) -> int:
    if os.environ.get(SEND_LOG):
        record_sends(os.environ[SEND_LOG])
    if argv == ["--fork-server"]:
        fork_server()
    elif len(argv) > 2:
        run_chains(argv[0], argv[1:])
    else:
        run_chain(*argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
