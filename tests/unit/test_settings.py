"""`delivery.settings`: every DELIVERY_* variable the engine reads, its default, its validation, and
that it is read when asked (a test's monkeypatch.setenv is seen by the next call)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delivery import db, liveness
from delivery.domain import Connection, ConnectionStatus
from delivery.errors import InputError
from delivery.settings import (
    PLAIN_DATABASE_URL,
    PLAIN_NUMBER,
    Settings,
    SettingsError,
    checked_settings,
    database_url_problem,
    dead_chain_minutes,
    env_name,
    parsed_database_url_problem,
    plain_settings,
    secret,
    settings,
)
from delivery.writers.base import token_for

VARIABLES = {
    "database_url": "DELIVERY_DATABASE_URL",
    "dead_chain_minutes": "DELIVERY_DEAD_CHAIN_MINUTES",
    "lock_wait_step_seconds": "DELIVERY_LOCK_WAIT_STEP_SECONDS",
    "batch_timeout_seconds": "DELIVERY_BATCH_TIMEOUT_SECONDS",
    "attempts_keep_days": "DELIVERY_ATTEMPTS_KEEP_DAYS",
}
NUMBERS = [field for field in VARIABLES if field != "database_url"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No DELIVERY_* variable of ours set (conftest's database URL included)."""
    for variable in VARIABLES.values():
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


def test_every_variable_has_its_name_of_today() -> None:
    assert {field.name: env_name(field.name) for field in dataclasses.fields(Settings)} == VARIABLES


def test_defaults(clean: pytest.MonkeyPatch) -> None:
    assert settings() == Settings(
        database_url="sqlite:///delivery.db",
        dead_chain_minutes=15.0,
        lock_wait_step_seconds=15.0,
        batch_timeout_seconds=600.0,
        attempts_keep_days=14.0,
    )
    assert db.database_url() == db.DEFAULT_URL == "sqlite:///delivery.db"
    assert liveness.dead_chain_after() == timedelta(minutes=15)


@pytest.mark.parametrize("field", NUMBERS)
def test_each_number_is_read_from_its_variable_at_call_time(clean: pytest.MonkeyPatch, field: str) -> None:
    clean.setenv(VARIABLES[field], "2.5")
    assert getattr(settings(), field) == 2.5
    clean.setenv(VARIABLES[field], "7")
    assert getattr(settings(), field) == 7.0  # no cache: the next call sees the change
    clean.setenv(VARIABLES[field], "")
    assert getattr(settings(), field) == getattr(Settings(), field)  # empty means unset, as before


def test_the_database_url_is_read_and_given_the_psycopg_driver(clean: pytest.MonkeyPatch) -> None:
    clean.setenv("DELIVERY_DATABASE_URL", "postgresql://u:pw@db.example/delivery")
    assert settings().database_url == "postgresql://u:pw@db.example/delivery"
    assert db.database_url() == "postgresql+psycopg://u:pw@db.example/delivery"
    assert "pw" not in repr(settings())  # a password stays out of anything that prints the settings


def test_the_dead_chain_threshold_follows_its_variable(clean: pytest.MonkeyPatch) -> None:
    clean.setenv("DELIVERY_DEAD_CHAIN_MINUTES", "2")
    assert liveness.dead_chain_after() == timedelta(minutes=2)
    assert liveness.dead_chain_after(5) == timedelta(minutes=5)  # the CLI's --dead-after-minutes wins


def test_only_the_upper_case_names_are_ours(clean: pytest.MonkeyPatch) -> None:
    clean.setenv("delivery_batch_timeout_seconds", "3")
    assert settings().batch_timeout_seconds == 600.0


@pytest.mark.parametrize("field", NUMBERS)
@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf"])
def test_a_bad_number_is_refused_naming_its_variable(clean: pytest.MonkeyPatch, field: str, value: str) -> None:
    clean.setenv(VARIABLES[field], value)
    with pytest.raises(SettingsError) as refused:
        settings()
    assert refused.value.problems == [f"{VARIABLES[field]}: {refused.value.problems[0].split(': ', 1)[1]}"]
    assert VARIABLES[field] in str(refused.value)


