"""Property-based fuzzing of what an operator feeds the `delivery` command: the config file of
`delivery apply`, the JSONL file of `delivery mirror load`, and the command line itself.

Inputs start from valid files and are mutated byte by byte, line by line and key by key, or are
random YAML/JSON values, arbitrary bytes, odd Unicode, huge numbers and deep nesting. Whatever
comes in, the command must answer as refused input does everywhere else:

- exit 0, or exit 2 with stderr made of `error: ...` lines only (one line per problem: nothing
  spills onto a line of its own), and no traceback anywhere;
- on exit 2, the database exactly as it was (every table dumped before and after).

The CLI runs in process (`flows.cli.main` with its own argv, as the console script calls it), on a
SQLite database per test: a subprocess per example would cost a second each. A few of the inputs
found this way run through the real console script on SQLite and PostgreSQL in
tests/acceptance/test_cli_nasty_inputs.py.

The budget is the Hypothesis profile (tests/conftest.py): "ci" by default, "fuzz" for `make fuzz`.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import yaml
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from delivery import db
from delivery.storable import text_problem
from delivery.store.tables import connections_table
from flows.cli import main
from tests.support.cli import config, contact, set_up
from tests.support.ledger import dump

pytestmark = [
    pytest.mark.fuzz,
    # The strategies hold long strings (deep nesting, huge numbers): Hypothesis warns that their repr is long.
    pytest.mark.filterwarnings("ignore:Generating overly large repr"),
]


# -- running the CLI in process -------------------------------------------------------------------


@dataclass
class Outcome:
    args: list[str]
    code: int | str | None
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return f"delivery {self.args!r}: exit {self.code}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"


#: Seconds an answer may take: a file of a few hundred bytes that takes longer is expanding into
#: something far larger (as a "billion laughs" would, for minutes).
ANSWER_SECONDS = 20


class TookTooLong(Exception):
    pass


def _too_long(signum: int, frame: Any) -> None:
    raise TookTooLong(f"no answer within {ANSWER_SECONDS} s")


def run_cli(*args: str) -> Outcome:
    """`delivery ARGS` through the console script's entry point, in this process."""
    saved = sys.argv
    sys.argv = ["delivery", *args]
    previous = signal.signal(signal.SIGALRM, _too_long)
    try:
        with CliRunner().isolation() as (stdout, stderr, _):
            code: int | str | None = 0
            crash = ""
            signal.alarm(ANSWER_SECONDS)
            try:
                main()
            except SystemExit as exc:
                code = exc.code
            except BaseException:
                code = 1
                crash = traceback.format_exc()
            finally:
                signal.alarm(0)
            sys.stdout.flush()
            sys.stderr.flush()
            out = stdout.getvalue().decode("utf-8", "backslashreplace")
            err = stderr.getvalue().decode("utf-8", "backslashreplace") + crash
    finally:
        sys.argv = saved
        signal.signal(signal.SIGALRM, previous)
    return Outcome(list(args), code, out, err)


def is_usage_error(outcome: Outcome) -> bool:
    """Click's own refusal of a command line (an unknown option, a missing argument, a value not
    among the choices): exit 2 with a boxed message, mostly after the usage, as the CLI has always
    given; or
    a command group given no command, which prints its help and exits 2."""
    refused = outcome.stderr.startswith(("Usage: ", "╭─ Error")) and "─ Error ─" in outcome.stderr
    group_help = outcome.stderr == "" and outcome.stdout.lstrip().startswith("Usage: ")
    return refused or group_help


def check_answer(outcome: Outcome, *, usage_allowed: bool = False) -> None:
    assert "Traceback" not in outcome.stdout + outcome.stderr, str(outcome)
    assert outcome.code in (0, 2), str(outcome)
    if outcome.code == 0:
        assert "error:" not in outcome.stderr, str(outcome)
        return
    if usage_allowed and is_usage_error(outcome):
        return
    lines = outcome.stderr.split("\n")
    assert lines[-1] == "", str(outcome)  # ends with a line break
    assert len(lines) >= 2, str(outcome)
    # One line per problem: a line break inside a problem would print a line that is no `error:`.
    assert all(line.startswith("error: ") and line[len("error: ") :].strip() for line in lines[:-1]), str(outcome)


