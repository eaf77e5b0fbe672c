"""A chain driven in this process without Prefect, as the deliver-rule flow drives it: open, drain
job after job, scan job after job, finish. For tests of the engine's behaviour that need no
orchestration (the flow's own wiring is tested through Prefect elsewhere)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from delivery.chain import Chain
from delivery.domain import BatchReport, ChainReport, Phase
from delivery.phase import run_phase


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
    report, fault = _drive(engine, rule, between_jobs, options)
    if fault is not None:
        raise fault
    return report


def run(engine: sa.Engine, rule: str, **options: Any) -> dict[str, Any]:
    """One whole chain of `rule`, summarised as `delivery run --json` summarises a `deliver-rule`
    run (`flows.chain_reporting.summary`) less the flow run's id: state COMPLETED, or FAILED for a
    rule fault, whose message then begins with the fault's class as the run's does."""
    report, fault = _drive(engine, rule, None, options)
    return {"rule": rule, "state": "COMPLETED" if fault is None else "FAILED", **report.as_json()}


def _drive(
    engine: sa.Engine,
    rule: str,
    between_jobs: Callable[[Chain, BatchReport], None] | None,
    options: dict[str, Any],
) -> tuple[ChainReport, Exception | None]:
    chain = Chain(engine, rule, **options)
    try:
        ended = chain.open()
        hook = None if between_jobs is None else (lambda report: between_jobs(chain, report))
        for phase in (Phase.DRAIN, Phase.SCAN):
            if ended is None:
                ended = run_phase(chain, phase, chain.run_batch, hook)
    except Exception as exc:
        return chain.finish(exc), exc
    return chain.finish(), None