def test_every_bad_variable_is_named_at_once_and_no_value_is_repeated(clean: pytest.MonkeyPatch) -> None:
    clean.setenv("DELIVERY_BATCH_TIMEOUT_SECONDS", "abc-secretish")
    clean.setenv("DELIVERY_LOCK_WAIT_STEP_SECONDS", "-3")
    with pytest.raises(SettingsError) as refused:
        settings()
    assert sorted(problem.split(":")[0] for problem in refused.value.problems) == [
        "DELIVERY_BATCH_TIMEOUT_SECONDS",
        "DELIVERY_LOCK_WAIT_STEP_SECONDS",
    ]
    assert "abc-secretish" not in str(refused.value)
    assert refused.value.__cause__ is None and refused.value.__suppress_context__  # nor in a traceback


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("garbage-s3cret", "not a database URL (expected sqlite:///PATH or postgresql://USER@HOST/DATABASE)"),
        ("postgresql://u:s3cret@db:port/x", "not a database URL"),
        ("mysql://u:s3cret@db/x", "the engine runs on SQLite or PostgreSQL (psycopg), not 'mysql'"),
        ("postgresql+psycopg2://u:s3cret@db/x", "not 'postgresql+psycopg2'"),
        ("postgresql+asyncpg://u:s3cret@db/x", "not 'postgresql+asyncpg'"),
        # Before: taken, and `delivery apply` said "created" while nothing outlived the command.
        ("sqlite://", "an in-memory SQLite database lasts one process and keeps nothing"),
        ("sqlite:///:memory:", "an in-memory SQLite database"),
        ("sqlite:///file:s3cret?mode=memory&uri=true", "an in-memory SQLite database"),
        ("sqlite:///file::memory:?uri=true", "an in-memory SQLite database"),
    ],
    ids=["garbage", "bad-port", "mysql", "psycopg2", "asyncpg", "memory", "memory-name", "memory-uri", "memory-file"],
)
def test_a_database_url_the_engine_cannot_run_on_is_refused_without_repeating_it(
    clean: pytest.MonkeyPatch, url: str, problem: str
) -> None:
    clean.setenv("DELIVERY_DATABASE_URL", url)
    with pytest.raises(SettingsError) as refused:
        settings()
    [message] = refused.value.problems
    assert message.startswith("DELIVERY_DATABASE_URL: ") and problem in message
    assert "s3cret" not in message and "Value error" not in message


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///delivery.db",
        "sqlite+pysqlite:////tmp/x.db",
        "postgres://u@h/d",
        "postgresql+psycopg://h/d",
    ],
)
def test_the_database_urls_the_engine_runs_on_are_taken(clean: pytest.MonkeyPatch, url: str) -> None:
    clean.setenv("DELIVERY_DATABASE_URL", url)
    assert settings().database_url == url


#: Values of a number variable: the plain forms and their near misses (a sign, an exponent, spaces,
#: an underscore, NaN, a bound's neighbours, too many digits), which pydantic reads or refuses.
NUMBER_TEXTS = st.one_of(
    st.from_regex(PLAIN_NUMBER, fullmatch=True),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-10, 10**7).map(str),
    st.sampled_from(
        ["", " 15", "15 ", "1_000", "+5", "-0", "0.0", "1e3", "0x10", "nan", "inf", "1.", ".5", "\uff11\uff15"]
    ),
    st.sampled_from(["0", "1", "3600", "3601", "3650", "10080", "10081", "86400", "86401", "0.999999999"]),
    st.text(max_size=12),
)
URL_TEXTS = st.one_of(
    st.from_regex(PLAIN_DATABASE_URL, fullmatch=True),
    st.sampled_from(["", "sqlite://", "sqlite:///:memory:", "postgresql://u@h:port/d", "mysql://u@h/d"]),
    st.text(max_size=30),
)


