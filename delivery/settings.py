"""Every `DELIVERY_*` environment variable the engine reads, in one place, validated.

`settings()` reads the environment each time it is called, never from a cache: a test's
`monkeypatch.setenv` is seen by the next call, and a long-running process has nothing stale. A bad
value is refused with the variable's name (`SettingsError`, an `InputError`): the `delivery` CLI
checks them first and exits 2 before doing anything, and `deliver-rule` checks them before its
chain exists, so a bad value never becomes a fault of the rule inside a run.

The one variable read by a name that is not fixed, a connection's `token_env`, goes through
`secret()`: a token is read when a chain starts and is never stored.
"""

from __future__ import annotations

import os
from typing import Annotated, Any

import sqlalchemy as sa
from pydantic import AliasGenerator, Field, TypeAdapter, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from delivery.errors import InputError

ENV_PREFIX = "DELIVERY_"


def env_name(field: str) -> str:
    """The environment variable behind a field of `Settings`: `batch_timeout_seconds` is
    `DELIVERY_BATCH_TIMEOUT_SECONDS`."""
    return ENV_PREFIX + field.upper()


# Bounded both ways: NaN and infinity would turn a timeout or a wait into never, a number too large
# overflows where Prefect and the clock take it, and a wait step or batch timeout under a second
# spins (Prefect's lock calls cannot answer that fast under load).
#: Minutes without a heartbeat before a chain counts as dead: above 0, at most a week.
DeadChainMinutes = Annotated[float, Field(gt=0, le=7 * 24 * 60, allow_inf_nan=False)]
#: Seconds a job waits for the rule lock per step: 1 to 3,600.
WaitStepSeconds = Annotated[float, Field(ge=1, le=3600, allow_inf_nan=False)]
#: Seconds a batch may run: 1 to a day.
BatchTimeoutSeconds = Annotated[float, Field(ge=1, le=86_400, allow_inf_nan=False)]
KeepDays = Annotated[float, Field(gt=0, le=3650, allow_inf_nan=False)]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        # Only the upper-case names: `delivery_database_url` is someone else's variable, not ours.
        case_sensitive=True,
        # Each field's alias is its full variable name (env_prefix alone would not be upper case
        # once case-sensitive); it also makes a validation error name the variable.
        alias_generator=AliasGenerator(validation_alias=env_name),
        populate_by_name=True,
        # A variable set to "" means unset: `DELIVERY_X= delivery ...` is how a shell clears one.
        env_ignore_empty=True,
        frozen=True,
    )

    #: Where the engine keeps its state; `delivery.db` gives `postgresql://` URLs the psycopg driver.
    #: Out of the repr: the URL may carry a password.
    database_url: str = Field("sqlite:///delivery.db", repr=False)
    #: The tick judges a chain dead after this long without a heartbeat.
    dead_chain_minutes: DeadChainMinutes = 15.0
    #: How long a job waits for the rule lock before it looks for a dead holder to free it.
    lock_wait_step_seconds: WaitStepSeconds = 15.0
    #: A batch running longer fails the chain (a task timeout, no retry).
    batch_timeout_seconds: BatchTimeoutSeconds = 600.0
    #: How long a record's history of requests is kept (`delivery attempts`); the tick prunes it.
    attempts_keep_days: KeepDays = 14.0

    @field_validator("database_url")
    @classmethod
    def _a_database_we_run_on(cls, url: str) -> str:
        problem = database_url_problem(url)
        if problem is not None:
            raise ValueError(problem)
        return url


#: The example every refused URL is answered with.
URL_FORMS = "sqlite:///PATH or postgresql://USER@HOST/DATABASE"


def database_url_problem(url: str) -> str | None:
    """Why the engine cannot run on `url`, or None. Never repeats the URL: it may hold a password.
    The engine ships SQLite and psycopg 3 only, and its migrations know no other database."""
    try:
        parsed = sa.make_url(url)
    except (sa.exc.ArgumentError, ValueError):
        return f"not a database URL (expected {URL_FORMS})"
    backend, driver = parsed.get_backend_name(), parsed.drivername.partition("+")[2]
    if backend == "sqlite" and driver in ("", "pysqlite"):
        if not parsed.database or ":memory:" in parsed.database or parsed.query.get("mode") == "memory":
            # Every command and every flow run is a process of its own: nothing would be kept.
            return f"an in-memory SQLite database lasts one process and keeps nothing (expected {URL_FORMS})"
        return None
    if backend in ("postgresql", "postgres") and driver in ("", "psycopg"):
        return None
    return f"the engine runs on SQLite or PostgreSQL (psycopg), not {parsed.drivername!r} (expected {URL_FORMS})"


class SettingsError(InputError):
    """An environment variable holds a value the engine cannot use; each problem names it."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


def _problem(error: Any) -> str:
    # The value is left out: a database URL may carry a password.
    where = error["loc"][0] if error["loc"] else "DELIVERY_*"
    return f"{where}: {error['msg'].removeprefix('Value error, ')}"


_DEAD_CHAIN_MINUTES: TypeAdapter[float] = TypeAdapter(DeadChainMinutes)


def dead_chain_minutes(value: float, name: str) -> float:
    """`value` checked as `DELIVERY_DEAD_CHAIN_MINUTES` is (above 0, at most a week, neither NaN nor
    infinity), for the command-line option or the flow parameter that overrides it; `name` heads
    the message."""
    try:
        return _DEAD_CHAIN_MINUTES.validate_python(value)
    except ValidationError as exc:
        raise InputError(f"{name}: {exc.errors()[0]['msg']}") from None


def settings() -> Settings:
    """The settings as the environment holds them now. Raises `SettingsError` naming every bad
    variable."""
    try:
        return Settings()
    except ValidationError as exc:
        # `from None`: the pydantic error repeats the values, which must not reach a traceback.
        raise SettingsError([_problem(error) for error in exc.errors()]) from None


def secret(name: str) -> str | None:
    """The value of the variable `name` (a connection's `token_env`), read now; unset or empty is None."""
    return os.environ.get(name) or None
