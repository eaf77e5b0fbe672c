"""What a `deliver-rule` run tells the operator, apart from its state: the run's name and tags, a
line per job and per record left behind, the chain's artifacts, the rule's health events, the
standing artifacts refreshed at its end, and the summary `delivery run` prints. The flow
(`flows/deliver_rule.py`) only wires the chain into Prefect and decides the state; everything here
is public interface to operators (keys, tags, words), so it changes only on purpose.

One `ChainReporter` per chain, made by the flow once the chain exists and handed down in the
flow's context: it carries the run's logger, so that what the operator must see goes to the chain's
own run and never to another chain's, however many chains one process runs at a time.

The `delivery-status` artifact speaks of every rule, so publishing it costs a read over all of
them; a process that runs many chains can throttle it with `throttle_status`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shlex
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any
from uuid import UUID

from prefect import get_client
from prefect.artifacts import acreate_markdown_artifact, acreate_table_artifact
from prefect.client.schemas import State
from prefect.events import emit_event
from prefect.runtime import flow_run

from delivery import reports
from delivery.chain import Chain
from delivery.db import shared_engine
from delivery.domain import BatchReport, ChainEnd, ChainReport, Cursor, LedgerStatus, Phase
from delivery.errors import UnknownName
from delivery.rule_health import TELLING, transition
from delivery.status import RUN_STATE_NAMES, plain_duration
from flows import metrics
from flows.parked_artifact import has_parked_set, publish_parked_set
from flows.status_artifact import publish_status

Logger = logging.Logger | logging.LoggerAdapter[Any]

#: How many parked or failed records a chain's records artifact lists (the total is given too).
RECORDS_LISTED = 200
#: The tags `ending_tags` sets, replaced whole when a retried run ends again.
ENDING_TAG_PREFIXES = ("ended:", "fault:", "parked:", "failed:")
#: The statuses a chain leaves behind for the operator (the rule's parked set).
_LEFT = (LedgerStatus.FAILED.value, LedgerStatus.EXHAUSTED.value, LedgerStatus.REMOTE_GONE.value)


# -- the delivery-status throttle ---------------------------------------------------------------


class StatusThrottle:
    """Whether a chain's end publishes the `delivery-status` artifact.

    Unthrottled (the default: a chain run alone, by `delivery run` or a process worker), every end
    publishes. Throttled, an end publishes when `every_seconds` have passed since the last publish of
    this process, and always when it is the last chain in flight in this process, so a worker gone
    idle leaves the artifact as of its last chain. Staleness in between is bounded by the interval
    and by the tick, which publishes the artifact itself. Chains end on several threads at once
    (flows/worker.py): the count and the clock are read and written under one lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._every: float | None = None
        self._last: float | None = None
        self._in_flight = 0

    @property
    def every_seconds(self) -> float | None:
        return self._every

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def throttle(self, every_seconds: float | None) -> None:
        if every_seconds is not None and every_seconds < 0:
            raise ValueError(f"every_seconds must be 0 or more, or None, not {every_seconds}")
        with self._lock:
            self._every = every_seconds

    def started(self) -> None:
        with self._lock:
            self._in_flight += 1

    def ended(self) -> bool:
        """A chain has ended (each `started` is followed by one `ended`): whether it publishes."""
        with self._lock:
            self._in_flight = max(0, self._in_flight - 1)
            now = self._clock()
            if (
                self._every is not None
                and self._in_flight > 0
                and self._last is not None
                and now - self._last < self._every
            ):
                return False
            self._last = now
            return True


#: The one throttle of this process: a process-wide decision by its nature (it is about the cost
#: one process puts on the database and the Prefect API), guarded by its own lock.
STATUS = StatusThrottle()


def throttle_status(every_seconds: float | None) -> None:
    """For a long-lived process running many chains (the warm worker): publish the
    `delivery-status` artifact at a chain's end at most every `every_seconds` (and always at the end
    of the last chain in flight). None: at every chain's end, the default. Call it once, before the
    chains start; it holds for the whole process."""
    STATUS.throttle(every_seconds)


# -- words ----------------------------------------------------------------------------------------


def tally(counts: Mapping[str, int]) -> str:
    """`4 delivered, 1 exhausted`: counts in words, in the ledger's order of statuses."""
    return ", ".join(f"{counts[s.value]} {s.value}" for s in LedgerStatus if counts.get(s.value)) or "nothing"


def _cursor_words(cursor: Cursor | None) -> str:
    if cursor is None:
        return "none yet (the scan starts from the first change)"
    return f"changes up to {cursor.changed_at.isoformat(timespec='seconds')} (record {cursor.record_id})"