@pytest.fixture
def world(tmp_path: Path, sqlite_template: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, sa.Engine]]:
    """A scratch directory and a SQLite database holding the standard config and two records."""
    path = tmp_path / "delivery.db"
    shutil.copy(sqlite_template, path)
    url = f"sqlite:///{path}"
    monkeypatch.setenv(db.DATABASE_URL_ENV, url)
    # The CLI's Rich console sizes tables to the terminal: a fixed width, as the subprocess tests.
    monkeypatch.setenv("COLUMNS", "200")
    engine = db.shared_engine(url)
    set_up(engine, config(), contact("a"), contact("b"))
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    yield workdir, engine
    db.dispose_engines()


def unstorable(value: Any, path: str) -> Iterator[str]:
    """Where `value` holds text SQLite keeps and PostgreSQL refuses (a NUL, a lone surrogate)."""
    if isinstance(value, str):
        if text_problem(value) is not None:
            yield path
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from unstorable(key, f"{path} key")
            yield from unstorable(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from unstorable(item, f"{path}[{index}]")


def refused_changes_nothing(engine: sa.Engine, *args: str, usage_allowed: bool = False) -> Outcome:
    """Run `delivery ARGS`: the answer is exit 0 or one `error:` line per problem; refused, the
    database is as it was; taken, what it saved is text both databases store alike."""
    before = dump(engine)
    outcome = run_cli(*args)
    check_answer(outcome, usage_allowed=usage_allowed)
    after = dump(engine)
    if outcome.code != 0:
        assert after == before, f"written although refused\n{outcome}"
    else:
        bad = [where for name, rows in after.items() for where in unstorable(rows, name)]
        assert not bad, f"saved text PostgreSQL would refuse at {bad}\n{outcome}"
    return outcome


# -- values ---------------------------------------------------------------------------------------

#: Text of any kind: every plane, control characters, and lone surrogates (which a YAML or JSON
#: escape carries into a file, though no encoder writes them raw).
odd_text = st.one_of(
    st.text(max_size=30),
    st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=10),
    st.sampled_from(
        [
            "",
            " ",
            "\x00",
            "\ud800",
            "\udcff",
            "a\nb",
            "\r",
            "\t",
            "\x1b[31m",
            "\u2028",
            "\ufeff",
            "\u202e",
            "é",
            "💥",
            "~",
            "null",
            "NaN",
            "-.inf",
            "0x1F",
            "0o17",
            "1_000",
            "1:30",
            "2001-13-45",
            "2001-12-14t21:59:43.10-05:00",
            "<<",
            "*a",
            "&a",
            "!!binary",
            "? ",
            "- ",
            "{",
            "[",
            "'",
            '"',
            "%YAML 1.1",
            "---",
            "...",
        ]
    ),
)

huge_numbers = st.one_of(
    st.integers(),
    st.integers(min_value=-(10**4000), max_value=10**4000),
    st.floats(),
    st.sampled_from([10**4299, -(10**4299), 2**63, -(2**63) - 1, 2**64, 1e308, 5e-324, -0.0]),
)

scalars = st.one_of(st.none(), st.booleans(), huge_numbers, odd_text)
json_values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(odd_text, inner, max_size=4))
)


def nested(depth: int, leaf: str = "1") -> str:
    """Flow-style lists `depth` deep: YAML and JSON alike."""
    return "[" * depth + leaf + "]" * depth


@st.composite
def weighted(draw: st.DrawFn, *choices: tuple[int, st.SearchStrategy[Any]]) -> Any:
    """One of `choices`, each as often as its weight says (`st.one_of` gives each branch the same
    share, however often it is listed)."""
    pick = draw(st.integers(0, sum(weight for weight, _ in choices) - 1))
    for weight, strategy in choices:
        if pick < weight:
            return draw(strategy)
        pick -= weight
    raise AssertionError("unreachable")


# -- mutations ------------------------------------------------------------------------------------


@st.composite
def byte_mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """Some bytes inserted, deleted or replaced (invalid UTF-8 included)."""
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["insert", "delete", "replace"]))
        chunk = draw(st.binary(min_size=1, max_size=8))
        if kind == "insert":
            data = data[:position] + chunk + data[position:]
        elif kind == "delete":
            data = data[:position] + data[position + len(chunk) :]
        else:
            data = data[:position] + chunk + data[position + len(chunk) :]
    return data


