"""The `parked-RULE` artifact: what is parked now for one rule, whichever chain parked it.

A chain's `chain-RULE-records` artifact speaks of that chain alone; this one is the rule's standing
list. It is published under one key per rule, so its latest version is the current state: at the
end of every chain of the rule that left records behind or ran while the rule had a parked set
(`flows.chain_reporting`), and after every requeue (a dry run changes nothing, so it does not
publish it). A rule with nothing parked before or after a chain keeps the version it has, which
says so already, or none. It shows:

- how many rows are parked (`exhausted`, `remote_gone`) and how many are `failed` and waiting for
  their next attempt, by status;
- the same rows by reason (`error_reason`: the last error's first words, e.g. `HTTP 413 (Request
  Entity Too Large)`), counted over the `REASONS_COUNTED` rows changed last;
- the `delivery-requeue` deployment and the `delivery requeue` command that put them back;
- the `LISTED` rows changed last, most recent first, with their attempts, last change, next attempt
  and last error (redacted when it was written to the ledger).

A rule with nothing parked and no failed row says so in one sentence. Every read is an index seek
(`delivery.reports.parked_set`).
"""

from __future__ import annotations

import re
import shlex
from collections import Counter
from datetime import datetime
from http import HTTPStatus
from typing import Any

import sqlalchemy as sa
from prefect.artifacts import acreate_markdown_artifact, create_markdown_artifact

from delivery import reports
from delivery.clock import utcnow
from delivery.domain import LedgerStatus

#: How many rows the artifact lists (the totals always count them all).
LISTED = 200
#: How many rows, the latest changed, the reasons are counted over: a rule with more parked rows
#: than this says so, rather than read every one of them at the end of every chain.
REASONS_COUNTED = 10_000
#: Reasons listed one by one; the rarer ones are added up in one line.
REASONS_LISTED = 15
#: The longest reason kept, and how much of a last error a listed row shows.
REASON_LENGTH = 80
ERROR_EXCERPT = 200

#: What each status of the parked set means to the person reading the artifact.
MEANING = {
    LedgerStatus.EXHAUSTED.value: "parked: refused too often, or it cannot be sent or addressed",
    LedgerStatus.REMOTE_GONE.value: "parked: the record no longer exists in the target",
    LedgerStatus.FAILED.value: "waiting for its next attempt (the next chains retry it by themselves)",
}
#: The statuses a requeue takes when none is named (`delivery.store.requeue.DEFAULT_STATUSES`).
PARKED = (LedgerStatus.EXHAUSTED.value, LedgerStatus.REMOTE_GONE.value)

_GAVE_UP = re.compile(r"^gave up after \d+ attempts?: ")
#: The request a writer's error starts with: "POST contacts: ", "PATCH contacts/r-9: ".
_REQUEST = re.compile(r"^(?:GET|HEAD|POST|PUT|PATCH|DELETE|OPTIONS) \S+?: ")
_HTTP = re.compile(r"^HTTP (\d{3})$")
_PHRASES = {status.value: status.phrase for status in HTTPStatus}


def parked_artifact_key(rule: str) -> str:
    """`parked-RULE`, in the characters Prefect allows in an artifact key."""
    return "parked-" + (re.sub(r"[^a-z0-9-]+", "-", rule.lower()).strip("-") or "rule")


def error_reason(last_error: str | None) -> str:
    """The reason a parked or failed row is counted under: its last error's first line, without
    the "gave up after N attempts: " and "METHOD path: " openings, up to the first ": ". An HTTP
    status is followed by its standard phrase. So `gave up after 5 attempts: POST contacts: HTTP
    413: {"error": ...}` counts as `HTTP 413 (Request Entity Too Large)`, `PATCH contacts/r-9:
    timed out (ReadTimeout)` as `timed out (ReadTimeout)`, `POST contacts: connection error:
    [Errno 111] ...` as `connection error`. Two texts the engine writes itself stand apart: a
    requeued row waiting for its chain (`requeued, not sent yet`) and a create whose outcome was
    never recorded (`create sent, outcome not recorded yet`)."""
    text = (last_error or "").strip()
    if not text:
        return "no error recorded"
    if text.startswith("requeued by "):
        return "requeued, not sent yet"
    if text.startswith(reports.CREATE_IN_FLIGHT.split(" (")[0]):
        return "create sent, outcome not recorded yet"
    line = _REQUEST.sub("", _GAVE_UP.sub("", text.splitlines()[0]), count=1)
    reason = " ".join(line.split(": ", 1)[0].split())[:REASON_LENGTH] or "no error recorded"
    http = _HTTP.match(reason)
    if http and int(http.group(1)) in _PHRASES:  # a status that is not standard: the number alone
        reason += f" ({_PHRASES[int(http.group(1))]})"
    return reason


def _cell(value: Any, limit: int = ERROR_EXCERPT) -> str:
    """One markdown table cell: one line, `|` escaped, times in ISO to the second, "-" for nothing."""
    if value is None:
        return "-"
    text = value.isoformat(timespec="seconds") if isinstance(value, datetime) else str(value)
    text = " ".join(text.split())[:limit]
    return text.replace("\\", "\\\\").replace("|", "\\|") or "-"


def _records(n: int) -> str:
    return f"{n} record{'' if n == 1 else 's'}"


def _failed_rows(n: int) -> str:
    return f"{n} failed row{'' if n == 1 else 's'} waiting for {'its' if n == 1 else 'their'} next attempt"