def _cell(value: Any, limit: int = 200) -> str:
    if value is None:
        return "-"
    text = value.isoformat(timespec="seconds") if hasattr(value, "isoformat") else str(value)
    text = " ".join(text.split())[:limit]
    return text.replace("\\", "\\\\").replace("|", "\\|") or "-"


def _artifact_key(rule: str) -> str:
    return "chain-" + (re.sub(r"[^a-z0-9-]+", "-", rule.lower()).strip("-") or "rule")


def records_artifact_key(rule: str) -> str:
    return _artifact_key(rule) + "-records"


def requeue_command(rule: str, statuses: list[str], since: str) -> str:
    """The `delivery requeue` command line that selects exactly the rows a chain left behind: the
    rule's rows in those statuses written since the chain started."""
    words = ["delivery", "requeue", rule, *(w for s in statuses for w in ("--status", s)), "--since", since]
    return shlex.join(words)


def rule_tags(chain: Chain) -> list[str]:
    return [f"rule:{chain.rule.name}", f"target:{chain.rule.target.name}"]


def ending_tags(report: ChainReport, fault: str | None = None) -> list[str]:
    """Tags that say how the chain ended, for the runs list and its tag filter: `ended:ENDING`
    always, `fault:CLASS` for a rule fault, `parked:N` and `failed:N` for records it parked or left
    failed. The state name alone does not serve: Prefect's state filter and its automations know
    only their own state names (a Failed run named otherwise is not found as Failed)."""
    tags = [f"ended:{report.ended_by.value}"]
    if fault is not None:
        tags.append(f"fault:{fault}")
    parked = report.counts.get(LedgerStatus.EXHAUSTED.value, 0) + report.counts.get(LedgerStatus.REMOTE_GONE.value, 0)
    if parked:
        tags.append(f"parked:{parked}")
    if failed := report.counts.get(LedgerStatus.FAILED.value, 0):
        tags.append(f"failed:{failed}")
    return tags


# -- the reporter of one chain --------------------------------------------------------------------


async def tag_this_run(*added: str) -> None:
    """Add `added` to the running flow run's tags (a refused requeue's `fault:CLASS`, say), so
    Prefect's tag filter finds the run; nothing outside a flow run."""
    run_id = flow_run.get_id()
    if run_id is None:
        return
    tags = sorted({*flow_run.get_tags(), *added})
    async with get_client() as client:
        await client.update_flow_run(UUID(run_id), tags=tags)


