"""A target's token from a Prefect Secret block (`token_secret`), through the real deliver-rule flow
on the Prefect test harness, on SQLite and PostgreSQL: the real local target checks the bearer token;
the block is read at every chain start (changed in Prefect, used by the next chain); a missing block
fails the chain `MissingCredential` naming the block; the value never reaches the ledger, the chain
row, the run's state or its logs. The same against a real `prefect server start`, through a served
deployment: tests/acceptance/test_requeue_and_secrets_on_a_server.py."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any
from uuid import UUID

import pytest
import sqlalchemy as sa
from prefect.blocks.system import Secret

from delivery.chain import Chain
from delivery.config import parse_config
from delivery.domain import Connection, ConnectionStatus
from delivery.errors import ConfigError, MissingCredential
from delivery.store import catalog
from delivery.store.tables import chains_table, ledger_table
from delivery.writers.base import token_for
from tests.integration.world import RULE, World
from tests.support.databases import unique
from tests.target_server import Answer, TargetServer

FIRST = "first-token-from-a-block"
SECOND = "second-token-from-a-block"


def save_block(name: str, value: str) -> None:
    Secret(value=value).save(name, overwrite=True)


def delete_block(name: str) -> None:
    from prefect import get_client

    async def delete() -> None:
        async with get_client() as client:
            block = await client.read_block_document_by_name(name, block_type_slug="secret")
            await client.delete_block_document(block.id)

    asyncio.run(delete())


def run_logs(flow_run_id: str) -> str:
    """The run's log as the API holds it, once its last line ("Finished in state") has arrived: the
    log handler sends lines in the background."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async def read() -> list[Any]:
        async with get_client() as client:
            return list(await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(flow_run_id)]))))

    deadline = time.monotonic() + 20
    while True:
        text = "\n".join(log.message for log in asyncio.run(read()))
        if "Finished in state" in text or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def run_state(flow_run_id: str) -> Any:
    from prefect import get_client

    async def read() -> Any:
        async with get_client() as client:
            return (await client.read_flow_run(UUID(flow_run_id))).state

    return asyncio.run(read())


def everything_written(engine: sa.Engine) -> str:
    """Every ledger and chain row as text: where a leaked token would land."""
    with engine.connect() as conn:
        rows = [*conn.execute(sa.select(ledger_table)), *conn.execute(sa.select(chains_table))]
    return "\n".join(repr(tuple(row)) for row in rows)


@pytest.fixture
def block() -> Iterator[str]:
    name = unique("crm-token")
    yield name
    with contextlib.suppress(Exception):  # already deleted by the test, or never made
        delete_block(name)


