"""A chain driven in this process without Prefect, as the deliver-rule flow drives it: open, drain
job after job, scan job after job, finish. For tests of the engine's behaviour that need no
orchestration (the flow's own wiring is tested through Prefect elsewhere)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from delivery.chain import Chain
from delivery.domain import BatchReport, ChainReport, Phase


def drive(
    engine: sa.Engine,
    rule: str,
    *,
    between_jobs: Callable[[Chain, BatchReport], None] | None = None,
    **options: Any,
) -> ChainReport:
    """One whole chain of `rule`. A rule fault is recorded as the flow records it, then raised.
    `between_jobs(chain, report)`: called after every job that does not end its phase; `options`
    go to `Chain` (listeners, say)."""
    chain = Chain(engine, rule, **options)
    try:
        ended = chain.open()
        for phase in (Phase.DRAIN, Phase.SCAN):
            while ended is None:
                report = chain.run_batch(phase)
                ended = report.ended_by
                if report.ends_phase(chain.rule.batch_size):
                    break
                if between_jobs is not None:
                    between_jobs(chain, report)
    except Exception as exc:
        chain.finish(exc)
        raise
    return chain.finish()