class ChainReporter:
    """Everything one chain's run reports, with the run's logger. Made by the flow once its chain
    exists (`begin`), ended by the flow's one closing path (`close`)."""

    def __init__(self, chain: Chain, run_logger: Logger, throttle: StatusThrottle | None = None) -> None:
        self.chain = chain
        #: The fault that stopped a phase: its subflow ends `Stopped` (not Failed: the chain's run
        #: is the one Failed run of the fault), and the chain's flow raises it.
        self.fault: BaseException | None = None
        #: The `deliver-rule` run's logger: lock waits and repairs, a breaker trip and the records
        #: left behind go to the chain's own run, not to the drain or scan subflow's.
        self.run_logger = run_logger
        self._throttle = throttle or STATUS
        self._parked_before = False

    async def begin(self) -> None:
        """Count the chain in flight, note whether the rule has a parked set before it runs (its
        `parked-RULE` must then be refreshed, even if this chain parks nothing), and name and tag
        the run."""
        self._throttle.started()
        self._parked_before = has_parked_set(self.chain.engine, self.chain.rule.id)
        await self._label_run()

    async def _label_run(self) -> None:
        """Name and tag the run after the rule and target, so operators can filter on them."""
        run_id = flow_run.get_id()
        if run_id is None:
            return
        name = f"{self.chain.rule.name} -> {self.chain.rule.target.name}"
        tags = sorted({*flow_run.get_tags(), *rule_tags(self.chain)})
        if flow_run.get_name() == name and set(tags) <= set(flow_run.get_tags()):
            return  # created so by the tick (flow_run_name, tags): nothing to rename afterwards
        async with get_client() as client:
            await client.update_flow_run(UUID(run_id), name=name, tags=tags)

    # -- a job ----------------------------------------------------------------------------------

    def job_done(self, phase_logger: Logger, phase: Phase, number: int, report: BatchReport) -> None:
        """A job's line in its subflow's log; its waits and every record it left behind in the
        chain's run log (parking is never silent); its counts in the process's metrics."""
        rule = self.chain.rule
        for outcome, n in report.counts.items():
            metrics.RECORDS.labels(rule=rule.name, target=rule.target.name, outcome=outcome).inc(n)
        if report.waited_seconds:
            metrics.RATE_WAIT.labels(target=rule.target.name).inc(report.waited_seconds)
        if report.attempted:
            phase_logger.info(
                "%s batch %d: %d records: %s", phase.value, number, report.attempted, tally(report.counts)
            )
        if report.waited_seconds >= 0.05:
            self.run_logger.info(
                "rule %s: %s batch %d waited %s for target %s's traffic (its rate budget or a pause)",
                rule.name, phase.value, number, plain_duration(report.waited_seconds), rule.target.name,
            )  # fmt: skip
        for left in report.left_behind:
            why = " ".join((left.error or "no error recorded").split())[:300]
            if left.status is LedgerStatus.FAILED:
                due = left.next_attempt_at.isoformat(timespec="seconds") if left.next_attempt_at else "not set"
                if left.held:
                    # Held back by the target (its pause), no fault of the record's: no attempt spent.
                    self.run_logger.warning(
                        "rule %s: record %s held by target %s (no attempt spent), sent again from %s: %s",
                        rule.name, left.external_id, rule.target.name, due, why,
                    )  # fmt: skip
                    continue
                self.run_logger.warning(
                    "rule %s: record %s failed, next attempt %s: %s", rule.name, left.external_id, due, why
                )
            else:
                self.run_logger.warning(
                    "rule %s: record %s parked as %s: %s", rule.name, left.external_id, left.status.value, why
                )

    # -- the chain's end ------------------------------------------------------------------------

    async def close(self, report: ChainReport, fault: str | None = None) -> None:
        """Everything a chain's end publishes: its report, the records it left, the standing
        artifacts, how it ended as tags, and the rule's health event."""
        metrics.CHAINS.labels(rule=report.rule, ending=report.ended_by.value).inc()
        publish_status_now = self._throttle.ended()
        await self._publish(report)
        await self._publish_records()
        await self._publish_standing(report, publish_status_now)
        await self._tag_ending(report, fault)
        self._announce(report)

    async def _publish(self, report: ChainReport) -> None:
        rows = [
            {
                "outcome": status.value,
                "drained": report.drained.get(status.value, 0),
                "scanned": report.scanned.get(status.value, 0),
                "total": report.counts.get(status.value, 0),
            }
            for status in LedgerStatus
        ]
        description = (
            f"**{report.rule}** ended **{RUN_STATE_NAMES[report.ended_by]}**: {report.message or 'caught up'}\n\n"
            f"cursor before: {_cursor_words(report.cursor_before)}  \n"
            f"cursor after: {_cursor_words(report.cursor_after)}  \njobs: {report.batches}"
            + (
                f"  \nwaited for the target's traffic: {plain_duration(report.waited_seconds)}"
                if report.waited_seconds
                else ""
            )
        )
        await acreate_table_artifact(table=rows, key=_artifact_key(report.rule), description=description)

    async def _publish_records(self) -> None:
        """The `chain-RULE-records` artifact: the records this chain parked or left failed (the first
        `RECORDS_LISTED`, and how many in all), and the `delivery requeue` command that puts them
        back. Published after every chain, so the key's latest version always speaks of the latest
        chain. last_error is redacted when it is written."""
        chain = self.chain
        rule = chain.rule
        with chain.engine.connect().execution_options(readonly=True) as conn:
            rows, counts = reports.left_behind_since(conn, rule.id, chain.started_at, RECORDS_LISTED)
        total = sum(counts.values())
        since = chain.started_at.isoformat()
        if total == 0:
            markdown = f"**{rule.name}**: this chain (started {since}) parked no record and left none failed."
        else:
            statuses = [s.value for s in reports.LEFT_BEHIND if counts.get(s.value)]
            said = ", ".join(f"{counts[s]} {s}" for s in statuses)
            lines = [
                f"**{rule.name}**: this chain (started {since}) parked or left failed **{total}** record(s): {said}.",
                "",
                "Put them back (each becomes a retry due now, attempts reset; `--dry-run` lists them first; "
                "rows a later chain parks are selected too):",
                "",
                "```bash",
                requeue_command(rule.name, statuses, since),
                "```",
                "",
                "| external id | status | attempts | last error | next attempt |",
                "| --- | --- | --- | --- | --- |",
            ]
            lines += [
                f"| {_cell(r['external_id'])} | {r['status']} | {r['attempts']} | {_cell(r['last_error'])} "
                f"| {_cell(r['next_attempt_at'])} |"
                for r in rows
            ]
            if total > len(rows):
                lines += ["", f"The first {len(rows)} of {total} are listed; `delivery ledger --rule` shows them all."]
            markdown = "\n".join(lines)
        await acreate_markdown_artifact(
            markdown=markdown,
            key=records_artifact_key(rule.name),
            description=f"Records {rule.name}'s chain parked or left failed ({total})",
        )

    async def _publish_standing(self, report: ChainReport, status_too: bool) -> None:
        """The artifacts that speak of now rather than of this chain, refreshed as it ends: the
        rule's `parked-RULE` (when this chain left records behind, or the rule had a parked set
        before it: a rule that never parked anything has nothing to show, and reading and sending
        its empty set at every chain's end is the cost of a busy worker) and the `delivery-status`
        of every rule (so it is never a tick behind; see `StatusThrottle`). Neither is the chain's
        own outcome: a failure to publish them is logged, and the chain ends as it did."""
        chain = self.chain
        try:
            if self._parked_before or any(report.counts.get(s) for s in _LEFT):
                with contextlib.suppress(UnknownName):  # a rule retired while its chain ran: nothing stands
                    await publish_parked_set(chain.engine, chain.rule.name)
            if status_too:
                await publish_status()
        except Exception as exc:
            self.run_logger.warning(
                "rule %s: the parked-set or status artifact was not refreshed: %s",
                chain.rule.name,
                chain.redact(str(exc)),
            )

    async def _tag_ending(self, report: ChainReport, fault: str | None) -> None:
        run_id = flow_run.get_id()
        if run_id is None:
            return
        # A retried run's earlier ending goes: the tags say how this run ended last, not before.
        kept = {t for t in flow_run.get_tags() if not t.startswith(ENDING_TAG_PREFIXES)}
        tags = sorted({*kept, *rule_tags(self.chain), *ending_tags(report, fault)})
        async with get_client() as client:
            await client.update_flow_run(UUID(run_id), tags=tags)

    def _announce(self, report: ChainReport) -> None:
        """Emit a Prefect event when the rule's health changes; the automations in
        `automations/rule-failing.yaml` and `rule-recovered.yaml` turn these into notifications.
        A cancelled chain tells nothing about the rule: no event."""
        chain = self.chain
        if report.ended_by not in TELLING:
            return
        with chain.engine.connect().execution_options(readonly=True) as conn:
            previous = reports.previous_end(conn, chain.rule.id, chain.token, [end.value for end in TELLING])
        change = transition(previous, report.ended_by)
        if change is None:
            return
        emit_event(
            event=change.value,
            resource={
                "prefect.resource.id": f"delivery.rule.{chain.rule.name}",
                "prefect.resource.name": chain.rule.name,
                "delivery.target": chain.rule.target.name,
            },
            payload={
                "ended_by": report.ended_by.value,
                # As the run's state is named (`CaughtUp`), for the notification's words.
                "ending": RUN_STATE_NAMES[report.ended_by],
                "message": report.message,
                "previous": previous,
            },
        )


