"""The per-rule overview an operator starts from (`delivery status`): assembled here from the
store's answers and the decisions made elsewhere (the route in `decisions`, the breaker's reopening
in `breaker`), so the overview never disagrees with what a chain would do."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import sqlalchemy as sa

from delivery.decisions import closed_connection, scan_start
from delivery.domain import ChainEnd, Connection, LedgerStatus, Rule
from delivery.store import catalog, chains, ledger, status, traffic


def _route(rule: Rule) -> tuple[bool, str]:
    closed = closed_connection(rule)
    if closed is None:
        return True, "open"
    role, connection = closed
    return False, f"{role} {connection.name} is {connection.status.value}"


#: The state a `deliver-rule` run ends in, per chain end, as the Prefect UI's run list names it:
#: a Completed state named for the ending (flows/deliver_rule.py names its states from here), a
#: fault of the rule plain `Failed` (the fault's class is its `fault:CLASS` tag), a stop `Cancelled`.
RUN_STATE_NAMES: dict[ChainEnd, str] = {
    ChainEnd.CAUGHT_UP: "CaughtUp",
    ChainEnd.BREAKER_OPEN: "BreakerOpen",
    ChainEnd.ROUTE_CLOSED: "RouteClosed",
    ChainEnd.SUPERSEDED: "Superseded",
    ChainEnd.DISABLED: "Disabled",
    ChainEnd.RATE_LIMITED: "RateLimited",
    ChainEnd.RULE_FAULT: "Failed",
    ChainEnd.CANCELLED: "Cancelled",
}


def fault_of(ended_by: str | None, message: str | None) -> str | None:
    """The fault a chain ended by (`MissingWriter`, ...): the first word of its message, which a
    fault of the rule always starts with (`CLASS: text`); a batch out of time is `TimedOut`, as
    its run names it."""
    if ended_by != ChainEnd.RULE_FAULT or not message:
        return None
    head, colon, _ = message.partition(":")
    if not colon or not head.isidentifier():
        return None
    return "TimedOut" if head == "TimeoutError" else head


def _last_chain(conn: sa.Connection, rule: Rule) -> dict[str, Any] | None:
    last = chains.last_chain(conn, rule.id)
    if last is None:
        return None
    ended_by: str | None = last.ended_by if last.ended_at else None
    state_name = RUN_STATE_NAMES[ChainEnd(ended_by)] if ended_by in {end.value for end in ChainEnd} else None
    return {
        "started_at": last.started_at.isoformat(),
        "ended_at": last.ended_at.isoformat() if last.ended_at else None,
        "ended_by": last.ended_by,
        "message": last.message,
        "flow_run_id": last.flow_run_id,
        # The state its run ended in (None while it runs), and the fault of a Failed one.
        "state_name": state_name,
        "fault": fault_of(ended_by, last.message),
    }


def overview(conn: sa.Connection, now: datetime) -> list[dict[str, Any]]:
    # Imported here, as in `connection_overview`: pybreaker brings redis, which `delivery run` and
    # the other commands that import this module through `listings` never need (issue #33 point 6).
    from delivery import breaker

    result = []
    rules = catalog.list_rules(conn)
    budgets = traffic.traffic_of(conn, {rule.target.id for rule in rules})
    for rule in rules:
        route_open, route_why = _route(rule)
        oldest = status.oldest_undelivered(conn, rule, scan_start(rule))
        lag = round((now - oldest).total_seconds(), 1) if oldest else 0.0
        last = _last_chain(conn, rule)
        result.append(
            {
                "rule": rule.name,
                "enabled": rule.enabled,
                "route_open": route_open,
                "route": route_why,
                "breaker": breaker.state_in_words(conn, rule.target, now),
                "traffic": traffic_text(rule.target, budgets.get(rule.target.id), now),
                "cursor": rule.cursor.as_json() if rule.cursor else None,
                "cursor_lag_seconds": lag,
                "counts": ledger.counts_by_status(conn, rule.id),
                "due_retries": status.due_retries(conn, rule.id, now),
                "last_chain": last,
                # What the status table and artifact show first: how the last chain ended, since when.
                "last_ending": last_ending(last),
                "last_since": last_since(last),
                "cursor_lag": plain_duration(lag),
            }
        )
    return result


def paused_until(row: traffic.TrafficRow | None, now: datetime) -> datetime | None:
    """When the target's pause ends, if it is paused now."""
    return row.paused_until if row is not None and row.paused_until and row.paused_until > now else None


