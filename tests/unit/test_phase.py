"""When a phase of a chain is done (`delivery.phase`): the rule the `deliver-rule` flow and every
driver without Prefect follow."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from delivery.domain import BatchReport, ChainEnd, Phase
from delivery.phase import PhaseJobs, run_phase


@dataclass
class _Rule:
    batch_size: int = 3


@dataclass
class FakeChain:
    """Pages of the given sizes, in turn; `has_work` says whether a next page has anything."""

    pages: list[int]
    ends: dict[int, ChainEnd] = field(default_factory=dict)
    rule: _Rule = field(default_factory=_Rule)
    asked: int = 0
    ran: int = 0

    def has_work(self, phase: Phase) -> bool:
        self.asked += 1
        return self.ran < len(self.pages) and self.pages[self.ran] > 0

    def run_batch(self, phase: Phase) -> BatchReport:
        attempted = self.pages[self.ran] if self.ran < len(self.pages) else 0
        self.ran += 1
        return BatchReport(phase, attempted=attempted, ended_by=self.ends.get(self.ran))


@pytest.mark.parametrize("phase", list(Phase))
def test_no_job_runs_when_the_first_page_is_empty(phase: Phase) -> None:
    chain = FakeChain(pages=[])
    jobs = PhaseJobs(chain, phase)
    assert jobs.next_job() is None
    assert jobs.done and jobs.number == 0 and jobs.ended_by is None
    assert jobs.next_job() is None and chain.asked == 1  # done stays done, without asking again


def test_the_drain_is_done_after_a_short_page() -> None:
    chain = FakeChain(pages=[3, 3, 2, 3])
    assert run_phase(chain, Phase.DRAIN, chain.run_batch) is None
    assert chain.ran == 3  # the fourth page is never asked for: the drain's set is fixed at the start


def test_the_scan_goes_on_past_a_short_page_until_nothing_is_left() -> None:
    chain = FakeChain(pages=[3, 2, 1, 0])
    assert run_phase(chain, Phase.SCAN, chain.run_batch) is None
    assert chain.ran == 3  # the empty fourth page is seen by `has_work`: no empty job


def test_a_job_that_ended_the_chain_ends_the_phase_whatever_its_size() -> None:
    chain = FakeChain(pages=[3, 3, 3], ends={2: ChainEnd.BREAKER_OPEN})
    seen: list[int] = []
    assert run_phase(chain, Phase.SCAN, chain.run_batch, lambda r: seen.append(r.attempted)) is ChainEnd.BREAKER_OPEN
    assert chain.ran == 2
    assert seen == [3]  # `between_jobs` only between jobs: not after the one that ended the phase


def test_a_job_that_came_back_empty_ends_the_phase_though_has_work_said_otherwise() -> None:
    # Another chain took the page between the hint and the lock: the job finds nothing.
    chain = FakeChain(pages=[3, 0])
    chain.has_work = lambda phase: True  # type: ignore[method-assign]
    jobs = PhaseJobs(chain, Phase.SCAN)
    numbers = []
    while (number := jobs.next_job()) is not None:
        numbers.append(number)
        jobs.record(chain.run_batch(Phase.SCAN))
    assert numbers == [1, 2] and jobs.done and jobs.ended_by is None