@st.composite
def line_mutations(draw: st.DrawFn, text: str, extra_lines: st.SearchStrategy[str]) -> str:
    """Lines dropped, repeated, swapped, re-indented, or new ones inserted."""
    lines = text.split("\n")
    for _ in range(draw(st.integers(1, 3))):
        index = draw(st.integers(0, max(0, len(lines) - 1)))
        kind = draw(st.sampled_from(["drop", "repeat", "swap", "indent", "insert", "truncate"]))
        if kind == "drop" and lines:
            del lines[index]
        elif kind == "repeat" and lines:
            lines.insert(index, lines[index])
        elif kind == "swap" and len(lines) > 1:
            other = draw(st.integers(0, len(lines) - 1))
            lines[index], lines[other] = lines[other], lines[index]
        elif kind == "indent" and lines:
            lines[index] = draw(st.sampled_from(["", " ", "  ", "\t", "    "])) + lines[index].lstrip()
        elif kind == "insert":
            lines.insert(index, draw(extra_lines))
        elif kind == "truncate" and lines:
            lines[index] = lines[index][: draw(st.integers(0, len(lines[index])))]
    return "\n".join(lines)


@st.composite
def value_mutations(draw: st.DrawFn, value: Any, keys: list[str]) -> Any:
    """The parsed document with a key dropped, renamed or added, or a value replaced: somewhere in
    it, at any depth."""
    value = json.loads(json.dumps(value))  # a private copy

    def containers(node: Any) -> Iterator[Any]:
        if isinstance(node, (dict, list)):
            yield node
            for child in node.values() if isinstance(node, dict) else node:
                yield from containers(child)

    for _ in range(draw(st.integers(1, 3))):
        found = list(containers(value))
        if not found:
            return draw(json_values)
        node = draw(st.sampled_from(found))
        if isinstance(node, list):
            kind = draw(st.sampled_from(["replace", "append", "drop"]))
            if kind == "append" or not node:
                node.append(draw(json_values))
            elif kind == "drop":
                node.pop(draw(st.integers(0, len(node) - 1)))
            else:
                node[draw(st.integers(0, len(node) - 1))] = draw(json_values)
            continue
        kind = draw(st.sampled_from(["replace", "replace", "add", "drop", "rename"]))
        key = draw(st.sampled_from(sorted(node))) if node else None
        if kind == "add" or key is None:
            node[draw(st.one_of(st.sampled_from(keys), odd_text))] = draw(json_values)
        elif kind == "drop":
            del node[key]
        elif kind == "rename":
            node[draw(st.one_of(st.sampled_from(keys), odd_text))] = node.pop(key)
        else:
            node[key] = draw(json_values)
    return value


def write(path: Path, content: str | bytes) -> None:
    if isinstance(content, str):
        # What a file can hold: a lone surrogate cannot be written, so it goes as the bytes it stood for.
        content = content.encode("utf-8", "surrogatepass")
    path.write_bytes(content)


# -- (a) the config file of `delivery apply` --------------------------------------------------------

#: A valid config using what YAML offers a person: anchors, merges, flow and block style.
VALID_CONFIG = """\
connections:
  - &crm
    name: crm
    driver: rest
    base_url: 'http://127.0.0.1:9/api'
    token_env: CRM_TOKEN
    timeout_seconds: 2
    breaker: &breaker {fail_max: 5, reset_seconds: 60}
    settle: grouped
  - {name: shop, status: active}
  - <<: *crm
    name: erp
    breaker: *breaker
rules:
  - &rule
    name: contacts-to-crm
    source: shop
    domain: contact
    target: crm
    collection: contacts
    policy: create_and_update
    batch_size: 10
    retry_schedule_seconds: [60, 300]
    fields: {email: email, name: full_name}
  - {<<: *rule, name: orders-to-erp, domain: order, target: erp, collection: v1/orders, enabled: false}
"""

CONFIG_KEYS = sorted(
    {"connections", "rules", "name", "driver", "status", "base_url", "token_env", "token_secret"}
    | {"timeout_seconds", "id_field", "breaker", "settle", "fail_max", "reset_seconds", "source", "domain"}
    | {"target", "collection", "policy", "batch_size", "overlap_seconds", "max_attempts", "fields", "enabled"}
    | {"retry_schedule_seconds", "concurrency", "<<"}
)


