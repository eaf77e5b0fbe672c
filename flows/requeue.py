"""`delivery-requeue`: put parked records back from the Prefect UI, as `delivery requeue` does.

The same selection, checked the same way (`Selection.of`: only exhausted, remote_gone and failed
rows), the same versioned write through the same service (`delivery.requeue.requeue`), and the
same audit row in `requeues`, which also names this flow run. What it changed is published as the
table artifact `requeue-RULE` on the run, what a dry run would change as `requeue-dry-run-RULE`, so
the operator who pressed "Run" sees the records there; a real requeue then refreshes the rule's `parked-RULE`
artifact (`flows.parked_artifact`). The run is named `requeue RULE` (`requeue RULE (dry run)`) and
tagged `rule:RULE` and `target:TARGET`, as a chain's run is.

The Run form: every parameter has a description (the docstring's "Args:" section) and a plain type
with a default the form shows, never `X | None` (Prefect's UI renders that as a switch between the
type and "None"). Prefect does not check the parameters (`validate_parameters=False`): the flow
checks them itself, so that a requeue refused (an unknown rule, a status that cannot be requeued, a
`by` longer than the audit row keeps (200), a NUL in any text, a bad DELIVERY_* variable, a
database that does not answer) ends Failed, named after the fault, with one ERROR line saying what
was wrong and what to do, and nothing written.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal
from uuid import UUID

import sqlalchemy as sa
from prefect import flow, get_client, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.client.schemas import State
from prefect.runtime import flow_run
from prefect.states import Completed, Failed
from pydantic import TypeAdapter, ValidationError

from delivery import requeue as requeue_service
from delivery.db import DatabaseUnavailable, DatabaseUrlError, shared_engine
from delivery.errors import DeliveryError, InputError, UnknownName
from delivery.settings import SettingsError, settings
from flows.parked_artifact import parked_artifact_key, publish_parked_set_sync

#: At most this many records are listed in the artifact; its description always gives the total.
ARTIFACT_ROWS = 500
#: How much of each last_error the artifact shows (the ledger keeps it whole; it is redacted there).
ERROR_EXCERPT = 200

#: What the UI offers for `statuses` (a list of choices, not free text).
RequeuableStatus = Literal["exhausted", "remote_gone", "failed"]
#: What the form shows in `statuses` to begin with: what a requeue takes when none is named
#: (`delivery.requeue.DEFAULT_STATUSES`; an empty list still means the same).
DEFAULT_STATUSES: tuple[RequeuableStatus, ...] = ("exhausted", "remote_gone")
#: `since`'s default, shown in the form's date picker: every row changed after it, i.e. any time.
ANY_TIME = datetime(1970, 1, 1, tzinfo=UTC)


def artifact_key(rule: str, dry_run: bool = False) -> str:
    """`requeue-RULE` for a requeue, `requeue-dry-run-RULE` for a dry run, in the characters
    Prefect allows in an artifact key: a dry run never becomes the latest `requeue-RULE`."""
    slug = re.sub(r"[^a-z0-9-]+", "-", rule.lower()).strip("-") or "rule"
    return ("requeue-dry-run-" if dry_run else "requeue-") + slug


def run_name(rule: str, dry_run: bool) -> str:
    """`requeue RULE`, or `requeue RULE (dry run)`: what the run list shows."""
    return f"requeue {rule}" + (" (dry run)" if dry_run else "")


def _records(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "external_id": r["external_id"],
            "was": r["status"],
            "attempts": r["attempts"],
            "remote_id": r["remote_id"] or "",
            "last_error": (r["last_error"] or "")[:ERROR_EXCERPT],
        }
        for r in rows
    ]


def _publish(
    rule: str, rows: list[dict[str, Any]], selection: requeue_service.Selection, dry_run: bool, by: str
) -> None:
    verb = "would requeue" if dry_run else "requeued"
    shown = "" if len(rows) <= ARTIFACT_ROWS else f" (the first {ARTIFACT_ROWS} are listed)"
    criteria = selection.as_json()
    description = (
        f"**{rule}**: {verb} {len(rows)} record(s){shown}, asked by `{by}`"
        + (" (dry run: nothing was changed)" if dry_run else "")
        + f"  \nstatuses: `{', '.join(criteria['statuses'])}`"
        + (f"  \nids: `{', '.join(criteria['external_ids'])}`" if criteria["external_ids"] else "")
        + (f"  \nerror contains: `{criteria['error_contains']}`" if criteria["error_contains"] else "")
        + (f"  \nparked since: `{criteria['since']}`" if criteria["since"] else "")
    )
    table = _records(rows[:ARTIFACT_ROWS]) or [
        {"external_id": "", "was": "", "attempts": "", "remote_id": "", "last_error": "no record matched"}
    ]
    create_table_artifact(table=table, key=artifact_key(rule, dry_run), description=description)


# -- the parameters, checked by the flow itself ----------------------------------------------------

_TEXT: TypeAdapter[str] = TypeAdapter(str)
_TEXTS: TypeAdapter[list[str]] = TypeAdapter(list[str])
_TIME: TypeAdapter[datetime] = TypeAdapter(datetime)
_FLAG: TypeAdapter[bool] = TypeAdapter(bool)


def _checked(parameter: str, adapter: TypeAdapter[Any], value: Any) -> Any:
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        raise requeue_service.RequeueInputError(parameter, exc.errors()[0]["msg"]) from None


@dataclass(frozen=True)
class Request:
    """A requeue asked through the flow's parameters, checked as `delivery requeue` checks its
    options: `RequeueInputError` naming the parameter otherwise."""

    rule: str
    selection: requeue_service.Selection
    dry_run: bool
    by: str

    @classmethod
    def of(
        cls, rule: Any, statuses: Any, ids: Any, error_contains: Any, since: Any, dry_run: Any, by: Any, default_by: str
    ) -> Request:
        # None is what these parameters defaulted to before they had plain defaults: the same meaning.
        name: str = _checked("rule", _TEXT, rule)
        chosen: list[str] = [] if statuses is None else _checked("statuses", _TEXTS, statuses)
        only: list[str] = [] if ids is None else _checked("ids", _TEXTS, ids)
        text: str = "" if error_contains is None else _checked("error_contains", _TEXT, error_contains)
        try:
            when: datetime | None = None if since is None else _TIME.validate_python(since)
        except ValidationError:
            raise requeue_service.RequeueInputError(
                "since", f"{str(since)[:60]!r} is not a time; give one like 2025-06-01T08:00:00Z"
            ) from None
        flag: bool = _checked("dry_run", _FLAG, dry_run)
        who: str = ("" if by is None else _checked("by", _TEXT, by)) or default_by
        # An empty list of statuses means the default, as `delivery requeue` without --status does.
        selection = requeue_service.Selection.of(chosen, only, text or None, None if when == ANY_TIME else when)
        requeue_service.check_request(name, who)
        return cls(name, selection, flag, who)


# -- a requeue refused: one ERROR line, a Failed state ---------------------------------------------

#: The attribute that marks the fault a refused requeue's Failed state carries.
_REFUSED = "delivery_requeue_refused"


class _QuietRefusal(logging.Filter):
    """Leaves out Prefect's own reports of a refused requeue's fault. A flow run that ends Failed
    makes Prefect raise its fault once more as the run ends: a worker or `delivery serve` running the
    deployment then logs "Engine execution exited with unexpected exception" to the run, with a
    traceback. For a refusal the flow has said all there is to say in its one ERROR line; any other
    exception (a bug) is reported as Prefect reports it."""

    def filter(self, record: logging.LogRecord) -> bool:
        fault = record.exc_info[1] if record.exc_info else None
        return not getattr(fault, _REFUSED, False)


_QUIET = _QuietRefusal()
#: The loggers Prefect reports a run's final exception on: the run's own, and the engine's.
_PREFECT_LOGGERS = ("prefect.flow_runs", "prefect.engine")


def _remedy(fault: DeliveryError) -> str:
    if isinstance(fault, UnknownName):
        return (
            "check the rule's name (`delivery status` or the delivery-status artifact lists the rules), "
            "then run it again"
        )
    if isinstance(fault, SettingsError | DatabaseUrlError):
        return (
            "fix that variable where the flow runs (the worker's or `delivery serve`'s environment), then run it again"
        )
    if isinstance(fault, DatabaseUnavailable):
        return "run it again once the database takes connections"
    return "correct that parameter, then run it again"


def _refused(rule: str, fault: DeliveryError) -> State[Any]:
    """The run's end for a requeue that was not done: one ERROR line (the fault, that nothing was
    changed, what to do), and a Failed state named after the fault's class. The fault is the
    state's data, so a caller of the flow gets it raised, as from a flow that raised it."""
    text = " ".join(str(fault).split())
    get_run_logger().error("requeue of %s not done: %s. Nothing was changed; %s.", rule, text, _remedy(fault))
    setattr(fault, _REFUSED, True)
    _tag(f"fault:{type(fault).__name__}")
    for name in _PREFECT_LOGGERS:
        logging.getLogger(name).addFilter(_QUIET)  # the same filter once per logger
    # Plainly Failed (Prefect's state filter and a Failed automation match the name too), the
    # fault's class the message's first word and the tag `fault:CLASS`.
    return Failed(message=f"{type(fault).__name__}: {text}", data=fault)


