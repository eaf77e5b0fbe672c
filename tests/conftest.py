"""Shared fixtures: a database per test on SQLite *and* PostgreSQL, the Prefect test harness, and a
real local HTTP target."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
# The harness's API server keeps its own SQLite database. Its task-run recorder, event persister
# and triggers contend with the API for that file's lock: measured here, a chain took 2-3 s
# instead of 0.6 s, with stalls of 65 s (upstream: PrefectHQ/prefect #18934, #19771). Flow runs,
# their states, logs and artifacts still go through the real API; only the event-fed task-run
# history is off in tests.
for _service in ("TASK_RUN_RECORDER", "EVENT_PERSISTER", "TRIGGERS"):
    os.environ.setdefault(f"PREFECT_SERVER_SERVICES_{_service}_ENABLED", "false")

import sqlalchemy as sa
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

from delivery import db
from delivery import senders as senders_module
from delivery.store.tables import metadata
from tests.prefect_server import TEMPLATE_ENV, copy_database
from tests.support.databases import create_postgres_database, drop_postgres_database
from tests.target_server import TargetServer

# Property-based tests (marked `fuzz`): a fixed budget for `make test`, a far larger one for
# `make fuzz` (HYPOTHESIS_PROFILE=fuzz). No deadline: an example's time is mostly the database's,
# which varies with the machine's load. The fixtures a fuzz test takes (a database, a directory)
# are set up once per test and shared by its examples on purpose: each example checks its own
# before and after.
_FUZZ_HEALTH = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
hypothesis_settings.register_profile(
    "ci", max_examples=300, deadline=None, suppress_health_check=_FUZZ_HEALTH, print_blob=True
)
hypothesis_settings.register_profile(
    "fuzz", max_examples=3000, deadline=None, suppress_health_check=_FUZZ_HEALTH, print_blob=True
)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


#: The test modules that take longest, slowest first (wall time on 2 cores, from `--durations`,
#: 7 December 2026): each xdist worker takes a whole module at a time, in this order (pytest runs
#: with `--no-loadscope-reorder`: xdist would otherwise hand out the modules with the most tests
#: first, and these, most of them one to four tests waiting on servers and schedules, last). A
#: long module started last leaves one worker running it alone while the others sit idle.
SLOWEST_FIRST = (
    "test_tick_alerts_scheduled",
    "test_kill_settles",
    "test_tick_missing_alert",
    "test_server_restart",
    "test_warm_worker",
    "test_server_restart_postgres",
    "test_unknown_outcomes_cli",
    "test_exclusivity",
    "test_serve_signals",
    "test_deletes_cli",
    "test_cli_run_idle",
    "test_requeue_and_secrets_on_a_server",
    "test_tick_server",
    "test_grouped_settles",
    "test_demo",
    "test_cli",
    "test_cli_fuzz",
    "test_two_workers",
    "test_lock_repair",
    "test_attempts_cli",
    "test_rate_budget",
    "test_cancel",
)


def pytest_configure(config: pytest.Config) -> None:
    # The process that starts the run (not an xdist worker) picks where the run's migrated Prefect
    # database will lie; its workers inherit the variable (tests/prefect_server.migrated_database).
    if not hasattr(config, "workerinput") and TEMPLATE_ENV not in os.environ:
        os.environ[TEMPLATE_ENV] = tempfile.mkdtemp(prefix="delivery-prefect-template-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop(TEMPLATE_ENV), ignore_errors=True))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def postgres_template() -> Iterator[str]:
    """One migrated PostgreSQL database for the session; each test empties it first."""
    name = f"delivery_test_{os.getpid()}"
    url = create_postgres_database(name)
    engine = db.create_engine(url)
    db.upgrade(engine)
    engine.dispose()
    yield url
    db.dispose_engines()
    drop_postgres_database(name)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Migrate once, copy per test: a fresh SQLite database costs a file copy."""
    path = tmp_path_factory.mktemp("template") / "delivery.db"
    engine = db.create_engine(f"sqlite:///{path}")
    db.upgrade(engine)
    engine.dispose()
    return path


