"""Inputs the fuzzing of tests/acceptance/test_cli_fuzz.py found (or was built to find), run
through the real `delivery` console script on SQLite and PostgreSQL: each is refused with exit 2,
exactly the `error:` lines expected (one per problem, nothing spilling onto a line of its own), no
traceback, and the database as it was.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.support.cli import config, contact, finish, set_up, spawn
from tests.support.ledger import dump


def laughs(width: int, depth: int) -> str:
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * width)}]" for n in range(1, depth)]
    return "\n".join(lines) + "\n"


def with_base_url(url: str) -> str:
    return (
        "connections:\n  - {name: shop}\n"
        f"  - {{name: crm, driver: rest, base_url: '{url}', token_env: CRM_TOKEN}}\n"
        "rules:\n  - {name: r, source: shop, domain: contact, target: crm, collection: contacts}\n"
    )


#: (name, file content, the error lines expected, each without its `error: FILE: ` start).
CONFIGS: list[tuple[str, str, list[str]]] = [
    (
        "recursive-alias",
        "a: &a [*a]\n",
        ["refused at line 1, column 8: the alias *a stands inside the node &a names: a recursive alias"],
    ),
    (
        "billion-laughs",
        laughs(9, 9),
        [
            "refused at line 6, column 10: with *l4, aliases repeat more than 100,000 values in all "
            "(aliases are limited: write the repeated part out, or repeat it less)"
        ],
    ),
    ("deep-nesting", "a: " + "[" * 3000 + "]" * 3000 + "\n", ["refused at line 1, column 53: mappings and lists nest"]),
    (
        "huge-integer",
        "rules:\n  - {batch_size: " + "9" * 5000 + "}\n",
        ["not valid YAML at line 2, column 18: an integer of more than 4300 digits cannot be read"],
    ),
    (
        "no-such-date",
        "rules:\n  - {domain: 2001-13-45}\n",
        ["not valid YAML at line 2, column 14: this value cannot be read as !!timestamp (month must be in 1..12)"],
    ),
    (
        "control-character",
        "connections:\n  - {name: crm\x01}\n",
        ["not valid YAML at line 2, column 15: the character U+0001"],
    ),
]

#: (name, base_url, the problem named): each refused at `connections[1].base_url`.
BASE_URLS = [
    ("port-99999", "http://127.0.0.1:99999/api", "has port 99999, outside 1 to 65535"),
    ("open-bracket", "http://[::1/api", "httpx cannot read it as a URL (Invalid port: ':1')"),
    ("no-host", "http:///api", "names no host"),
    ("query", "http://127.0.0.1:9/api?key=1", "must hold no query (?...) or fragment (#...)"),
]


@pytest.fixture
def workdir(engine: sa.Engine, tmp_path: Path) -> Path:
    """The standard config and two records saved; a scratch directory to run in."""
    set_up(engine, config(), contact("a"), contact("b"))
    path = tmp_path / "work"
    path.mkdir()
    return path


def test_nasty_configs_and_base_urls_are_refused_with_one_line_each_and_nothing_written(
    engine: sa.Engine, workdir: Path
) -> None:
    before = dump(engine)
    cases: list[tuple[str, list[str]]] = []
    for name, content, lines in CONFIGS:
        (workdir / f"{name}.yaml").write_text(content, encoding="utf-8")
        cases.append((f"{name}.yaml", [f"error: {name}.yaml: {line}" for line in lines]))
    for name, url, problem in BASE_URLS:
        (workdir / f"{name}.yaml").write_text(with_base_url(url), encoding="utf-8")
        cases.append((f"{name}.yaml", [f"error: connections[1].base_url: {problem}"]))
    # A key holding a line break, printed as its escape: one line, not two.
    (workdir / "key.yaml").write_text('"a\\nb": 1\n', encoding="utf-8")
    cases.append(("key.yaml", ["error: a\\nb: Extra inputs are not permitted"]))
    # A file that is not there, whose name holds a line break.
    cases.append(("no\nsuch.yaml", ["error: no\\nsuch.yaml: cannot be read: No such file or directory"]))
    started = [(file, expected, spawn("apply", file, cwd=workdir)) for file, expected in cases]
    failures = [_unexpected(file, expected, finish(process)) for file, expected, process in started]
    assert not [failure for failure in failures if failure], "\n\n".join(f for f in failures if f)
    assert dump(engine) == before


def test_a_mirror_line_with_an_unknown_key_holding_a_line_break_is_refused_on_one_line(
    engine: sa.Engine, workdir: Path
) -> None:
    before = dump(engine)
    (workdir / "keys.jsonl").write_text('{"id": "a", "payload": {}}\n{"id": "c", "payload": {}, "\\n": 1}\n')
    proc = finish(spawn("mirror", "load", "--source", "shop", "--domain", "contact", "keys.jsonl", cwd=workdir))
    failure = _unexpected("keys.jsonl", ['error: line 2: unknown key(s) "\\n"; allowed: deleted, id, payload'], proc)
    assert not failure, failure
    assert dump(engine) == before


def _unexpected(file: str, expected: list[str], proc: subprocess.CompletedProcess[str]) -> str:
    """Empty if `proc` was refused with exactly the `expected` lines (each a line's start)."""
    code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    lines = stderr.split("\n")
    good = (
        code == 2
        and "Traceback" not in stderr + stdout
        and lines[-1] == ""
        and len(lines) - 1 == len(expected)
        and all(line.startswith(start) for line, start in zip(lines, expected, strict=False))
    )
    return "" if good else f"[{file!r}] exit {code}, expected {expected}\nstdout:\n{stdout}\nstderr:\n{stderr}"
