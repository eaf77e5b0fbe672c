"""What a sandbox is told at start: where to listen, whom to let in, where to keep records and how
badly to behave. Validation lives here so `delivery sandbox`, the demo and `PUT /api/_faults`
refuse the same values with the same messages."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

__all__ = ["FaultSettings", "SandboxSettings"]


@dataclass
class SandboxSettings:
    """How to listen, whom to let in, where to keep records and how badly to behave.

    `fail_rate` of the POST/PATCH requests answer 503 without taking effect; `timeout_share` of
    those first sleep `hang_seconds` (longer than a client's timeout, so the client sees a timeout
    rather than a 503). `latency_ms` is added to every collection request. `seed` makes the fault
    sequence repeatable. `db_path` None keeps records in memory only.
    """

    host: str = "127.0.0.1"
    port: int = 8900
    token: str | None = None
    fail_rate: float = 0.0
    latency_ms: int = 0
    timeout_share: float = 0.0
    hang_seconds: float = 30.0
    db_path: str | None = None
    seed: int | None = None
    #: An OAuth2 client the sandbox takes (`POST /oauth/token`, the client-credentials grant): its
    #: access tokens are accepted like `token` until they expire, `token_lifetime_seconds` later.
    oauth2_client_id: str | None = None
    oauth2_client_secret: str | None = None
    token_lifetime_seconds: int = 1800

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field. Also run by `create_app`, because a
        dataclass can be changed after construction."""
        if not isinstance(self.host, str) or not self.host.strip():
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        port = _integer("port", self.port)
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be between 0 and 65535 (0 picks a free port), got {port}")
        if self.token is not None and (not isinstance(self.token, str) or not self.token.strip()):
            raise ValueError("token must be a non-empty string or None")
        if self.db_path is not None and (not isinstance(self.db_path, str) or not self.db_path.strip()):
            raise ValueError(f"db_path must be a non-empty path or None, got {self.db_path!r}")
        if self.seed is not None:
            _integer("seed", self.seed)
        if (self.oauth2_client_id is None) != (self.oauth2_client_secret is None):
            raise ValueError("oauth2_client_id and oauth2_client_secret: give both or neither")
        if not 1 <= _integer("token_lifetime_seconds", self.token_lifetime_seconds) <= 86_400:
            raise ValueError(f"token_lifetime_seconds must be 1..86400, got {self.token_lifetime_seconds}")
        self.faults()

    def faults(self) -> FaultSettings:
        """The part a running sandbox may change (`PUT /api/_faults`), as first configured."""
        return FaultSettings(self.fail_rate, self.latency_ms, self.timeout_share, self.hang_seconds)


@dataclass
class FaultSettings:
    """The part of the settings `PUT /api/_faults` may change at run time; validated on every
    construction so both the settings and the endpoint refuse the same values the same way."""

    fail_rate: float
    latency_ms: int
    timeout_share: float
    hang_seconds: float

    def __post_init__(self) -> None:
        for name in ("fail_rate", "timeout_share"):
            value = _number(name, getattr(self, name))
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {value}")
            setattr(self, name, value)
        # Bounded: asyncio.sleep overflows on a number this large, and no test wants a longer wait.
        if not 0 <= _integer("latency_ms", self.latency_ms) <= 600_000:
            raise ValueError(f"latency_ms must be between 0 and 600000 (10 minutes), got {self.latency_ms}")
        self.hang_seconds = _number("hang_seconds", self.hang_seconds)
        if self.hang_seconds < 0:
            raise ValueError(f"hang_seconds must be >= 0, got {self.hang_seconds}")

    def in_words(self) -> str:
        """What a person reads in the sandbox's log: `no faults`, or `20% of requests fail, 50 ms
        latency, 5% time out (hang 30 s)`."""
        said = []
        if self.fail_rate:
            said.append(f"{self.fail_rate:.0%} of requests fail")
        if self.latency_ms:
            said.append(f"{self.latency_ms} ms latency")
        if self.timeout_share:
            said.append(f"{self.timeout_share:.0%} time out (hang {self.hang_seconds:g} s)")
        return ", ".join(said) or "no faults"

    def changed(self, patch: object) -> FaultSettings:
        """A copy with the keys of a `PUT /api/_faults` body applied; unknown keys are refused so a
        typo (`failrate`) does not silently leave the outage off."""
        if not isinstance(patch, dict):
            raise ValueError('the body must be a JSON object such as {"fail_rate": 0.5}')
        unknown = sorted(set(patch) - set(asdict(self)))
        if unknown:
            raise ValueError(f"unknown fault settings {unknown}; known: {sorted(asdict(self))}")
        return replace(self, **patch)


def _integer(name: str, value: object) -> int:
    # bool is an int subclass; `latency_ms: true` is a mistake, not 1 ms.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)
