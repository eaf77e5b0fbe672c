"""The design's vocabulary as plain values: statuses, policies, verbs, cursors and outcomes; the
connections and rules a config declares (what the store saves) and the records a source hands
over (what the mirror loads, and the check that refuses what JSON cannot carry).

Nothing here imports SQLAlchemy, httpx or Prefect, so every other module (and the tests) can
reason about delivery without a database or a network.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple


class ConnectionStatus(enum.StrEnum):
    ACTIVE = "active"
    ERROR = "error"
    DISABLED = "disabled"


class SettleMode(enum.StrEnum):
    """How a chain commits the ledger writes of the records it delivers to a target.

    Either way each record gets its own ledger write with its own outcome. `grouped` commits them
    together, in groups of at most 50 records or 200 ms (`delivery.settle`), so a crash re-sends the
    few groups not committed yet: safe where the target honours the Idempotency-Key (a repeated create answers with the
    record it made) and an update repeats the same body. `per_record` commits each outcome as it
    comes (and each create's intent before its request): for a target that does not honour the key,
    where a re-sent create would make a second copy."""

    GROUPED = "grouped"
    PER_RECORD = "per_record"


class Forbidden(enum.StrEnum):
    """What an HTTP 403 from a target means. Most APIs answer 403 when the token may not do what
    was asked, which falls the same way for every record (`token`: a fault of the rule, like 401);
    some answer 403 to refuse one record (`record`: that record's fault, parked like any refusal)."""

    TOKEN = "token"
    RECORD = "record"


class Policy(enum.StrEnum):
    CREATE_AND_UPDATE = "create_and_update"
    CREATE_ONLY = "create_only"
    UPDATE_ONLY = "update_only"

    @property
    def verbs(self) -> frozenset[Verb]:
        """The verbs this policy lets the engine use; the writer must offer each of them."""
        return {
            Policy.CREATE_AND_UPDATE: frozenset({Verb.CREATE, Verb.UPDATE}),
            Policy.CREATE_ONLY: frozenset({Verb.CREATE}),
            Policy.UPDATE_ONLY: frozenset({Verb.UPDATE}),
        }[self]


class Verb(enum.StrEnum):
    CREATE = "create"
    UPDATE = "update"
    DELETE = "delete"


class DeletePolicy(enum.StrEnum):
    """What a rule does with a record deleted in the source: nothing (`ignore`: the target keeps
    its copy), or delete the copy this rule made (`propagate`: only where its ledger row holds a
    remote id; nothing the rule did not create is ever deleted)."""

    IGNORE = "ignore"
    PROPAGATE = "propagate"


#: How many deletes one chain may send unless its rule says otherwise (`max_deletes_per_chain`).
DEFAULT_MAX_DELETES_PER_CHAIN = 100


class LedgerStatus(enum.StrEnum):
    DELIVERED = "delivered"
    SUPPRESSED = "suppressed"
    FAILED = "failed"
    EXHAUSTED = "exhausted"
    REMOTE_GONE = "remote_gone"
    #: The target no longer holds the copy this rule made (the record was deleted in the source).
    DELETED = "deleted"

    @property
    def is_terminal(self) -> bool:
        """Exactly `exhausted` and `remote_gone`: neither drain nor scan offers them again,
        whatever the record's change signal does (ADR-0029)."""
        return self in (LedgerStatus.EXHAUSTED, LedgerStatus.REMOTE_GONE)


TERMINAL_STATUSES = frozenset(s for s in LedgerStatus if s.is_terminal)


class ChainEnd(enum.StrEnum):
    """How a chain ended. Route closed and breaker open are results, not faults: a later chain
    resumes once the connection comes back or the breaker cools down."""

    CAUGHT_UP = "caught_up"
    ROUTE_CLOSED = "route_closed"
    BREAKER_OPEN = "breaker_open"
    RULE_FAULT = "rule_fault"
    SUPERSEDED = "superseded"
    DISABLED = "disabled"
    #: Stopped by a person or by Prefect (cancellation, SIGTERM, Ctrl-C): neither a fault nor an alert.
    CANCELLED = "cancelled"
    #: The target's traffic control (its rate budget, a Retry-After pause) held the next request
    #: past the job's deadline: no fault; the next tick resumes.
    RATE_LIMITED = "rate_limited"


class Phase(enum.StrEnum):
    DRAIN = "drain"
    SCAN = "scan"


@dataclass(frozen=True, order=True)
class Cursor:
    """A position in the (changed_at, record id) order of a rule's mirror rows."""

    changed_at: datetime
    record_id: int

    def as_json(self) -> dict[str, Any]:
        return {"changed_at": self.changed_at.isoformat(), "record_id": self.record_id}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Cursor | None:
        if data is None:
            return None
        return cls(datetime.fromisoformat(data["changed_at"]), int(data["record_id"]))


@dataclass(frozen=True)
class BreakerSettings:
    fail_max: int = 5
    reset_seconds: float = 60.0


@dataclass(frozen=True)
class RateLimit:
    """A target's request budget, shared by every rule and worker sending to it: at most
    `per_second` requests a second (fractions allowed) and `per_day` a UTC day; None: no limit."""

    per_second: float | None = None
    per_day: int | None = None


@dataclass(frozen=True)
class BatchShape:
    """A batch call as a connection describes it (`batch.create`, `batch.update`): the method, the
    path and body templates (the body holds `{{ items }}`), each item's template, where the answer
    keeps its results (`results_at`), which key of a result names its item (`match`: a result
    carries the value its item had there; None: results in item order), and for a create where a
    result keeps the new id (`id_at`; None: the connection's `id_field`)."""

    method: str
    path: str
    body: Any = field(default=None, hash=False)
    item: Any = field(default="{{ fields }}", hash=False)
    results_at: str = "results"
    match: str | None = None
    id_at: str | None = None


@dataclass(frozen=True)
class BatchEndpoints:
    """A target's batch endpoints (paths under its base URL) and how many records one call may
    carry. A path left None: that verb is sent one record per call. A shape (`create_shape`,
    `update_shape`): that verb's call is described by templates, its path the shape's."""

    create_path: str | None = None
    update_path: str | None = None
    max_items: int = 100
    create_shape: BatchShape | None = None
    update_shape: BatchShape | None = None
    delete_path: str | None = None
    delete_shape: BatchShape | None = None

    def path(self, verb: Verb) -> str | None:
        """The batch path of `verb`, None where it is sent one record per call."""
        return {Verb.CREATE: self.create_path, Verb.UPDATE: self.update_path, Verb.DELETE: self.delete_path}[verb]

    def shape(self, verb: Verb) -> BatchShape | None:
        """The described batch call of `verb`, None where it is the built-in wire format."""
        return {Verb.CREATE: self.create_shape, Verb.UPDATE: self.update_shape, Verb.DELETE: self.delete_shape}[verb]


@dataclass(frozen=True)
class RequestShape:
    """One verb's request as a connection describes it (`requests.create`...): the method, the
    path and body templates (`delivery.templates`), and for a create where its answer gives the
    record's id (a dotted path; None: the connection's `id_field`)."""

    method: str
    path: str
    body: Any = field(default="{{ fields }}", hash=False)
    id_at: str | None = None


@dataclass(frozen=True)
class AuthSettings:
    """How requests to a target authenticate (`auth`): its kind (bearer, header, basic, oauth2)
    and its other keys as configured: where each secret comes from (`token_env`,
    `client_secret_secret`...), never a value, and `header`, `token_url`, `grant`, `scope`."""

    kind: str
    keys: tuple[tuple[str, str], ...] = ()

    def get(self, key: str) -> str | None:
        return dict(self.keys).get(key)

    def as_json(self) -> dict[str, str]:
        return {"kind": self.kind, **dict(self.keys)}


class Nulls(enum.StrEnum):
    """What a rule does with a mapped field whose value is null: send it (clearing the target's
    value) or skip it (the target keeps its value)."""

    SEND = "send"
    SKIP = "skip"


#: The longest a target's Retry-After pauses it, unless its connection says otherwise.
DEFAULT_MAX_PAUSE_SECONDS = 900.0


@dataclass(frozen=True)
class Connection:
    id: int
    name: str
    driver: str | None
    status: ConnectionStatus
    base_url: str | None = None
    token_env: str | None = None
    timeout_seconds: float = 10.0
    id_field: str = "id"
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    #: The name of a Prefect Secret block holding the bearer token (instead of `token_env`): the
    #: flows layer reads it when a chain starts, so the engine never needs Prefect.
    token_secret: str | None = None
    #: How chains delivering to this connection commit their ledger writes.
    settle: SettleMode = SettleMode.GROUPED
    #: What a 403 from this target means.
    forbidden: Forbidden = Forbidden.TOKEN
    #: As a target: its request budget (None: none).
    rate_limit: RateLimit | None = None
    #: As a target: the longest one Retry-After pauses every send to it.
    max_pause_seconds: float = DEFAULT_MAX_PAUSE_SECONDS
    #: As a target: its batch endpoints (None: one record per call).
    batch: BatchEndpoints | None = None
    #: As a target: headers sent with every request, as (name, value).
    headers: tuple[tuple[str, str], ...] = ()
    #: As a target: each verb's request where the connection describes it, as (verb, shape).
    requests: tuple[tuple[str, RequestShape], ...] = ()
    #: As a target: how its requests authenticate (None: the bearer token of `token_env` /
    #: `token_secret`, or none).
    auth: AuthSettings | None = None

    def request(self, verb: str) -> RequestShape | None:
        """The request the connection describes for `verb`, or None (the built-in one)."""
        return dict(self.requests).get(verb)


@dataclass(frozen=True)
class Rule:
    id: int
    name: str
    source: Connection
    domain: str
    target: Connection
    collection: str
    policy: Policy
    batch_size: int
    overlap_seconds: int
    max_attempts: int
    retry_schedule_seconds: tuple[int, ...]
    fields: dict[str, str] | None
    enabled: bool
    cursor: Cursor | None
    concurrency: int = 1
    #: Moved by every change of source or domain; part of the Idempotency-Key (see `decisions.idempotency_key`).
    key_epoch: int = 0
    nulls: Nulls = Nulls.SEND
    deletes: DeletePolicy = DeletePolicy.IGNORE
    max_deletes_per_chain: int = DEFAULT_MAX_DELETES_PER_CHAIN

    @property
    def verbs(self) -> frozenset[Verb]:
        """The verbs this rule may use: its policy's, and delete where it propagates deletes."""
        return rule_verbs(self.policy, self.deletes)


def rule_verbs(policy: Policy, deletes: DeletePolicy) -> frozenset[Verb]:
    """The verbs a rule with this policy and `deletes` needs its target's writer to offer."""
    return policy.verbs | ({Verb.DELETE} if deletes is DeletePolicy.PROPAGATE else frozenset())


@dataclass(frozen=True)
class ConnectionSpec:
    """A connection as a config file declares it, ready to be saved. `status` None: a new
    connection starts active, an existing one keeps the status an operator gave it."""

    name: str
    driver: str | None
    status: ConnectionStatus | None
    base_url: str | None
    token_env: str | None
    timeout_seconds: float
    id_field: str
    breaker: BreakerSettings
    token_secret: str | None = None
    settle: SettleMode = SettleMode.GROUPED
    forbidden: Forbidden = Forbidden.TOKEN
    rate_limit: RateLimit | None = None
    max_pause_seconds: float = DEFAULT_MAX_PAUSE_SECONDS
    batch: BatchEndpoints | None = None
    headers: tuple[tuple[str, str], ...] = ()
    requests: tuple[tuple[str, RequestShape], ...] = ()
    auth: AuthSettings | None = None


@dataclass(frozen=True)
class RuleSpec:
    """A rule as a config file declares it, ready to be saved: connections by name."""

    name: str
    source: str
    domain: str
    target: str
    collection: str
    policy: Policy
    batch_size: int
    overlap_seconds: int
    max_attempts: int
    retry_schedule_seconds: tuple[int, ...]
    fields: dict[str, str] | None
    enabled: bool
    concurrency: int
    nulls: Nulls = Nulls.SEND
    deletes: DeletePolicy = DeletePolicy.IGNORE
    max_deletes_per_chain: int = DEFAULT_MAX_DELETES_PER_CHAIN


class SavedRule(NamedTuple):
    """A rule already in the database, as much of it as the save-time checks read."""

    name: str
    target: str
    policy: Policy
    deletes: DeletePolicy = DeletePolicy.IGNORE


@dataclass(frozen=True)
class MirrorInput:
    """One record to load into the mirror, as a source hands it over."""

    external_id: str
    payload: dict[str, Any]
    deleted: bool = False


@dataclass(frozen=True)
class MirrorRecord:
    id: int
    source_id: int
    domain: str
    external_id: str
    payload: dict[str, Any]
    deleted: bool
    changed_at: datetime


@dataclass(frozen=True)
class LedgerRow:
    id: int
    rule_id: int
    record_id: int
    status: LedgerStatus
    remote_id: str | None
    attempts: int
    next_attempt_at: datetime | None
    last_error: str | None
    settled_changed_at: datetime | None
    delivered_digest: str | None
    create_generation: int
    version: int = 0
    create_digest: str | None = None
    #: A write may have reached the target without its answer being recorded: what the target
    #: holds is unknown (see `delivery.decisions.plan_write`).
    in_doubt: bool = False
    #: A delete of `remote_id` went out and its answer was not recorded: the target may no longer
    #: hold the record. Its next offer finishes the delete first (a live record is then created
    #: again under a new key).
    deleting: bool = False


@dataclass(frozen=True)
class Candidate:
    """One record a batch offers to the writer, with the ledger row the query saw for it (if any)."""

    record: MirrorRecord
    ledger: LedgerRow | None


@dataclass(frozen=True)
class Attempt:
    """One request a record's step made, as its history keeps it (`delivery attempts`): when,
    by which chain run, for which verb, the method and path (never a secret), the status code or
    the transport error, how long it took, and the start of the answer (secrets masked)."""

    at: datetime
    verb: str
    method: str
    path: str
    status_code: int | None
    error: str | None
    duration_ms: int
    answer_excerpt: str | None
    chain_run_id: str | None = None


@dataclass(frozen=True)
class Outcome:
    """What one attempt did to one record's ledger row."""

    status: LedgerStatus
    remote_id: str | None = None
    attempts: int = 0
    next_attempt_at: datetime | None = None
    last_error: str | None = None
    delivered_digest: str | None = None
    create_generation: int = 0
    #: What the target holds is unknown after this attempt (its answer was not seen, or an
    #: earlier write's never was).
    in_doubt: bool = False
    #: A delete of `remote_id` may have been applied (see `LedgerRow.deleting`).
    deleting: bool = False
    #: The row's Idempotency-Key moved on (`create_generation` is new): nothing was sent under it
    #: yet, so the first body sent under the old one is forgotten.
    key_renewed: bool = False
    #: The requests that led to it, oldest first, written with it to the record's history.
    tried: tuple[Attempt, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class LeftBehind:
    """A record a job parked (exhausted, remote_gone) or left failed, with its error and, for a
    failed one, when its next attempt is due."""

    external_id: str
    status: LedgerStatus
    error: str | None
    next_attempt_at: datetime | None = None
    #: Left failed without an attempt spent: held by the target's pause (or its outage proof).
    held: bool = False


@dataclass
class BatchReport:
    phase: Phase
    attempted: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    ended_by: ChainEnd | None = None
    message: str | None = None
    cursor_after: Cursor | None = None
    #: The records this job parked or left failed, each with why: an operator is told of each one.
    left_behind: list[LeftBehind] = field(default_factory=list)
    #: Seconds the job's workers spent waiting for the target's traffic (rate budget, pauses).
    waited_seconds: float = 0.0

    @property
    def empty(self) -> bool:
        return self.attempted == 0 and self.ended_by is None

    def ends_phase(self, batch_size: int) -> bool:
        """Whether no job of this phase follows this one: it ended the chain, or its page was the
        phase's last. The drain's set is fixed by the chain's start (every row it attempts gets a
        later time), so a short page is its last; the scan goes on until a page comes back empty."""
        if self.ended_by is not None or self.attempted == 0:
            return True
        return self.phase is Phase.DRAIN and self.attempted < batch_size


@dataclass
class ChainReport:
    rule: str
    token: str
    ended_by: ChainEnd = ChainEnd.CAUGHT_UP
    message: str = ""
    drained: Counter[str] = field(default_factory=Counter)
    scanned: Counter[str] = field(default_factory=Counter)
    cursor_before: Cursor | None = None
    cursor_after: Cursor | None = None
    batches: int = 0
    #: Seconds the chain's workers spent waiting for the target's traffic (rate budget, pauses).
    waited_seconds: float = 0.0

    @property
    def counts(self) -> Counter[str]:
        return self.drained + self.scanned

    def add(self, batch: BatchReport) -> None:
        self.batches += 1
        self.waited_seconds += batch.waited_seconds
        (self.drained if batch.phase is Phase.DRAIN else self.scanned).update(batch.counts)
        if batch.cursor_after is not None:
            self.cursor_after = batch.cursor_after
        if batch.ended_by is not None:
            self.ended_by = batch.ended_by
            self.message = batch.message or ""

    def as_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "ended_by": self.ended_by.value,
            "message": self.message,
            "counts": {s.value: self.counts.get(s.value, 0) for s in LedgerStatus},
            "drained": {s.value: self.drained.get(s.value, 0) for s in LedgerStatus},
            "scanned": {s.value: self.scanned.get(s.value, 0) for s in LedgerStatus},
            "cursor_before": self.cursor_before.as_json() if self.cursor_before else None,
            "cursor_after": self.cursor_after.as_json() if self.cursor_after else None,
            "waited_seconds": round(self.waited_seconds, 3),
        }
