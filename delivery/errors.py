"""Every fault the engine names, routed the way ADR-0029 routes it.

    DeliveryError
    ├── InputError                      bad input from a person: exit 2, nothing written
    │   ├── ConfigError                   the config file (names the path, e.g. rules[0].policy)
    │   ├── MirrorLoadError               a JSONL line (names the line number)
    │   └── UnknownName                   no connection/rule of that name
    ├── RuleFault                       stops the chain, writes nothing for the fault itself
    │   ├── MissingWriter                 no writer registered for the target's driver
    │   ├── UnsupportedDeliveryVerb       the writer's type lacks the verb the rule needs
    │   ├── LedgerRowConflict             a ledger row exists where the scan said there was none
    │   ├── UnexpectedCandidate           a mirror row the scan/drain should never have returned
    │   ├── MissingCredential             token_env names an unset variable, or token_secret a Prefect
    │   │                                 Secret block that is missing or empty (ours, beyond the six:
    │   │                                 every record would be refused alike)
    │   ├── UnusableCredential            the token is there but no HTTP header can carry it (a line
    │   │                                 break, a space, a character beyond ASCII)
    │   ├── Unauthorized                  the target refused the token: HTTP 401, or 403 unless the
    │   │                                 connection says a 403 refuses one record
    │   ├── TrafficControlFailed          the target's traffic control could not admit a request
    │   │                                 (nothing sent; the cause chained)
    │   └── TooManyDeletes                a batch would take the chain's deletes past the rule's
    │                                     `max_deletes_per_chain` (the batch sends nothing)
    └── RecordFault                     parks one record in its ledger row; the job carries on
        ├── TargetUnavailable             timeout, connection error, 5xx, 429: counts for the breaker;
        │   │                             `outcome_unknown` when the write may have been applied;
        │   │                             a 429/503 with Retry-After pauses the target instead
        │   └── AnswerSaysNothing         a 2xx batch answer without a usable result for an update
        │                                 item: in doubt, sent again (counts nothing for the breaker)
        ├── RecordRejected                any other 4xx about this record
        ├── RemoteGone                    an update answered 404/410 (a delete so answered is done)
        ├── Unaddressable                 a create answered 2xx with no usable id
        └── UnsendablePayload             the writer cannot encode this record's body (e.g. NaN):
                                          exhausted at once, a retry would meet it again

`TrafficHeld` stands apart: the target's traffic control (its rate budget, a pause) held a job's
next request past the job's deadline. It is no fault: the chain ends `rate_limited`.

Route closed and breaker open are not here on purpose: they are `ChainEnd` results, because the
step did what the situation called for and a later chain resumes by itself.
"""

from __future__ import annotations


class DeliveryError(Exception):
    """A delivery engine error."""


class InputError(DeliveryError):
    """Input was refused; nothing was written."""