@st.composite
def laughs(draw: st.DrawFn) -> str:
    """The "billion laughs": each anchor a list of aliases of the one before."""
    width, depth = draw(st.integers(2, 12)), draw(st.integers(2, 12))
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    for level in range(1, depth):
        lines.append(f"l{level}: &l{level} [{', '.join([f'*l{level - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


#: Base URLs put together from parts, good and bad: schemes, users, hosts (IPv6 brackets left
#: open), ports (none, 0, beyond 65535, not a number), paths, queries and fragments.
base_urls = st.builds(
    lambda scheme, user, host, port, path, tail: f"{scheme}://{user}{host}{port}{path}{tail}",
    st.sampled_from(["http", "https", "http", "https", "ftp", "HTTP", "http:", ""]),
    st.sampled_from(["", "", "", "user@", "user:pw@", "@", ":@"]),
    weighted(
        (3, st.sampled_from(["127.0.0.1", "crm.example", "[::1]", "[::1", "::1", "", "xn--", "é.example", "a..b"])),
        (1, st.text(max_size=8)),
    ),
    st.one_of(
        st.sampled_from(["", "", ":0", ":65536", ":99999", ":-1", ":", ":x", ":80:80", ":8900", ":65535"]),
        st.integers(-2, 70_000).map(lambda n: f":{n}"),
    ),
    st.sampled_from(["", "/", "/api", "/api/", "//", "/a b", "/%zz", "/\\x"]),
    st.sampled_from(["", "", "", "?q=1", "#top", "?", "#"]),
)

NASTY_YAML_LINES = st.one_of(
    base_urls.map(lambda url: f"    base_url: {json.dumps(url)}"),
    st.sampled_from(
        [
            "a: &a [*a]",
            "a: &a {b: *a}",
            "- &x [*x]",
            "<<: *crm",
            "<<: *nowhere",
            "  - <<: [*crm, *breaker]",
            "x: !!binary AAAA",
            "    driver: !!binary AGE=",
            "    domain: !!binary AGE=",
            "    retry_schedule_seconds: !!set {60: null}",
            "    batch_size: !!int x",
            "    batch_size: !!float x",
            "    enabled: !!bool x",
            "    domain: !!timestamp x",
            "    domain: 2001-13-45",
            "    domain: !!python/object:os.system x",
            "    domain: !custom x",
            "    batch_size: " + "9" * 5000,
            "    timeout_seconds: 1e99999",
            "    base_url: 'http://127.0.0.1:99999/api'",
            "    base_url: 'http://[::1/api'",
            "    base_url: 'http:///api'",
            "    base_url: 'http://xn--/api'",
            "    base_url: 'http://x:0/api'",
            "    base_url: 'http://x/api?q=1'",
            '    "a\\nb": 1',
            '    "\\e[31mred": 1',
            '    domain: "\\ud800"',
            '    domain: "\\0"',
            "? [a, b]\n: 1",
            "? {a: 1}\n: 1",
            "\x01",
            "\x7f",
            "\ufeff",
            "---",
            "...",
            "%TAG ! tag:x,2000:",
            "a: " + nested(2000),
            "a: " + "{a: " * 500 + "1" + "}" * 500,
        ]
    ),
    laughs(),
    st.builds(lambda d: "a: " + nested(d), st.integers(1, 3000)),
    odd_text,
)


def yaml_text(value: Any) -> str:
    try:
        return yaml.safe_dump(value, allow_unicode=True, sort_keys=False)
    except yaml.YAMLError:
        return json.dumps(value)  # JSON is YAML too


#: The source text of one YAML value: tags that build other types (or fail to), dates that do
#: not exist, integers too long to read, aliases (recursive, undefined, to a large anchor), and
#: any text in double quotes, whose escapes carry a NUL or a lone surrogate into the file.
_NASTY_VALUES = st.sampled_from(
    [
        "!!binary AGE=",
        "!!binary AAAA",
        "!!set {60: null}",
        "!!omap [{a: b}]",
        "!!pairs [{a: b}]",
        "!!int x",
        "!!float x",
        "!!bool x",
        "!!timestamp x",
        "!!str 1",
        "!!null x",
        "!!map [a]",
        "!!seq {a: b}",
        "!custom x",
        "!!python/name:os.system",
        "2001-13-45",
        "2001-02-29",
        "2001-12-14 21:59:43.10 -05:00",
        "1:30",
        "0x_",
        "0b102",
        "0o9",
        ".nan",
        "-.inf",
        "1e99999",
        "9" * 4301,
        "-" + "9" * 5000,
        "1." + "0" * 5000,
        "*nowhere",
        "*crm",
        "*breaker",
        "&x [*x]",
        "&y {a: *y}",
        "[*rule, *rule]",
        "{<<: *rule}",
        "~",
        "''",
        "[]",
        "{}",
        nested(60),
        nested(3000),
        "{a: " * 60 + "1" + "}" * 60,
    ]
)
yaml_values = weighted(
    (4, _NASTY_VALUES),
    (1, st.binary(max_size=6).map(lambda data: "!!binary " + (base64.b64encode(data).decode() or "''"))),
    (1, huge_numbers.map(str)),
    (1, odd_text.map(json.dumps)),
    (1, base_urls.map(json.dumps)),
)

#: Where VALID_CONFIG gives a key a value, block or flow style: `name: crm`, `{fail_max: 5, ...`.
_VALUE = re.compile(r"([a-z_]+): ([^,{}\[\]\n]+)")


@st.composite
def value_injections(draw: st.DrawFn, text: str) -> str:
    """VALID_CONFIG with one to three of its values swapped for `yaml_values` in its own text."""
    for _ in range(draw(st.integers(1, 3))):
        # A key first, then one of its places: `domain` is as likely as `name`, found five times.
        found = list(_VALUE.finditer(text))
        key = draw(st.sampled_from(sorted({match.group(1) for match in found})))
        match = draw(st.sampled_from([match for match in found if match.group(1) == key]))
        text = text[: match.start(2)] + draw(yaml_values) + text[match.end(2) :]
    return text


# Half of the examples are the valid config with values swapped, a sixth with another base URL.
config_inputs = weighted(
    (8, value_injections(VALID_CONFIG)),
    (3, base_urls.map(lambda url: VALID_CONFIG.replace("'http://127.0.0.1:9/api'", json.dumps(url)))),
    (1, byte_mutations(VALID_CONFIG.encode())),
    (1, line_mutations(VALID_CONFIG, NASTY_YAML_LINES)),
    (1, value_mutations(yaml.safe_load(VALID_CONFIG), CONFIG_KEYS).map(yaml_text)),
    (1, value_mutations(yaml.safe_load(VALID_CONFIG), CONFIG_KEYS).map(lambda v: json.dumps(v, ensure_ascii=False))),
    (1, json_values.map(yaml_text)),
    (1, NASTY_YAML_LINES),
    (1, laughs()),
    (1, st.binary(max_size=200)),
)


def assert_usable_base_urls(engine: sa.Engine) -> None:
    """Every base URL saved is one the REST writer can send to: httpx reads it, it names a host
    and a port that exists, and a client on it builds a request as the writer's does."""
    with engine.connect() as conn:
        saved = conn.execute(sa.select(connections_table.c.name, connections_table.c.base_url)).all()
    for name, base_url in saved:
        if base_url is None:
            continue
        url = httpx.URL(base_url)
        assert url.host, (name, base_url)
        assert url.port is None or 1 <= url.port <= 65535, (name, base_url)
        with httpx.Client(base_url=base_url.rstrip("/") + "/", trust_env=False) as client:
            request = client.build_request("POST", "contacts")
        assert request.url.host == url.host and request.url.path.endswith("/contacts"), (name, base_url, request.url)


@given(content=config_inputs)
def test_apply_answers_any_file_with_exit_0_or_one_error_line_per_problem(
    world: tuple[Path, sa.Engine], content: str | bytes
) -> None:
    workdir, engine = world
    write(workdir / "fuzz.yaml", content)
    if refused_changes_nothing(engine, "apply", "fuzz.yaml").code == 0:
        assert_usable_base_urls(engine)


# -- (b) the JSONL file of `delivery mirror load` ---------------------------------------------------

VALID_JSONL = "".join(json.dumps(contact(i, age=30, tags=["x", "y"], address={"city": "Z"})) + "\n" for i in "abcd")

NASTY_JSONL_LINES = st.one_of(
    st.sampled_from(
        [
            "",
            " ",
            "\ufeff" + json.dumps(contact("bom")),
            '{"id": "x", "payload": {"n": NaN}}',
            '{"id": "x", "payload": {"n": -Infinity}}',
            '{"id": "x", "payload": {"n": 1e400}}',
            '{"id": "x", "payload": {"n": ' + "9" * 4301 + "}}",
            '{"id": "x", "payload": {"n": ' + "9" * 4300 + "}}",
            '{"id": ' + "9" * 600 + ', "payload": {}}',
            '{"id": "x", "payload": {"\\u0000": 1}}',
            '{"id": "x\\ud800", "payload": {}}',
            '{"id": "x", "payload": {}, "payload": []}',
            '{"id": "x", "payload": {}, "deleted": null}',
            '{"id": true, "payload": {}}',
            '{"id": "x", "payload": {}, "extra": 1}',
            '{"id": "x", "payload": {"a": ' + nested(2000) + "}}",
            '{"id": "x", "payload": {"a": ' + nested(980) + "}}",
            '{"id": "x", "payload": {"a": ' + nested(900) + "}}",
            "[]",
            "null",
            "\x00",
            "\x1c",
        ]
    ),
    st.builds(lambda d: '{"id": "deep", "payload": {"a": ' + nested(d) + "}}", st.integers(1, 3000)),
    st.builds(
        lambda external_id, payload, deleted: json.dumps(
            {"id": external_id, "payload": payload, "deleted": deleted}, ensure_ascii=False
        ),
        st.one_of(odd_text, huge_numbers, json_values),
        json_values,
        st.one_of(st.booleans(), json_values),
    ),
    json_values.map(json.dumps),
    odd_text,
)

MIRROR_KEYS = ["id", "payload", "deleted", "email", "name", "address", "city", "tags", "age"]


def jsonl_of(values: list[Any]) -> str:
    return "".join(json.dumps(value, ensure_ascii=False) + "\n" for value in values)


mirror_inputs = st.one_of(
    byte_mutations(VALID_JSONL.encode()),
    line_mutations(VALID_JSONL, NASTY_JSONL_LINES),
    value_mutations([json.loads(line) for line in VALID_JSONL.splitlines()], MIRROR_KEYS).map(
        lambda values: jsonl_of(values) if isinstance(values, list) else jsonl_of([values])
    ),
    st.lists(NASTY_JSONL_LINES, min_size=1, max_size=4).map(lambda lines: "\n".join(lines) + "\n"),
    st.binary(max_size=200),
)


@given(
    content=mirror_inputs,
    source=st.sampled_from(["shop", "shop", "shop", "crm", "nowhere", "", "sh\x00op"]),
    domain=st.one_of(st.just("contact"), st.just("contact"), odd_text.filter(lambda t: "\x00" not in t)),
)
def test_mirror_load_answers_any_file_with_exit_0_or_one_error_line_per_problem(
    world: tuple[Path, sa.Engine], content: str | bytes, source: str, domain: str
) -> None:
    workdir, engine = world
    write(workdir / "fuzz.jsonl", content)
    refused_changes_nothing(engine, "mirror", "load", "--source", source, "--domain", _argv(domain), "fuzz.jsonl")


# -- (c) the command line -------------------------------------------------------------------------


def _argv(text: str) -> str:
    """`text` as it reaches Python from a command line: bytes, decoded with surrogateescape (a NUL
    cannot be passed at all, and only U+DC80-U+DCFF stand for undecodable bytes)."""
    raw = text.encode("utf-8", "surrogatepass").replace(b"\x00", b"")
    return os.fsdecode(raw)


#: The commands that neither start a server, nor talk to Prefect, nor deliver anything.
COMMANDS = [
    ["apply"],
    ["mirror", "load"],
    ["mirror"],
    ["db", "upgrade"],
    ["connections"],
    ["rules"],
    ["connection-status"],
    ["ledger"],
    ["requeue"],
    ["requeues"],
    [],
]

OPTIONS = [
    "--json",
    "--help",
    "--rule",
    "--status",
    "--limit",
    "--id",
    "--error-contains",
    "--since",
    "--dry-run",
    "--by",
    "--source",
    "--domain",
    "--",
    "-",
    "-x",
    "--json=1",
    "--limit=0",
    "--status=exhausted",
]

argument_values = st.one_of(
    st.sampled_from(OPTIONS),
    st.sampled_from(
        [
            "contacts-to-crm",
            "crm",
            "shop",
            "active",
            "disabled",
            "exhausted",
            "remote_gone",
            "delivered",
            "contact",
            "config.yaml",
            "mirror.jsonl",
            "missing.yaml",
            ".",
            "/",
            "/dev/null",
            "2026-12-01T08:00",
            "2026-13-01",
            "0",
            "-1",
            str(10**30),
            "1e400",
            "nan",
        ]
    ),
    st.binary(max_size=12).map(os.fsdecode).filter(lambda text: "\x00" not in text),
    odd_text.map(_argv),
)


@given(command=st.sampled_from(COMMANDS), rest=st.lists(argument_values, max_size=6))
def test_any_command_line_is_answered_with_exit_0_or_2_and_no_traceback(
    world: tuple[Path, sa.Engine], command: list[str], rest: list[str]
) -> None:
    workdir, engine = world
    (workdir / "config.yaml").write_text(yaml.safe_dump(config()), encoding="utf-8")
    (workdir / "mirror.jsonl").write_text(VALID_JSONL, encoding="utf-8")
    refused_changes_nothing(engine, *command, *rest, usage_allowed=True)
