"""When a phase of a chain (the drain, the scan) is done: the one rule every driver of a chain
follows, the `deliver-rule` flow (a Prefect task per job, under the rule lock) as well as the
drivers without Prefect (the tests' `drive`, the kill tests' child process, the bench).

A driver asks `next_job()` before every job and hands each job's report to `record()`:

    jobs = PhaseJobs(chain, phase)
    while (number := jobs.next_job()) is not None:
        jobs.record(chain.run_batch(phase))     # however the driver runs the job
    ended = jobs.ended_by

The rule keeps the driver from running a job whose page is empty (`Chain.has_work`, a hint read
without the lock: no empty task runs, no "0 attempted" lines), and stops after a job that ended the
chain, came back empty, or, in the drain, came back short (`BatchReport.ends_phase`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from delivery.domain import BatchReport, ChainEnd, Phase


class _Rule(Protocol):
    @property
    def batch_size(self) -> int: ...


class PhaseChain(Protocol):
    """What the rule reads of a chain (`delivery.chain.Chain` is one)."""

    @property
    def rule(self) -> _Rule: ...

    def has_work(self, phase: Phase) -> bool: ...


@dataclass
class PhaseJobs:
    """The jobs of one phase of one chain, numbered from 1, and whether the phase is done."""

    chain: PhaseChain
    phase: Phase
    #: The number of the last job handed out (0: none yet).
    number: int = 0
    done: bool = False
    #: How the chain ended, if a job of this phase ended it.
    ended_by: ChainEnd | None = None

    def next_job(self) -> int | None:
        """The next job's number, or None once the phase is done (nothing more to run)."""
        if self.done or not self.chain.has_work(self.phase):
            self.done = True
            return None
        self.number += 1
        return self.number

    def record(self, report: BatchReport) -> None:
        """Take the report of the job `next_job` handed out last."""
        if report.ends_phase(self.chain.rule.batch_size):
            self.done = True
            self.ended_by = report.ended_by


def run_phase(
    chain: PhaseChain,
    phase: Phase,
    run_job: Callable[[Phase], BatchReport],
    between_jobs: Callable[[BatchReport], None] | None = None,
) -> ChainEnd | None:
    """Run the phase's jobs in this thread, one after the other, by `run_job` (e.g.
    `chain.run_batch`): for drivers without Prefect. `between_jobs(report)` is called after every
    job that does not end the phase. Returns how the chain ended, if a job ended it."""
    jobs = PhaseJobs(chain, phase)
    while jobs.next_job() is not None:
        report = run_job(phase)
        jobs.record(report)
        if not jobs.done and between_jobs is not None:
            between_jobs(report)
    return jobs.ended_by