@pytest.fixture
def world(
    prefect_api: None, engine: sa.Engine, target: TargetServer, block: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[World]:
    """The rule's target takes its token from the Secret block `block`; no token in the environment."""
    monkeypatch.delenv("CRM_TOKEN", raising=False)
    original = target.token
    target.token = FIRST
    try:
        yield World(engine, target).apply(target={"token_env": None, "token_secret": block})
    finally:
        target.token = original


def test_the_config_names_the_block_and_it_is_saved(world: World, block: str) -> None:
    with world.engine.connect() as conn:
        crm = catalog.get_rule(conn, RULE).target
    assert crm.token_secret == block and crm.token_env is None


def test_a_chain_delivers_with_the_blocks_token_and_the_next_chain_reads_it_anew(world: World, block: str) -> None:
    save_block(block, FIRST)
    world.load("c-1")
    first = world.run()
    assert first["state"] == "COMPLETED", first
    assert first["counts"]["delivered"] == 1
    assert [r.headers["authorization"] for r in world.target.requests] == [f"Bearer {FIRST}"]

    # The target now wants another token; the block still holds the old one: refused (401), a
    # fault of the rule that names the block and writes nothing for the record.
    world.target.token = SECOND
    world.load("c-2")
    refused = world.run()
    assert refused["state"] == "FAILED" and refused["ended_by"] == "rule_fault", refused
    assert f"the Prefect Secret block {block!r}" in refused["message"]
    assert "c-2" not in world.ledger()

    # Changed in Prefect, nothing restarted: the next chain reads the block again and delivers.
    save_block(block, SECOND)
    second = world.run()
    assert second["state"] == "COMPLETED" and second["counts"]["delivered"] == 1, second
    assert world.ledger()["c-2"]["status"] == "delivered"
    assert world.target.requests[-1].headers["authorization"] == f"Bearer {SECOND}"

    # A target that reflects the token into its refusal: masked in the ledger, as a token_env one is.
    world.load("c-3")
    world.target.program(world.key("c-3"), Answer.status(422, {"error": f"token {SECOND} may not create"}))
    reflected = world.run()
    assert world.ledger()["c-3"]["status"] == "failed"
    assert "token *** may not create" in (world.ledger()["c-3"]["last_error"] or "")
    written = everything_written(world.engine)
    for run in (first, refused, second, reflected):
        logs = run_logs(run["flow_run_id"])
        assert "Finished in state" in logs  # the whole log was read
        assert FIRST not in logs and SECOND not in logs
    assert FIRST not in written and SECOND not in written


def test_a_missing_block_fails_the_chain_missing_credential_naming_the_block(world: World, block: str) -> None:
    world.load("c-1")
    result = world.run()
    assert result["state"] == "FAILED" and result["ended_by"] == "rule_fault"
    assert "MissingCredential" in result["message"] and repr(block) in result["message"]
    assert "Prefect Secret block" in result["message"]
    state = run_state(result["flow_run_id"])
    assert state.is_failed() and block in (state.message or "")
    assert world.target.requests == []  # nothing sent, nothing written for the fault
    assert world.ledger() == {}

    # A block emptied is missing too; a block made afterwards is used by the next chain.
    save_block(block, "")
    assert world.run()["state"] == "FAILED"
    save_block(block, FIRST)
    assert world.run()["counts"]["delivered"] == 1


@pytest.mark.parametrize("source", ["block", "env"])
def test_a_token_kept_with_a_trailing_line_break_is_used_without_it(
    world: World, block: str, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    """A token file or a pasted Secret block often ends with a line break: it is not the token's."""
    if source == "block":
        save_block(block, f"{FIRST}\r\n")
    else:
        monkeypatch.setenv("CRM_TOKEN", f"  {FIRST}\n")
        world.apply(target={"token_env": "CRM_TOKEN", "token_secret": None})
    world.load("c-1")
    result = world.run()
    assert result["state"] == "COMPLETED" and result["counts"]["delivered"] == 1, result


@pytest.mark.parametrize("bad", ["x\u00c5y", "ab\ncd", "ab cd"], ids=["beyond-ascii", "line-break", "space"])
@pytest.mark.parametrize("source", ["block", "env"])
def test_a_token_no_http_header_can_carry_fails_the_chain_unusable_credential_naming_where_not_what(
    world: World, block: str, monkeypatch: pytest.MonkeyPatch, bad: str, source: str
) -> None:
    """Before: a token beyond ASCII failed the chain with a bare UnicodeEncodeError naming neither
    the connection nor the variable; one with a line break parked every record failed ("Illegal
    header value") and counted against the target's breaker."""
    if source == "block":
        save_block(block, bad)
        where = f"the Prefect Secret block {block!r}"
    else:
        monkeypatch.setenv("CRM_TOKEN", bad)
        world.apply(target={"token_env": "CRM_TOKEN", "token_secret": None})
        where = "$CRM_TOKEN"
    world.load("c-1")
    result = world.run()
    assert result["state"] == "FAILED" and result["ended_by"] == "rule_fault", result
    assert result["message"].startswith("UnusableCredential: ") and where in result["message"], result
    assert "HTTP header cannot carry" in result["message"]
    state = run_state(result["flow_run_id"])
    assert state.name == "Failed" and (state.message or "").startswith("UnusableCredential: ")
    assert world.target.requests == [] and world.ledger() == {}  # nothing sent, nothing parked
    assert bad not in result["message"] and bad not in everything_written(world.engine)


def test_a_deleted_block_fails_the_next_chain_and_never_shows_the_old_value(world: World, block: str) -> None:
    save_block(block, FIRST)
    world.load("c-1")
    assert world.run()["counts"]["delivered"] == 1
    delete_block(block)
    world.load("c-2")
    result = world.run()
    assert result["state"] == "FAILED" and "MissingCredential" in result["message"]
    assert FIRST not in result["message"] and FIRST not in run_logs(result["flow_run_id"])
    assert FIRST not in everything_written(world.engine)


# -- the engine's side, without Prefect --------------------------------------------------------


def test_token_for_reads_the_block_through_the_reader_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRM_TOKEN", "from-the-environment")
    by_block = Connection(1, "crm", "rest", ConnectionStatus.ACTIVE, token_secret="crm-token")
    by_env = Connection(1, "crm", "rest", ConnectionStatus.ACTIVE, token_env="CRM_TOKEN")
    asked: list[str] = []

    def reader(name: str) -> str | None:
        asked.append(name)
        return {"crm-token": "from-the-block"}.get(name)

    assert token_for(by_block, reader) == "from-the-block" and asked == ["crm-token"]
    assert token_for(by_block) is None  # no reader: never the environment instead
    assert token_for(by_env, reader) == "from-the-environment" and asked == ["crm-token"]
    assert token_for(by_block, lambda _name: "") is None


def test_a_chain_opened_without_a_reader_names_the_block(engine: sa.Engine, target: TargetServer) -> None:
    World(engine, target).apply(target={"token_env": None, "token_secret": "crm-token"})
    chain = Chain(engine, RULE)
    with pytest.raises(MissingCredential, match=r"'crm-token'.*no Prefect Secret reader"):
        chain.open()
    opened = Chain(engine, RULE)
    assert opened.open(secrets=lambda name: "t0k3n-from-reader" if name == "crm-token" else None) is None
    assert opened._writer is not None and opened._writer.token == "t0k3n-from-reader"
    assert opened.redact("x t0k3n-from-reader y") == "x *** y"
    opened.finish()
    chain.finish()


CONNECTION = """
connections:
  - name: crm
    driver: rest
    base_url: http://127.0.0.1:9/api
    %s
"""


def test_config_takes_token_secret_or_token_env_never_both() -> None:
    crm = parse_config(CONNECTION % "token_secret: crm-token").connections[0]
    assert crm.token_secret == "crm-token" and crm.spec().token_secret == "crm-token"
    assert parse_config(CONNECTION % "token_env: CRM_TOKEN").connections[0].spec().token_secret is None
    with pytest.raises(ConfigError, match=r"connections\[0\].*token_env and token_secret"):
        parse_config(CONNECTION % "token_env: CRM_TOKEN\n    token_secret: crm-token")
    for bad in ('"Crm_Token"', '"crm token"', '""', '"-crm"'):
        with pytest.raises(ConfigError, match=r"connections\[0\]\.token_secret"):
            parse_config(CONNECTION % f"token_secret: {bad}")