class ConfigError(InputError):
    """The configuration was refused."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


class MirrorLoadError(InputError):
    """A mirror file line was refused; nothing was loaded."""

    def __init__(self, line: int, problem: str) -> None:
        self.line = line
        super().__init__(f"line {line}: {problem}")


class UnknownName(InputError):
    """No connection or rule has that name."""


class RuleFault(DeliveryError):
    """A fault that would fall the same way for every record of the rule: the chain ends."""

    #: What an operator does about it, in a few words: the chain's one ERROR line ends with it.
    remedy = "fix the cause, then run the rule again (`delivery run RULE`, or Retry on its run)"


class MissingWriter(RuleFault):
    remedy = "give the target a driver that has a writer (`delivery apply`), then run the rule again"

    def __init__(self, rule: str, driver: str | None) -> None:
        what = "the target has no driver" if driver is None else f"no writer is registered for target driver {driver!r}"
        super().__init__(f"rule {rule!r}: {what}")


class UnsupportedDeliveryVerb(RuleFault):
    remedy = "change the rule's policy or the target's driver to one that offers the verb (`delivery apply`)"

    def __init__(self, rule: str, driver: str | None, verb: str) -> None:
        super().__init__(
            f"rule {rule!r}: the writer for driver {driver!r} does not offer the {verb!r} verb the rule needs"
        )


class LedgerRowConflict(RuleFault):
    remedy = "an invariant of the ledger broke: report it with this run's id; the rule stops until it is fixed"

    def __init__(self, rule: str, external_id: str) -> None:
        super().__init__(f"rule {rule!r}: a ledger row for record {external_id!r} exists where the scan saw none")


class UnexpectedCandidate(RuleFault):
    remedy = "an invariant of the scan broke: report it with this run's id; the rule stops until it is fixed"

    def __init__(self, rule: str, external_id: str, why: str) -> None:
        super().__init__(f"rule {rule!r}: candidate record {external_id!r} should never have been offered: {why}")


class MissingCredential(RuleFault):
    remedy = "set the token where the message says (the variable or the Secret block), then Retry this run"

    def __init__(
        self,
        rule: str,
        connection: str,
        variable: str | None = None,
        *,
        block: str | None = None,
        why: str = "which does not exist or holds no value",
    ) -> None:
        # Names where the token should come from, never a value.
        where = f"the Prefect Secret block {block!r}, {why}" if block is not None else f"${variable}, which is not set"
        super().__init__(f"rule {rule!r}: target {connection!r} takes its token from {where}")


class UnusableCredential(RuleFault):
    remedy = "store the token without line breaks, spaces or non-ASCII characters, then run the rule again"

    def __init__(self, rule: str, connection: str, source: str, why: str) -> None:
        # Names where the token comes from and what is wrong with it, never the token.
        super().__init__(f"rule {rule!r}: target {connection!r} takes its token from {source}, {why}")


class Unauthorized(RuleFault):
    """The target refused the credentials: every record of the rule would be refused alike, so the
    chain ends and nothing is written for the record that met it (no attempt is spent)."""

    remedy = "check the token and its permissions at the target, then run the rule again (or Retry this run)"

    def __init__(self, connection: str, source: str | None, answer: str, rule: str | None = None) -> None:
        # Names the connection and where its token comes from, never the token.
        self.connection, self.source, self.answer, self.rule = connection, source, answer, rule
        token = f"its token from {source}" if source else "no token"
        prefix = f"rule {rule!r}: " if rule else ""
        super().__init__(
            f"{prefix}target {connection!r} refused the credentials ({answer}); it takes {token}: "
            "check the token and its permissions"
        )

    def for_rule(self, rule: str) -> Unauthorized:
        return Unauthorized(self.connection, self.source, self.answer, rule)


class TrafficControlFailed(RuleFault):
    """The target's traffic control could not admit a request (its row could not be read or
    written, a value it cannot compute with): nothing was sent, and every record would meet it
    alike. The cause is chained; the intents of the writes it held back are taken back."""

    def __init__(self, rule: str, target: str, cause: BaseException) -> None:
        super().__init__(
            f"rule {rule!r}: the traffic control of target {target!r} failed before a request was sent: "
            f"{type(cause).__name__}: {cause}"
        )


class TooManyDeletes(RuleFault):
    """A batch would take its chain's deletes past the rule's `max_deletes_per_chain`: a source
    that emptied a table by mistake must not empty the target. Raised as the batch is planned,
    before it sends anything; what earlier batches did stands."""

    remedy = (
        "check the source: if the deletes are meant, raise the rule's max_deletes_per_chain "
        "(`delivery apply`), then run the rule again"
    )

    def __init__(self, rule: str, count: int, limit: int) -> None:
        self.count = count
        self.limit = limit
        super().__init__(
            f"rule {rule!r}: this batch would bring the chain's deletes to {count}, past its "
            f"max_deletes_per_chain of {limit}; the batch sent nothing"
        )


class RecordFault(DeliveryError):
    """A fault of one record: written to its ledger row, and the job carries on."""


class TargetUnavailable(RecordFault):
    """The target did not take the write for a reason that passes (and that trips the breaker).

    `outcome_unknown`: the write may have been applied all the same (the request may have reached
    the target and no answer saying otherwise was read: a timeout or a connection lost after
    sending, a 500 or a gateway's 502/504). Unknown unless the writer knows better, since assuming
    "not applied" wrongly leaves the target stale for good, while the other mistake costs one
    write that changes nothing."""

    def __init__(
        self,
        message: str,
        retry_after_seconds: float | None = None,
        *,
        outcome_unknown: bool = True,
        status_code: int | None = None,
    ) -> None:
        self.retry_after_seconds = retry_after_seconds
        self.outcome_unknown = outcome_unknown
        self.status_code = status_code
        #: Set where one batch call failed as a whole: the same fault stands for each of its items.
        self.whole_call = False
        super().__init__(message)

    @property
    def pauses_target(self) -> bool:
        """A 429 or 503 with Retry-After: the target asks every sender to wait, not this record
        to fail. It pauses the target (`delivery.traffic`), spends no attempt and counts nothing
        for the breaker."""
        return self.status_code in (429, 503) and self.retry_after_seconds is not None


class AnswerSaysNothing(TargetUnavailable):
    """A success answer that says nothing readable about this item (a batch call answered 2xx
    without a usable result for it): the write may have been applied, or not. Never a refusal,
    which would let the next offer be suppressed as identical while the target holds the body
    it was never told about; the record stays in play, in doubt, and is sent again."""

    def __init__(self, message: str) -> None:
        super().__init__(message, outcome_unknown=True)


class RecordRejected(RecordFault):
    """The target refused this record's write (a 4xx other than gone)."""


class RemoteGone(RecordFault):
    """The record the ledger points at is not in the target any more."""


class Unaddressable(RecordFault):
    """The create went through but nothing addresses the result: a retry would make a second copy."""


class UnsendablePayload(RecordFault):
    """The writer cannot encode this record's body for the target (for JSON: NaN, Infinity, a value
    of no JSON type). No request went out; a retry would meet the same body again."""


class TrafficHeld(DeliveryError):
    """The target's traffic control holds the next request past the job's deadline: its rate budget
    or a pause. No fault of the rule or the record: the chain ends `rate_limited` (Completed), and
    the next tick's chain resumes."""

    def __init__(self, target: str, until: object, reason: str) -> None:
        self.target = target
        self.until = until
        self.reason = reason
        when = until.isoformat(timespec="seconds") if hasattr(until, "isoformat") else str(until)
        super().__init__(f"target {target!r} takes no request before {when}: {reason}")