def _truncate(url: str) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        names = ", ".join(t.name for t in metadata.sorted_tables)
        conn.exec_driver_sql(f"TRUNCATE {names} RESTART IDENTITY CASCADE")
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A migrated, empty database, and DELIVERY_DATABASE_URL pointing at it (flows read it)."""
    if request.param == "sqlite":
        path = tmp_path / "delivery.db"
        shutil.copy(request.getfixturevalue("sqlite_template"), path)
        url = f"sqlite:///{path}"
    else:
        url = request.getfixturevalue("postgres_template")
        _truncate(url)
    monkeypatch.setenv(db.DATABASE_URL_ENV, url)
    yield url
    db.dispose_engines()


@pytest.fixture
def engine(db_url: str) -> sa.Engine:
    return db.shared_engine(db_url)


@pytest.fixture(scope="session")
def _prefect_harness() -> Iterator[None]:
    """The real Prefect API on a test server, started once (it costs 15-20 s)."""
    import prefect.testing.utilities
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    # No flow-run heartbeats in this process: a sync flow's engine joins its heartbeat thread on
    # exit, and that thread sleeps in whole seconds, so every sync flow run (delivery-requeue) took
    # at least 1 s. Nothing here reads Prefect's heartbeats; the chains' own heartbeats are in the
    # database and untouched. `delivery` processes the tests start keep Prefect's default.
    with (
        temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}),
        pytest.MonkeyPatch.context() as patch,
    ):
        # The harness starts its server on a new database in a directory of its own: one migrated
        # already (the run's copy) spares each xdist worker 7 s of CPU. Prefect's own names: should
        # `mkdtemp` go from that module, setattr fails loudly; should the file's name change, the
        # harness migrates a new database itself, as before.
        patch.setattr(prefect.testing.utilities, "mkdtemp", _harness_directory)
        with prefect_test_harness(server_startup_timeout=120):
            yield


def _harness_directory() -> str:
    directory = tempfile.mkdtemp(prefix="prefect-harness-")
    copy_database(Path(directory) / "prefect-test.db")
    return directory


@pytest.fixture
def prefect_api(_prefect_harness: None) -> None:
    """The session's Prefect API, with no rule lock left from an earlier test.

    Every test delivers under the same rule names, so the same lock names, and the harness's API
    runs no lease repossessor: a slot held by a `delivery run` an earlier test killed stays taken
    for good, with nobody on the new test's record. A chain in the test's own process frees such
    a slot after a lease's lifetime; a `delivery run` process cannot tell the harness from a real
    server and waits for a repossession that never comes (seen in CI: a run waiting 300 s)."""
    from prefect import get_client

    from flows.lock import LOCK_PREFIX

    with get_client(sync_client=True) as client:
        names: list[str] = []
        while page := client.read_global_concurrency_limits(limit=200, offset=len(names)):
            names += [limit.name for limit in page]
        for name in names:
            if name.startswith(LOCK_PREFIX):
                client.delete_global_concurrency_limit_by_name(name)


#: The bearer token the shared target accepts and `CRM_TOKEN` holds.
TARGET_TOKEN = "s3cr3t-token-value"


@pytest.fixture(scope="session")
def _target_session() -> Iterator[TargetServer]:
    server = TargetServer(token=TARGET_TOKEN).start()
    yield server
    server.stop()


@pytest.fixture
def target(_target_session: TargetServer, monkeypatch: pytest.MonkeyPatch) -> TargetServer:
    """The real local HTTP target, emptied for this test; CRM_TOKEN holds its bearer token."""
    _target_session.reset()
    # The server is shared by every test of a worker: a test that changed the token it accepts
    # and did not put it back must not make another test's wrong token pass.
    _target_session.token = TARGET_TOKEN
    monkeypatch.setenv("CRM_TOKEN", TARGET_TOKEN)
    return _target_session


@pytest.fixture(params=["loop", "threads"])
def job_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which way the `rest` writer's grouped jobs send: from one event loop (`EventLoop`, what a
    writer with async verbs gets) or a thread per call in flight (`Threads`, what a writer with
    only sync verbs gets), the choice (`delivery.senders.choose`) told the writer has no async verbs."""
    if request.param == "threads":
        monkeypatch.setattr(senders_module, "offers_async", lambda _writer: False)
    return str(request.param)
