"""Every `DELIVERY_*` environment variable the engine reads, in one place, validated.

`settings()` reads the environment each time it is called, never from a cache: a test's
`monkeypatch.setenv` is seen by the next call, and a long-running process has nothing stale. A bad
value is refused with the variable's name (`SettingsError`, an `InputError`): the `delivery` CLI
checks them first and exits 2 before doing anything, and `deliver-rule` checks them before its
chain exists, so a bad value never becomes a fault of the rule inside a run.

The one variable read by a name that is not fixed, a connection's `token_env`, goes through
`secret()`: a token is read when a chain starts and is never stored.

Every `delivery` command reads the settings first, and pydantic-settings and SQLAlchemy's URL parser
would be most of what `delivery --help` costs (issue #33 point 6). So values of the plain forms an
operator writes (`15`, `2.5`, `sqlite:///PATH`, `postgresql://USER@HOST/DB`) are read without them,
and only another value goes through them, which take it or refuse it, naming it, as always;
tests/unit/test_settings.py checks that both ways give the same settings.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Annotated, Any

from delivery.errors import InputError

if TYPE_CHECKING:
    from pydantic import TypeAdapter
    from pydantic_settings import BaseSettings

ENV_PREFIX = "DELIVERY_"


def env_name(field: str) -> str:
    """The environment variable behind a field of `Settings`: `batch_timeout_seconds` is
    `DELIVERY_BATCH_TIMEOUT_SECONDS`."""
    return ENV_PREFIX + field.upper()


@dataclass(frozen=True)
class Bounds:
    """Where a number setting must lie: above `above` (or at least `at_least`), at most `at_most`,
    neither NaN nor infinity."""

    at_most: float
    above: float | None = None
    at_least: float | None = None

    def hold(self, value: float) -> bool:
        return (
            value <= self.at_most
            and (self.above is None or value > self.above)
            and (self.at_least is None or value >= self.at_least)
        )


# Bounded both ways: NaN and infinity would turn a timeout or a wait into never, a number too large
# overflows where Prefect and the clock take it, and a wait step or batch timeout under a second
# spins (Prefect's lock calls cannot answer that fast under load).
#: Minutes without a heartbeat before a chain counts as dead: above 0, at most a week.
DEAD_CHAIN_MINUTES = Bounds(above=0, at_most=7 * 24 * 60)
#: Seconds a job waits for the rule lock per step: 1 to 3,600.
WAIT_STEP_SECONDS = Bounds(at_least=1, at_most=3600)
#: Seconds a batch may run: 1 to a day.
BATCH_TIMEOUT_SECONDS = Bounds(at_least=1, at_most=86_400)
KEEP_DAYS = Bounds(above=0, at_most=3650)

#: Where the engine keeps its state when DELIVERY_DATABASE_URL is not set.
DEFAULT_DATABASE_URL = "sqlite:///delivery.db"


@dataclass(frozen=True)
class Settings:
    """The values of the variables; `settings()` makes them, checked."""

    #: Where the engine keeps its state; `delivery.db` gives `postgresql://` URLs the psycopg driver.
    #: Out of the repr: the URL may carry a password.
    database_url: str = field(default=DEFAULT_DATABASE_URL, repr=False)
    #: The tick judges a chain dead after this long without a heartbeat.
    dead_chain_minutes: float = 15.0
    #: How long a job waits for the rule lock before it looks for a dead holder to free it.
    lock_wait_step_seconds: float = 15.0
    #: A batch running longer fails the chain (a task timeout, no retry).
    batch_timeout_seconds: float = 600.0
    #: How long a record's history of requests is kept (`delivery attempts`); the tick prunes it.
    attempts_keep_days: float = 14.0


#: The bounds of each number field of `Settings`.
NUMBER_BOUNDS: dict[str, Bounds] = {
    "dead_chain_minutes": DEAD_CHAIN_MINUTES,
    "lock_wait_step_seconds": WAIT_STEP_SECONDS,
    "batch_timeout_seconds": BATCH_TIMEOUT_SECONDS,
    "attempts_keep_days": KEEP_DAYS,
}


def _bounded(bounds: Bounds, default: Any = ...) -> Any:
    """A pydantic field that checks `bounds`."""
    from pydantic import Field

    return Field(default, gt=bounds.above, ge=bounds.at_least, le=bounds.at_most, allow_inf_nan=False)


def settings_model() -> type[BaseSettings]:
    """The pydantic-settings model behind `Settings`: each variable's type, default and bounds, as
    the configuration reference (tools/docs_reference.py) lists them."""
    return _model()


@functools.cache
def _model() -> type[BaseSettings]:
    """The pydantic-settings model that reads and checks the variables, made on first use: pydantic
    would be most of what `delivery --help` costs (issue #33 point 6), and `settings()` needs it only
    for a value that is not of the plain forms."""
    from pydantic import AliasGenerator, field_validator
    from pydantic_settings import BaseSettings, SettingsConfigDict

    defaults = {f.name: f.default for f in fields(Settings)}

    class SettingsModel(BaseSettings):
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

        database_url: str = DEFAULT_DATABASE_URL
        dead_chain_minutes: float = _bounded(DEAD_CHAIN_MINUTES, defaults["dead_chain_minutes"])
        lock_wait_step_seconds: float = _bounded(WAIT_STEP_SECONDS, defaults["lock_wait_step_seconds"])
        batch_timeout_seconds: float = _bounded(BATCH_TIMEOUT_SECONDS, defaults["batch_timeout_seconds"])
        attempts_keep_days: float = _bounded(KEEP_DAYS, defaults["attempts_keep_days"])

        @field_validator("database_url")
        @classmethod
        def _a_database_we_run_on(cls, url: str) -> str:
            problem = database_url_problem(url)
            if problem is not None:
                raise ValueError(problem)
            return url

    return SettingsModel


#: The example every refused URL is answered with.
URL_FORMS = "sqlite:///PATH or postgresql://USER@HOST/DATABASE"


#: URLs of the common forms, in characters that SQLAlchemy's parser reads one way only: a SQLite
#: file, or a PostgreSQL user, password, host, port and database with no query. `database_url_problem`
#: passes them without SQLAlchemy (issue #33 point 6: every `delivery` command checks the settings,
#: and SQLAlchemy would be a third of `delivery --help`); anything else goes to SQLAlchemy's parser.
#: tests/unit/test_settings.py checks that SQLAlchemy takes every URL this matches.
PLAIN_DATABASE_URL = re.compile(
    r"sqlite:///[A-Za-z0-9_./~-]+"
    r"|postgres(?:ql)?(?:\+psycopg)?://(?:[A-Za-z0-9_.-]+(?::[A-Za-z0-9_.~%-]*)?@)?[A-Za-z0-9_.-]+(?::[0-9]{1,5})?"
    r"/[A-Za-z0-9_.-]+",
    re.ASCII,
)


def database_url_problem(url: str) -> str | None:
    """Why the engine cannot run on `url`, or None. Never repeats the URL: it may hold a password.
    The engine ships SQLite and psycopg 3 only, and its migrations know no other database."""
    return None if PLAIN_DATABASE_URL.fullmatch(url) else parsed_database_url_problem(url)


def parsed_database_url_problem(url: str) -> str | None:
    """`database_url_problem` as SQLAlchemy's parser reads `url`."""
    import sqlalchemy as sa

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


@functools.cache
def _dead_chain_minutes() -> TypeAdapter[float]:
    from pydantic import TypeAdapter

    adapter: TypeAdapter[float] = TypeAdapter(Annotated[float, _bounded(DEAD_CHAIN_MINUTES)])
    return adapter


def dead_chain_minutes(value: float, name: str) -> float:
    """`value` checked as `DELIVERY_DEAD_CHAIN_MINUTES` is (above 0, at most a week, neither NaN nor
    infinity), for the command-line option or the flow parameter that overrides it; `name` heads
    the message."""
    from pydantic import ValidationError

    try:
        return _dead_chain_minutes().validate_python(value)
    except ValidationError as exc:
        raise InputError(f"{name}: {exc.errors()[0]['msg']}") from None


#: A number as an operator writes one (`15`, `2.5`): read by `float` exactly as pydantic reads it.
PLAIN_NUMBER = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})?", re.ASCII)