def _shown(rule: Any) -> str:
    """A rule name as given, fit for a run's name and a log line (one line, printable, short)."""
    text = "".join(ch for ch in str(rule) if ch.isprintable())
    return " ".join(text.split())[:200] or "?"


def _label_run(rule: str, dry_run: bool, target: str | None) -> None:
    """Name the run `requeue RULE` (`... (dry run)`) and tag it `rule:RULE` and `target:TARGET`
    (no tag for a rule that does not exist), as a chain's run is named and tagged."""
    run_id = flow_run.get_id()
    if run_id is None:
        return
    added = {f"rule:{rule}", f"target:{target}"} if target is not None else set()
    tags = sorted({*flow_run.get_tags(), *added})
    with get_client(sync_client=True) as client:
        client.update_flow_run(UUID(run_id), name=run_name(rule, dry_run), tags=tags)


def _tag(tag: str) -> None:
    """Add `tag` to the running flow run's tags."""
    run_id = flow_run.get_id()
    if run_id is None:
        return
    with get_client(sync_client=True) as client:
        current = client.read_flow_run(UUID(run_id)).tags
        client.update_flow_run(UUID(run_id), tags=sorted({*current, tag}))


def _target_of(engine: sa.Engine, rule: str) -> str:
    with engine.connect().execution_options(readonly=True) as conn:
        return requeue_service.rule_target(conn, rule)