def headline(rule: str, counts: dict[str, int]) -> str:
    """One sentence: what the rule has parked and waiting now."""
    parked = sum(counts.get(s, 0) for s in PARKED)
    failed = counts.get(LedgerStatus.FAILED.value, 0)
    if parked == 0 and failed == 0:
        return f"{rule}: nothing parked, no failed row waiting"
    if parked == 0:
        return f"{rule}: nothing parked; {_failed_rows(failed)}"
    split = ", ".join(f"{counts[s]} {s}" for s in PARKED if counts.get(s))
    return f"{rule}: {_records(parked)} parked ({split})" + (f"; {_failed_rows(failed)}" if failed else "")


def _reasons(errors: list[tuple[str, str | None]]) -> list[tuple[str, int]]:
    tally = Counter(error_reason(error) for _, error in errors)
    ranked = sorted(tally.items(), key=lambda item: (-item[1], item[0]))
    if len(ranked) <= REASONS_LISTED:
        return ranked
    rest = ranked[REASONS_LISTED - 1 :]
    return [*ranked[: REASONS_LISTED - 1], (f"{len(rest)} other reasons", sum(n for _, n in rest))]


def _put_back(rule: str, counts: dict[str, int]) -> list[str]:
    parked = any(counts.get(s) for s in PARKED)
    # Without --status a requeue takes exhausted and remote_gone; failed rows only when asked.
    statuses = [] if parked else ["--status", LedgerStatus.FAILED.value]
    command = ["delivery", "requeue", rule, *statuses]
    if not parked:
        which = "failed (to retry them now rather than at their next attempt)"
    elif counts.get(LedgerStatus.FAILED.value):
        which = "exhausted and remote_gone as they are by default (add failed to retry the failed rows now too)"
    else:
        which = "exhausted and remote_gone as they are by default"
    return [
        "**Put them back** once the cause is fixed: each becomes a retry due now, attempts reset.",
        "",
        f"- In the Prefect UI: **Deployments → delivery-requeue → Run → Custom run**, rule `{rule}`, "
        f"statuses {which}; run it with dry_run on first to see what it takes.",
        "- In a terminal:",
        "",
        "```bash",
        shlex.join([*command, "--dry-run"]),
        shlex.join(command),
        "```",
        "",
        "Take one reason only with `--error-contains TEXT` (error_contains in the form), e.g. "
        "`--error-contains 'HTTP 413'`, or some records with `--id EXTERNAL_ID` (ids).",
    ]


def parked_markdown(engine: sa.Engine, rule_name: str) -> tuple[str, str]:
    """The artifact's markdown and its one-line description, read from the database now."""
    with engine.connect().execution_options(readonly=True) as conn:
        parked = reports.parked_set(conn, rule_name, LISTED, REASONS_COUNTED)
    rule, counts, total, rows, errors = parked.rule, parked.counts, parked.total, parked.latest, parked.errors
    now = utcnow().isoformat(timespec="seconds")
    title = headline(rule.name, counts)
    refreshed = f"As of {now}; refreshed at the end of every chain of the rule and after every requeue."
    if total == 0:
        return f"**{title}.**\n\n{refreshed}", title
    lines = [
        f"**{title}.**",
        "",
        refreshed,
        "",
        "| status | records | what it means |",
        "| --- | --- | --- |",
        *(f"| {s} | {counts[s]} | {MEANING[s]} |" for s in counts if counts[s]),
        "",
        "**By reason** (the first words of the last error)"
        + (f", counted over the {len(errors):,} rows changed last:" if total > len(errors) else ":"),
        "",
        "| reason | records |",
        "| --- | --- |",
        *(f"| {_cell(reason)} | {n} |" for reason, n in _reasons(errors)),
        "",
        *_put_back(rule.name, counts),
        "",
        f"**The {len(rows)} changed last**, most recent first"
        + (
            f" (of {total:,}; `delivery ledger --rule {shlex.quote(rule.name)} --status STATUS` lists them all)"
            if total > len(rows)
            else ""
        )
        + ":",
        "",
        "| external id | status | attempts | last change | next attempt | last error |",
        "| --- | --- | --- | --- | --- | --- |",
        *(
            f"| {_cell(r['external_id'])} | {r['status']} | {r['attempts']} | {_cell(r['updated_at'])} "
            f"| {_cell(r['next_attempt_at'])} | {_cell(r['last_error'])} |"
            for r in rows
        ),
    ]
    return "\n".join(lines), title


def has_parked_set(engine: sa.Engine, rule_id: int) -> bool:
    """Whether the rule has any row in its parked set (parked or failed), on the index alone."""
    with engine.connect().execution_options(readonly=True) as conn:
        return reports.has_parked_set(conn, rule_id)


async def publish_parked_set(engine: sa.Engine, rule_name: str) -> None:
    """Publish the `parked-RULE` artifact: the rule's parked set as it stands now. For the end of
    a chain of the rule. Raises `UnknownName` for a rule that does not exist."""
    markdown, description = parked_markdown(engine, rule_name)
    await acreate_markdown_artifact(markdown=markdown, key=parked_artifact_key(rule_name), description=description)


def publish_parked_set_sync(engine: sa.Engine, rule_name: str) -> None:
    """`publish_parked_set` for a synchronous flow (the `delivery-requeue` flow, after a requeue)."""
    markdown, description = parked_markdown(engine, rule_name)
    create_markdown_artifact(markdown=markdown, key=parked_artifact_key(rule_name), description=description)