def sent_today(row: traffic.TrafficRow | None, now: datetime) -> int:
    return row.day_count if row is not None and row.day == now.date().isoformat() else 0


def traffic_text(target: Connection, row: traffic.TrafficRow | None, now: datetime) -> str:
    """A target's traffic in words: its budget (`20/s, 100000/day (12 today)`, `no limit`), and
    a pause a Retry-After asked for while it lasts."""
    limit = target.rate_limit
    parts = []
    if limit is not None and limit.per_second is not None:
        parts.append(f"{limit.per_second:g}/s")
    if limit is not None and limit.per_day is not None:
        parts.append(f"{limit.per_day}/day ({sent_today(row, now)} today)")
    text = ", ".join(parts) or "no limit"
    until = paused_until(row, now)
    if until is not None and row is not None:
        text += f"; paused until {plain_time(until.isoformat())} ({row.pause_reason or 'Retry-After'})"
    return text


def connection_overview(conn: sa.Connection, now: datetime) -> list[dict[str, Any]]:
    """Every connection with its status, and as a target its breaker and traffic
    (`delivery connection-status NAME`, `delivery connections`)."""
    from delivery import breaker

    connections = catalog.list_connections(conn)
    budgets = traffic.traffic_of(conn, {c.id for c in connections})
    result = []
    for c in connections:
        row = budgets.get(c.id)
        until = paused_until(row, now)
        limit = c.rate_limit
        result.append(
            {
                "name": c.name,
                "driver": c.driver,
                "status": c.status.value,
                "breaker": breaker.state_in_words(conn, c, now),
                "rate_limit": None if limit is None else {"per_second": limit.per_second, "per_day": limit.per_day},
                "sent_today": sent_today(row, now),
                "paused_until": until.isoformat() if until else None,
                "pause_reason": row.pause_reason if until is not None and row is not None else None,
                "resumed_by_hand_at": row.resumed_at.isoformat() if row is not None and row.resumed_at else None,
                "max_pause_seconds": c.max_pause_seconds,
                "traffic": traffic_text(c, row, now),
                "base_url": masked_url(c.base_url),
                "auth": auth_view(c),
                "auth_text": auth_text(c),
            }
        )
    return result


def last_ending(last: dict[str, Any] | None) -> str:
    """How the rule's last chain ended, as its run's state is named in the Prefect UI:
    `CaughtUp`, `BreakerOpen`, `Failed: MissingWriter`, ...; `running` while it runs, `never ran`."""
    if last is None:
        return "never ran"
    if last["ended_at"] is None:
        return "running"
    name = str(last.get("state_name") or last["ended_by"])
    return f"{name}: {last['fault']}" if last.get("fault") else name


def last_since(last: dict[str, Any] | None) -> str | None:
    """Since when the last ending holds: when the chain ended, or when it started if it runs."""
    if last is None:
        return None
    return str(last["ended_at"] or last["started_at"])