@flow(name="delivery-requeue", retries=0, log_prints=False, validate_parameters=False)
def delivery_requeue(
    rule: str,
    statuses: Sequence[RequeuableStatus] = ("exhausted", "remote_gone"),
    ids: Sequence[str] = (),
    error_contains: str = "",
    since: datetime = ANY_TIME,
    dry_run: bool = False,
    by: str = "",
) -> State[Any]:
    """Put parked records of a rule back into play: the rows selected become retries due now
    (attempts reset), and the rule's next chain sends them before any fresh change. A remote_gone
    row also loses its remote id, so the next chain creates the record again in the target. Run it
    with dry_run on first: the artifact requeue-dry-run-RULE lists what it would take.

    Args:
        rule: The rule whose records to put back, by name, e.g. contacts-to-crm (delivery status
            and the delivery-status artifact list the rules).
        statuses: Which rows to take: exhausted, remote_gone, failed. By default exhausted and
            remote_gone (the parked ones); an empty list means the same. Add failed to retry
            failed rows now rather than at their next attempt.
        ids: Only the records with these external ids. Empty: every record the other fields select.
        error_contains: Only rows whose last error contains this text, e.g. HTTP 422. Empty: any
            last error.
        since: Only rows parked (last changed) at or after this time, UTC when no zone is given.
            The default, 1970-01-01, takes them whenever they were parked.
        dry_run: On: only list what would be requeued (artifact requeue-dry-run-RULE), change
            nothing. Off: requeue them (artifact requeue-RULE) and refresh the parked-RULE artifact.
        by: Who asks, recorded with the requeue (delivery requeues lists it). Empty: this run,
            by its id.
    """
    logger = get_run_logger()
    try:
        settings()  # a bad DELIVERY_* value refuses the run here, naming the variable
        request = Request.of(
            rule, statuses, ids, error_contains, since, dry_run, by, f"delivery-requeue run {flow_run.get_id()}"
        )
        engine = shared_engine()
        target = _target_of(engine, request.rule)
    except requeue_service.RequeueInputError as exc:
        _label_run(_shown(rule), dry_run is True, None)
        return _refused(_shown(rule), InputError(f"{exc.parameter}: {exc}"))
    except DeliveryError as exc:
        _label_run(_shown(rule), dry_run is True, None)
        return _refused(_shown(rule), exc)
    _label_run(request.rule, request.dry_run, target)
    try:
        with engine.begin() as conn:
            rows = requeue_service.requeue(
                conn,
                request.rule,
                request.selection,
                request.by,
                dry_run=request.dry_run,
                flow_run_id=flow_run.get_id(),
            )
    except DeliveryError as exc:  # the rule deleted since it was looked up
        return _refused(request.rule, exc)
    _publish(request.rule, rows, request.selection, request.dry_run, request.by)
    if not request.dry_run:
        try:
            publish_parked_set_sync(engine, request.rule)
        except Exception as exc:  # the requeue is done and recorded: say so, and carry on
            logger.warning(
                "the %s artifact was not refreshed (%s: %s); the requeue itself is done",
                parked_artifact_key(request.rule),
                type(exc).__name__,
                " ".join(str(exc).split())[:300],
            )
    verb = "would requeue" if request.dry_run else "requeued"
    message = f"{verb} {len(rows)} record(s) of {request.rule}" + (
        "" if request.dry_run else f" (recorded as requested by {request.by})"
    )
    logger.info(message)
    return Completed(
        message=message,
        data={"rule": request.rule, "dry_run": request.dry_run, "count": len(rows), "records": _records(rows)},
    )
