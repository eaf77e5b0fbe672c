"""A target that echoes the bearer token back in a refusal, in whatever spelling its JSON encoder or
URL library writes it: the token is masked in every spelling, through the real deliver-rule flow
on the Prefect test harness and the real local target, on SQLite and PostgreSQL, in the ledger,
the chain row, `delivery ledger --json`, the run's log and its records artifact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, quote_plus

import pytest
import sqlalchemy as sa

from delivery.store.tables import chains_table, ledger_table
from flows.chain_reporting import records_artifact_key
from tests.integration.runs import run_artifacts, run_logs
from tests.integration.world import RULE, World
from tests.target_server import Answer, TargetServer, _Reply

DELIVERY = Path(sys.executable).parent / "delivery"

#: The tester's token, and one whose `"` and `\` every JSON encoder escapes. Each starts with a
#: prefix no spelling changes, so a partly masked echo shows as that prefix.
TOKENS = {"Sekr3t": "Sekr3t/Tok+en==", "Qu0te": 'Qu0te"Back\\slash/Pl+us'}


class PhpTarget(TargetServer):
    """Refuses `echo_headers` requests the way a PHP API does: the Authorization header it got,
    encoded by json_encode, which writes `/` as `\\/` (and escapes `"` and `\\` as JSON must)."""

    def _scripted(self, answer: Answer, method: str, headers: dict[str, str]) -> _Reply | None:
        if answer.kind != "echo_headers":
            return super()._scripted(answer, method, headers)
        assert answer.code is not None
        body = json.dumps({"error": "invalid token", "auth": headers.get("authorization")}).replace("/", "\\/")
        return _Reply(code=answer.code, body=body.encode("utf-8"))


def spellings(token: str) -> set[str]:
    json_ascii = json.dumps(token)[1:-1]
    json_utf8 = json.dumps(token, ensure_ascii=False)[1:-1]
    return {
        token,
        json_ascii,
        json_utf8,
        json_ascii.replace("/", "\\/"),
        json_utf8.replace("/", "\\/"),
        quote(token, safe=""),
        quote(token),
        quote_plus(token),
    }


#: One record per spelling the target answers with (each a 422), keyed by external id.
ECHOES: dict[str, Callable[[str], Answer]] = {
    "c-raw": lambda token: Answer.status(422, {"error": f"token {token} may not create"}),
    "c-php": lambda _token: Answer.echo_headers(422),
    # The target JSON-encodes the body, so the token arrives with its `"` and `\` escaped.
    "c-json": lambda token: Answer.status(422, {"auth": f"Bearer {token}"}),
    "c-url-segment": lambda token: Answer.status(422, {"error": f"see /tokens/{quote(token, safe='')}"}),
    "c-url-path": lambda token: Answer.status(422, {"error": f"see /x?next=/t/{quote(token)}"}),
    "c-form": lambda token: Answer.status(422, {"error": f"bad form: access_token={quote_plus(token)}&x=1"}),
}


def leaks(text: str, token: str, prefix: str) -> list[str]:
    return sorted(s for s in {*spellings(token), prefix} if s in text)


def everything_written(engine: sa.Engine) -> str:
    with engine.connect() as conn:
        rows = [*conn.execute(sa.select(ledger_table)), *conn.execute(sa.select(chains_table))]
    return "\n".join(repr(tuple(row)) for row in rows)


@pytest.fixture(scope="module")
def php_target() -> Iterator[PhpTarget]:
    server = PhpTarget()
    server.start()
    yield server
    server.stop()


@pytest.fixture(params=list(TOKENS), ids=list(TOKENS))
def token(
    request: pytest.FixtureRequest, php_target: PhpTarget, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, str]]:
    prefix = str(request.param)
    php_target.reset()
    php_target.token = TOKENS[prefix]
    monkeypatch.setenv("CRM_TOKEN", TOKENS[prefix])
    yield prefix, TOKENS[prefix]
    php_target.token = None


def test_a_refusal_echoing_the_token_in_any_spelling_leaves_no_trace(
    prefect_api: None, engine: sa.Engine, php_target: PhpTarget, token: tuple[str, str], tmp_path: Path
) -> None:
    prefix, secret = token
    world = World(engine, php_target).apply()
    world.load(*ECHOES)
    for external_id, echo in ECHOES.items():
        php_target.program(world.key(external_id), echo(secret))

    run = world.run()

    assert run["counts"]["failed"] == len(ECHOES), run
    assert all(php_target.pending(world.key(i)) == 0 for i in ECHOES)  # every echo was answered
    rows = world.ledger()
    assert leaks(everything_written(engine), secret, prefix) == []
    for external_id in ECHOES:
        last_error = rows[external_id]["last_error"] or ""
        assert last_error.startswith("POST contacts: HTTP 422: ") and "***" in last_error, (external_id, last_error)
    assert rows["c-php"]["last_error"] == ('POST contacts: HTTP 422: {"error": "invalid token", "auth": "Bearer ***"}')

    shown = subprocess.run(
        [str(DELIVERY), "ledger", "--json"],
        cwd=tmp_path,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    listed: list[dict[str, Any]] = json.loads(shown.stdout)
    assert {r["external_id"] for r in listed} == set(ECHOES)
    assert leaks(shown.stdout, secret, prefix) == []
    assert leaks("\n".join(r["last_error"] for r in listed), secret, prefix) == []

    logs = "\n".join(run_logs(run["flow_run_id"]))
    assert "Finished in state" in logs  # the whole log was read
    assert leaks(logs, secret, prefix) == []
    artifacts = run_artifacts(run["flow_run_id"])
    records = str(artifacts[records_artifact_key(RULE)].data)
    assert "c-php" in records
    assert leaks(records, secret, prefix) == []