def plain_time(iso: str | None) -> str:
    """An ISO time as a person reads it: `2026-12-05 12:08:21 UTC`."""
    if iso is None:
        return "-"
    moment = datetime.fromisoformat(iso).astimezone(UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _unit(n: int, unit: str) -> str:
    return f"{n} {unit}" if n == 1 else f"{n} {unit}s"


def plain_duration(seconds: float) -> str:
    """A lag in words: `none`, `under a second`, `45 seconds`, `12 minutes`, `3 hours 5 minutes`,
    `2 days 4 hours`."""
    if seconds <= 0:
        return "none"
    if seconds < 1:
        return "under a second"
    whole = int(seconds)
    if whole < 60:
        return _unit(whole, "second")
    if whole < 3600:
        return _unit(whole // 60, "minute")
    if whole < 86400:
        hours, minutes = divmod(whole // 60, 60)
        return _unit(hours, "hour") + (f" {_unit(minutes, 'minute')}" if minutes else "")
    days, hours = divmod(whole // 3600, 24)
    return _unit(days, "day") + (f" {_unit(hours, 'hour')}" if hours else "")


def rule_label(row: dict[str, Any]) -> str:
    return str(row["rule"]) + ("" if row["enabled"] else " (disabled)")


def standing(row: dict[str, Any]) -> dict[str, str]:
    """The columns that lead both the `delivery status` table and the `delivery-status` artifact:
    the rule, how its last chain ended and since when, its route, breaker, traffic and lag."""
    return {
        "rule": rule_label(row),
        "last chain": row["last_ending"],
        "since": plain_time(row["last_since"]),
        "route": row["route"],
        "breaker": row["breaker"],
        "traffic": row["traffic"],
        "lag": row["cursor_lag"],
    }


def last_message(row: dict[str, Any]) -> str:
    """The last chain's message, the last column of both tables."""
    return str((row["last_chain"] or {}).get("message") or "-")


#: How much of the last chain's message the artifact's table shows: the whole table then fits a
#: 1280-pixel screen beside Prefect's side panels; the whole message is the chain run's state message.
TABLE_MESSAGE_CHARS = 48


def status_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The overview as the `delivery-status` table artifact shows it, one row per rule, every cell
    plain words or a number: the `standing` columns, then the ledger's counts in one column (the
    statuses it has: a table one column per status no longer fits a 1280-pixel screen), the
    retries due, and the start of the last chain's message."""
    return [
        {
            **standing(r),
            "records": counts_text(r["counts"]),
            "due retries": r["due_retries"],
            "message": shortened(_without_what_the_row_says(r), TABLE_MESSAGE_CHARS),
        }
        for r in rows
    ]


def _without_what_the_row_says(row: dict[str, Any]) -> str:
    """The last chain's message less what the row's first columns already say (the fault's name,
    `rule 'NAME': `), so that the start the table has room for is the part worth reading."""
    message = last_message(row)
    if (row["last_chain"] or {}).get("fault"):
        message = message.partition(": ")[2] or message  # `CLASS: text`; the class is the `last chain` cell
    return message.removeprefix(f"rule {row['rule']!r}: ")


def shortened(text: str, chars: int) -> str:
    """`text` cut to at most `chars` characters at a word, with an ellipsis when cut."""
    if len(text) <= chars:
        return text
    cut = text[: chars - 1].rsplit(" ", 1)[0] if " " in text[: chars - 1] else text[: chars - 1]
    return cut.rstrip(" ,;:") + "…"


def counts_text(counts: dict[str, int]) -> str:
    """A rule's ledger counts in words, the statuses it has in the ledger's order (`18 delivered,
    2 exhausted`); `none` for a rule with no row yet."""
    said = [f"{counts[s.value]} {s.value.replace('_', ' ')}" for s in LedgerStatus if counts.get(s.value)]
    return ", ".join(said) or "none"


def auth_view(connection: Connection) -> dict[str, str] | None:
    """How the connection's requests authenticate, as configured: the kind and where each secret
    comes from, never a value (`auth`, or the bearer token of `token_env` / `token_secret`)."""
    if connection.auth is not None:
        return connection.auth.as_json()
    if connection.token_env:
        return {"kind": "bearer", "token_env": connection.token_env}
    if connection.token_secret:
        return {"kind": "bearer", "token_secret": connection.token_secret}
    return None


def auth_text(connection: Connection) -> str:
    """`auth_view` in a few words: `oauth2 (env HS_CLIENT_ID, env HS_CLIENT_SECRET, ...)`."""
    view = auth_view(connection)
    if view is None:
        return "-"
    sources = [
        f"{'env' if key.endswith('_env') else 'secret'} {value}"
        for key, value in view.items()
        if key.endswith(("_env", "_secret"))
    ]
    return f"{view['kind']} ({', '.join(sources)})" if sources else view["kind"]


def masked_url(url: str | None) -> str | None:
    """A base URL as shown: a password in it (`user:pw@`) masked."""
    if not url or "@" not in url:
        return url
    parsed = urlsplit(url)
    if parsed.password is None:
        return url
    netloc = parsed.netloc.replace(f":{parsed.password}@", ":***@", 1)
    return urlunsplit(parsed._replace(netloc=netloc))