def plain_settings(environ: Mapping[str, str]) -> Settings | None:
    """The settings when every variable set is of a plain form that is certainly good (a number
    such as `15` or `2.5` within its bounds, a database URL of `PLAIN_DATABASE_URL`), else None: the
    values pydantic would give, without importing it. Unset and empty variables take the defaults."""
    values: dict[str, Any] = {}
    for f in fields(Settings):
        raw = environ.get(env_name(f.name))
        if not raw:
            continue
        if f.name == "database_url":
            if not PLAIN_DATABASE_URL.fullmatch(raw):
                return None
            values[f.name] = raw
            continue
        if not PLAIN_NUMBER.fullmatch(raw) or not NUMBER_BOUNDS[f.name].hold(float(raw)):
            return None
        values[f.name] = float(raw)
    return Settings(**values)


def checked_settings() -> Settings:
    """The settings as pydantic-settings reads and checks the environment. Raises `SettingsError`
    naming every bad variable."""
    from pydantic import ValidationError

    try:
        model = _model()()
    except ValidationError as exc:
        # `from None`: the pydantic error repeats the values, which must not reach a traceback.
        raise SettingsError([_problem(error) for error in exc.errors()]) from None
    return Settings(**{f.name: getattr(model, f.name) for f in fields(Settings)})


def settings() -> Settings:
    """The settings as the environment holds them now. Raises `SettingsError` naming every bad
    variable. Values of the plain forms are read without pydantic (`plain_settings`), any other
    goes through pydantic-settings, which takes or refuses it."""
    return plain_settings(os.environ) or checked_settings()


def secret(name: str) -> str | None:
    """The value of the variable `name` (a connection's `token_env`), read now; unset or empty is None."""
    return os.environ.get(name) or None