@given(
    values=st.fixed_dictionaries(
        {},
        optional={
            variable: URL_TEXTS if field == "database_url" else NUMBER_TEXTS for field, variable in VARIABLES.items()
        },
    )
)
def test_the_plain_reading_gives_what_pydantic_gives_or_leaves_it_to_pydantic(values: dict[str, str]) -> None:
    """`settings()` reads values of the plain forms without pydantic (issue #33 point 6): whatever it
    reads so, pydantic-settings reads the same way."""
    environ = {key: value for key, value in os.environ.items() if key not in VARIABLES.values()}
    plain = plain_settings({**environ, **values})
    if plain is None:
        return
    with mock.patch.dict(os.environ, {**environ, **values}, clear=True):
        assert checked_settings() == plain


def test_the_plain_reading_takes_the_usual_values_and_leaves_the_rest() -> None:
    """What the plain reading takes and what it leaves to pydantic: the property above holds
    vacuously if it takes nothing."""
    usual = {"DELIVERY_DATABASE_URL": "sqlite:///x.db", "DELIVERY_DEAD_CHAIN_MINUTES": "30"}
    assert plain_settings(usual) == Settings(database_url="sqlite:///x.db", dead_chain_minutes=30.0)
    for value in ("0", "1e3", "nan", "10081", " 30"):
        assert plain_settings({"DELIVERY_DEAD_CHAIN_MINUTES": value}) is None, value
    assert plain_settings({"DELIVERY_DATABASE_URL": "sqlite:///:memory:"}) is None


@given(url=st.from_regex(PLAIN_DATABASE_URL, fullmatch=True))
def test_every_url_taken_without_sqlalchemy_is_one_sqlalchemy_takes(url: str) -> None:
    """The URLs of the plain forms pass the check without SQLAlchemy's parser (issue #33 point 6: it
    is a third of `delivery --help`); the parser must take each of them as well."""
    assert database_url_problem(url) is None
    assert parsed_database_url_problem(url) is None


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///delivery.db",
        "sqlite:////var/lib/delivery/delivery.db",
        "sqlite:///demo-run/delivery.db",
        "postgresql://delivery@localhost/delivery",
        "postgresql+psycopg://delivery:s3cret@db.example.com:5432/delivery",
        "postgres://u@h/d",
    ],
)
def test_the_common_urls_are_taken_without_sqlalchemy(url: str) -> None:
    assert PLAIN_DATABASE_URL.fullmatch(url)


@pytest.mark.parametrize(
    ("value", "problem"), [(0, "greater than 0"), (-1, "greater than 0"), (float("nan"), "finite")]
)
def test_dead_chain_minutes_checks_an_override_as_the_variable_is_checked(value: float, problem: str) -> None:
    with pytest.raises(InputError, match=f"^--dead-after-minutes: Input should be .*{problem}"):
        dead_chain_minutes(value, "--dead-after-minutes")
    with pytest.raises(InputError, match="finite"):
        dead_chain_minutes(float("inf"), "x")
    assert dead_chain_minutes(0.5, "--dead-after-minutes") == 0.5


def test_secret_reads_the_named_variable_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SOME_TARGET_TOKEN", "t-1")
    assert secret("SOME_TARGET_TOKEN") == "t-1"
    crm = Connection(1, "crm", "rest", ConnectionStatus.ACTIVE, token_env="SOME_TARGET_TOKEN")
    assert token_for(crm) == "t-1"
    monkeypatch.setenv("SOME_TARGET_TOKEN", "")
    assert secret("SOME_TARGET_TOKEN") is None and token_for(crm) is None
    monkeypatch.delenv("SOME_TARGET_TOKEN")
    assert secret("SOME_TARGET_TOKEN") is None


def test_importing_the_engine_changes_no_environment_variable() -> None:
    """Every module of delivery, flows and playground, imported in a fresh interpreter: the
    environment after is the environment before (the CLI sets Prefect's defaults in main())."""
    script = """
import importlib, os, pkgutil, sys
before = dict(os.environ)
changed = {}
for package in ("delivery", "flows", "playground"):
    root = importlib.import_module(package)
    for module in pkgutil.walk_packages(root.__path__, package + "."):
        importlib.import_module(module.name)
        now = dict(os.environ)
        if now != before:
            changed[module.name] = sorted(k for k in set(now) | set(before) if now.get(k) != before.get(k))
            before = now
print(changed)
sys.exit(1 if changed else 0)
"""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_SERVER_")}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"imports changed the environment: {proc.stdout}{proc.stderr}"