# -- the command line's summary -------------------------------------------------------------------


def _state_name(state: State[Any]) -> str:
    if state.is_completed():
        return "COMPLETED"
    return "CANCELLED" if state.is_cancelled() else "FAILED"


def summary(rule: str, state: State[Any]) -> dict[str, Any]:
    """What `delivery run --json` prints of a `deliver-rule` run that ended in `state`: its chain's
    report as recorded, every count 0 when it has none (a run that ended before its chain began)."""
    flow_run_id = str(state.state_details.flow_run_id)
    with shared_engine().connect().execution_options(readonly=True) as conn:
        recorded = reports.chain_report(conn, flow_run_id)
    report: dict[str, Any] = dict(recorded or {})
    empty = {s.value: 0 for s in LedgerStatus}
    return {
        "rule": rule,
        "state": _state_name(state),
        "ended_by": report.get("ended_by", ChainEnd.RULE_FAULT.value),
        "message": report.get("message") or state.message or "",
        "counts": report.get("counts", empty),
        "drained": report.get("drained", empty),
        "scanned": report.get("scanned", empty),
        "cursor_before": report.get("cursor_before"),
        "cursor_after": report.get("cursor_after"),
        "waited_seconds": report.get("waited_seconds", 0.0),
        "flow_run_id": flow_run_id,
    }
