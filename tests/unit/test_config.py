"""The configuration file: its shape (parse_config/load_config) and the save-time cross-checks
(check_rules, ADR-0030)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from delivery.config import DeliveryConfig, check_rules, check_text, load_config, parse_config
from delivery.domain import ConnectionStatus, Policy, SavedRule
from delivery.errors import ConfigError, InputError

EXAMPLE = """\
connections:
  - name: crm
    driver: rest
    status: active
    base_url: http://127.0.0.1:8900/api
    token_env: CRM_TOKEN
    timeout_seconds: 10
    id_field: id
    breaker: {fail_max: 5, reset_seconds: 60}
  - name: shop
rules:
  - name: contacts-to-crm
    source: shop
    domain: contact
    target: crm
    collection: contacts
    policy: create_and_update
    batch_size: 100
    overlap_seconds: 300
    max_attempts: 5
    retry_schedule_seconds: [60, 300, 1800, 7200]
    fields: {email: email, name: full_name}
    enabled: true
"""

RULE = "rules:\n  - {name: r, source: shop, domain: contact, target: crm, collection: contacts, %s}\n"
CONNECTION = "connections:\n  - {name: crm, %s}\n"


def rule_with(setting: str) -> str:
    """RULE with `setting` in place of the rule line's own value for that key, if it has one (a
    key given twice is refused before any value is looked at)."""
    key = setting.split(":", 1)[0].strip()
    line = RULE.split("{", 1)[1].split("%s", 1)[0]
    kept = ", ".join(part for part in line.split(", ") if part and not part.startswith(f"{key}:"))
    return f"rules:\n  - {{{kept}, {setting}}}\n"


def problems_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    problems = caught.value.problems
    assert isinstance(problems, list)
    assert problems
    assert all(isinstance(p, str) for p in problems)
    return problems


def check_problems(text: str, known: dict[str, str | None]) -> list[str]:
    config = parse_config(text)
    with pytest.raises(ConfigError) as caught:
        check_rules(config, known)
    return caught.value.problems


def rule_doc(target_driver: str | None, policy: str, base_url: str = "http://t.test/api") -> str:
    driver = f"driver: {target_driver}, " if target_driver else ""
    return (
        "connections:\n"
        f"  - {{name: crm, {driver}base_url: '{base_url}'}}\n"
        "  - {name: shop}\n" + RULE % f"policy: {policy}"
    )


# --- parse_config: the valid document ----------------------------------------------------------


def test_example_document_parses() -> None:
    config = parse_config(EXAMPLE)
    assert isinstance(config, DeliveryConfig)
    crm, shop = config.connections
    assert crm.name == "crm"
    assert crm.driver == "rest"
    assert crm.status is ConnectionStatus.ACTIVE
    assert crm.base_url == "http://127.0.0.1:8900/api"
    assert crm.token_env == "CRM_TOKEN"
    assert crm.timeout_seconds == 10
    assert crm.id_field == "id"
    assert crm.breaker.fail_max == 5
    assert crm.breaker.reset_seconds == 60
    assert shop.name == "shop"
    assert shop.driver is None
    assert shop.status is None
    assert shop.base_url is None
    (rule,) = config.rules
    assert rule.name == "contacts-to-crm"
    assert (rule.source, rule.domain, rule.target, rule.collection) == ("shop", "contact", "crm", "contacts")
    assert rule.policy is Policy.CREATE_AND_UPDATE
    assert rule.batch_size == 100
    assert rule.overlap_seconds == 300
    assert rule.max_attempts == 5
    assert rule.retry_schedule_seconds == [60, 300, 1800, 7200]
    assert rule.fields == {"email": "email", "name": "full_name"}
    assert rule.enabled is True


def test_example_document_passes_check_rules() -> None:
    check_rules(parse_config(EXAMPLE), {"crm": "rest", "shop": None})


def test_defaults() -> None:
    config = parse_config("connections:\n  - {name: crm}\n" + RULE % "enabled: true")
    connection = config.connections[0]
    assert connection.driver is None
    assert connection.status is None
    assert connection.timeout_seconds == 10.0
    assert connection.id_field == "id"
    assert connection.breaker.fail_max == 5
    assert connection.breaker.reset_seconds == 60.0
    rule = config.rules[0]
    assert rule.policy is Policy.CREATE_AND_UPDATE
    assert rule.batch_size == 100
    assert rule.overlap_seconds == 300
    assert rule.max_attempts == 5
    assert rule.retry_schedule_seconds == [60, 300, 1800, 7200]
    assert rule.fields is None


@pytest.mark.parametrize("text", ["", "   \n", "# only a comment\n", "~\n", "null\n"])
def test_empty_file_is_an_empty_config(text: str) -> None:
    config = parse_config(text)
    assert config.connections == []
    assert config.rules == []


def test_empty_sections() -> None:
    config = parse_config("connections: []\nrules: []\n")
    assert config.connections == []
    assert config.rules == []


@pytest.mark.parametrize("policy", ["create_and_update", "create_only", "update_only"])
def test_each_policy_parses(policy: str) -> None:
    assert parse_config(RULE % f"policy: {policy}").rules[0].policy is Policy(policy)


@pytest.mark.parametrize("status", ["active", "error", "disabled"])
def test_each_status_parses(status: str) -> None:
    assert parse_config(CONNECTION % f"status: {status}").connections[0].status is ConnectionStatus(status)


@pytest.mark.parametrize("url", ["http://x", "https://crm.example.com/api/v2", "http://127.0.0.1:8900/api"])
def test_good_base_urls(url: str) -> None:
    assert parse_config(CONNECTION % f"base_url: '{url}'").connections[0].base_url == url


@pytest.mark.parametrize("env", ["CRM_TOKEN", "_X", "a1"])
def test_good_token_env(env: str) -> None:
    assert parse_config(CONNECTION % f"token_env: {env}").connections[0].token_env == env


# --- parse_config: refusals with their path -----------------------------------------------------


def test_unknown_rule_key_is_refused_with_its_path() -> None:
    problems = problems_of(RULE % "polcy: create_only")
    assert len(problems) == 1
    assert problems[0].startswith("rules[0].polcy")


def test_unknown_connection_key_is_refused_with_its_path() -> None:
    problems = problems_of("connections:\n  - {name: a}\n  - {name: b, tokn_env: X}\n")
    assert problems[0].startswith("connections[1].tokn_env")


def test_unknown_breaker_key_is_refused_with_its_path() -> None:
    problems = problems_of(CONNECTION % "breaker: {fail_maxx: 3}")
    assert problems[0].startswith("connections[0].breaker.fail_maxx")


def test_unknown_top_level_key_is_refused() -> None:
    problems = problems_of("conections: []\n")
    assert problems[0].startswith("conections")


def test_every_problem_is_reported() -> None:
    problems = problems_of(RULE % "batch_size: 0, max_attempts: 0, polcy: x")
    assert len(problems) == 3
    assert {p.split(":")[0] for p in problems} == {"rules[0].batch_size", "rules[0].max_attempts", "rules[0].polcy"}
    assert str(ConfigError(problems)) == "; ".join(problems)


def test_missing_required_rule_fields() -> None:
    problems = problems_of("rules:\n  - {name: r}\n")
    assert {p.split(":")[0] for p in problems} == {
        "rules[0].source",
        "rules[0].domain",
        "rules[0].target",
        "rules[0].collection",
    }


def test_connection_without_name() -> None:
    assert problems_of("connections:\n  - {driver: rest}\n")[0].startswith("connections[0].name")


@pytest.mark.parametrize(
    ("setting", "path"),
    [
        ('batch_size: "x"', "rules[0].batch_size"),
        ("batch_size: [1]", "rules[0].batch_size"),
        ("overlap_seconds: abc", "rules[0].overlap_seconds"),
        ("retry_schedule_seconds: 60", "rules[0].retry_schedule_seconds"),
        ("retry_schedule_seconds: [a]", "rules[0].retry_schedule_seconds[0]"),
        ("fields: [email]", "rules[0].fields"),
        ("fields: {email: [x]}", "rules[0].fields.email"),
        ("enabled: maybe", "rules[0].enabled"),
        ("collection: {a: 1}", "rules[0].collection"),
    ],
)
def test_wrong_types_in_a_rule(setting: str, path: str) -> None:
    problems = problems_of(rule_with(setting))
    assert problems[0].startswith(path + ":"), problems


@pytest.mark.parametrize(
    ("setting", "path"),
    [
        ("timeout_seconds: soon", "connections[0].timeout_seconds"),
        ("breaker: 5", "connections[0].breaker"),
        ("breaker: {fail_max: many}", "connections[0].breaker.fail_max"),
    ],
)
def test_wrong_types_in_a_connection(setting: str, path: str) -> None:
    assert problems_of(CONNECTION % setting)[0].startswith(path + ":")


@pytest.mark.parametrize("text", ["connections: {}\n", "connections: crm\n", "rules: 5\n"])
def test_sections_must_be_lists(text: str) -> None:
    assert problems_of(text)[0].split(":")[0] in {"connections", "rules"}


@pytest.mark.parametrize(
    ("setting", "path"),
    [
        ("policy: create_onl", "rules[0].policy"),
        ("policy: CREATE_ONLY", "rules[0].policy"),
        ("batch_size: 0", "rules[0].batch_size"),
        ("batch_size: -1", "rules[0].batch_size"),
        ("batch_size: 10001", "rules[0].batch_size"),
        ("overlap_seconds: -1", "rules[0].overlap_seconds"),
        ("max_attempts: 0", "rules[0].max_attempts"),
        ("retry_schedule_seconds: []", "rules[0].retry_schedule_seconds"),
        ("retry_schedule_seconds: [60, -1]", "rules[0].retry_schedule_seconds[1]"),
        ("fields: {}", "rules[0].fields"),
        ("collection: ''", "rules[0].collection"),
        ("collection: 'a b'", "rules[0].collection"),
        ("collection: 'a?b=1'", "rules[0].collection"),
        # Before: accepted, and the writer posted outside the base URL (POST http://host/_faults).
        ("collection: '../../_faults'", "rules[0].collection"),
        ("collection: 'a/../b'", "rules[0].collection"),
        ("collection: '%2e%2e'", "rules[0].collection"),
        ("collection: '//abs'", "rules[0].collection"),
        ("collection: 'a/%2E%2e/b'", "rules[0].collection"),
        ("collection: 'a%2fb'", "rules[0].collection"),
        ("collection: 'a\\\\b'", "rules[0].collection"),
        ("collection: 'a/'", "rules[0].collection"),
        ("collection: 'a//b'", "rules[0].collection"),
        ("collection: 'http:evil'", "rules[0].collection"),
        ("collection: '.'", "rules[0].collection"),
        ("domain: ''", "rules[0].domain"),
        ("name: '-r'", "rules[0].name"),
        ("name: 'has space'", "rules[0].name"),
    ],
)
def test_bad_rule_values(setting: str, path: str) -> None:
    problems = problems_of(rule_with(setting))
    assert problems[0].startswith(path + ":"), problems


def test_empty_schedule_message_is_about_the_list() -> None:
    problems = problems_of(RULE % "retry_schedule_seconds: []")
    assert problems == [problems[0]]
    assert "at least 1" in problems[0]


def test_empty_fields_message_explains_the_alternative() -> None:
    (problem,) = problems_of(RULE % "fields: {}")
    assert problem == "rules[0].fields: must map at least one field, or be left out to send the whole payload"


@pytest.mark.parametrize(
    ("setting", "path"),
    [
        ("status: broken", "connections[0].status"),
        ("status: Active", "connections[0].status"),
        ("base_url: ftp://x", "connections[0].base_url"),
        ("base_url: 'http://has space'", "connections[0].base_url"),
        ("base_url: crm.example.com", "connections[0].base_url"),
        ('token_env: "1BAD"', "connections[0].token_env"),
        ('token_env: "BAD-NAME"', "connections[0].token_env"),
        ('token_env: "$CRM"', "connections[0].token_env"),
        ("timeout_seconds: 0", "connections[0].timeout_seconds"),
        ("timeout_seconds: 601", "connections[0].timeout_seconds"),
        ("id_field: ''", "connections[0].id_field"),
        ("driver: ''", "connections[0].driver"),
        ("breaker: {fail_max: 0}", "connections[0].breaker.fail_max"),
        ("breaker: {reset_seconds: 0}", "connections[0].breaker.reset_seconds"),
    ],
)
def test_bad_connection_values(setting: str, path: str) -> None:
    problems = problems_of(CONNECTION % setting)
    assert problems[0].startswith(path + ":"), problems


def test_duplicate_connection_names_are_refused() -> None:
    problems = problems_of("connections:\n  - {name: crm}\n  - {name: shop}\n  - {name: crm}\n")
    assert len(problems) == 1
    assert problems[0].startswith("connections[2].name: ")
    assert "'crm' is already declared at connections[0]" in problems[0]


def test_duplicate_rule_names_are_refused() -> None:
    rule = "  - {name: r, source: s, domain: d, target: t, collection: c}\n"
    problems = problems_of("rules:\n" + rule + rule)
    assert len(problems) == 1
    assert problems[0].startswith("rules[1].name: ")
    assert "'r' is already declared at rules[0]" in problems[0]


def test_a_rule_may_share_a_connection_name() -> None:
    config = parse_config("connections:\n  - {name: x}\n" + RULE.replace("name: r,", "name: x,") % "enabled: true")
    assert config.rules[0].name == config.connections[0].name == "x"


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("connections:\n  - name: crm\n     driver: rest\n", 3),
        ("connections:\n  - name: crm\n\tdriver: rest\n", 3),
        ("rules: []\nconnections: [\n", 3),
    ],
)
def test_invalid_yaml_gives_the_line_number(text: str, line: int) -> None:
    (problem,) = problems_of(text)
    assert problem.startswith("config: not valid YAML at ")
    assert f"line {line}," in problem


def test_invalid_yaml_names_the_origin() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config("a: [\n", origin="deploy/delivery.yaml")
    assert caught.value.problems[0].startswith("deploy/delivery.yaml: not valid YAML")


def test_several_yaml_documents_are_refused() -> None:
    (problem,) = problems_of("connections: []\n---\nrules: []\n")
    assert "not valid YAML" in problem


@pytest.mark.parametrize("text", ["- name: crm\n", "[]\n", "just words\n", "42\n", "true\n"])
def test_top_level_must_be_a_mapping(text: str) -> None:
    assert problems_of(text) == ["config: the top level must be a mapping with 'connections' and 'rules'"]


def test_config_error_is_an_input_error() -> None:
    assert issubclass(ConfigError, InputError)


def test_parsed_config_is_frozen() -> None:
    config = parse_config(EXAMPLE)
    with pytest.raises(Exception):  # noqa: B017 - pydantic's ValidationError for a frozen model
        config.rules[0].batch_size = 5  # type: ignore[misc]


# --- load_config ---------------------------------------------------------------------------------


def test_load_config_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "delivery.yaml"
    path.write_text(EXAMPLE, encoding="utf-8")
    assert load_config(path) == parse_config(EXAMPLE)


def test_load_config_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    (problem,) = caught.value.problems
    assert problem.startswith(f"{path}: cannot be read")


def test_load_config_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path)
    assert caught.value.problems[0].startswith(f"{tmp_path}: cannot be read")


def test_load_config_yaml_error_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("connections:\n  - name: crm\n     driver: rest\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems[0].startswith(f"{path}: not valid YAML at line 3")


def test_load_config_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("", encoding="utf-8")
    assert load_config(path) == DeliveryConfig()


def test_load_config_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("connections:\n  - name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.problems[0].startswith(str(path))


# --- check_rules ---------------------------------------------------------------------------------


def test_check_rules_on_an_empty_config() -> None:
    check_rules(DeliveryConfig(), {})


def test_check_rules_uses_known_connections_not_only_the_file() -> None:
    check_rules(parse_config(RULE % "policy: create_only"), {"crm": "rest", "shop": None})


def test_unknown_source() -> None:
    problems = check_problems(RULE % "policy: create_only", {"crm": "rest"})
    assert problems == ["rules[0].source: rule 'r': no connection named 'shop'"]


def test_unknown_target() -> None:
    problems = check_problems(RULE % "policy: create_only", {"shop": None})
    assert problems == ["rules[0].target: rule 'r': no connection named 'crm'"]


def test_unknown_source_and_target() -> None:
    problems = check_problems(RULE % "policy: create_only", {})
    assert [p.split(":")[0] for p in problems] == ["rules[0].source", "rules[0].target"]


def test_problems_of_every_rule_are_collected() -> None:
    text = (
        "rules:\n"
        "  - {name: a, source: shop, domain: d, target: crm, collection: c}\n"
        "  - {name: b, source: nowhere, domain: d, target: crm, collection: c}\n"
        "  - {name: c, source: shop, domain: d, target: nowhere, collection: c}\n"
    )
    problems = check_problems(text, {"shop": None, "crm": "rest"})
    assert [p.split(":")[0] for p in problems] == ["rules[1].source", "rules[2].target"]


@pytest.mark.parametrize("driver", ["soap", None])
def test_target_driver_without_writer(driver: str | None) -> None:
    problems = check_problems(RULE % "policy: create_only", {"crm": driver, "shop": None})
    assert len(problems) == 1
    problem = problems[0]
    assert problem.startswith("rules[0].target: rule 'r': target 'crm'")
    if driver is None:  # before: "has driver None, which has no registered writer"
        assert "target 'crm' has no driver (drivers with a writer:" in problem and "None" not in problem
    else:
        assert f"has driver {driver!r}, which has no registered writer" in problem
    assert "rest, rest-create-only, rest-update-only" in problem


@pytest.mark.parametrize("policy", ["update_only", "create_and_update"])
def test_create_only_driver_lacks_update(policy: str) -> None:
    problems = check_problems(rule_doc("rest-create-only", policy), {"crm": "rest-create-only", "shop": None})
    assert problems == [
        f"rules[0].policy: rule 'r': policy {policy!r} needs the 'update' verb, "
        "which driver 'rest-create-only' does not offer"
    ]


@pytest.mark.parametrize("policy", ["create_only", "create_and_update"])
def test_update_only_driver_lacks_create(policy: str) -> None:
    problems = check_problems(rule_doc("rest-update-only", policy), {"crm": "rest-update-only", "shop": None})
    assert problems == [
        f"rules[0].policy: rule 'r': policy {policy!r} needs the 'create' verb, "
        "which driver 'rest-update-only' does not offer"
    ]


@pytest.mark.parametrize(
    ("driver", "policy"),
    [
        ("rest", "create_and_update"),
        ("rest", "create_only"),
        ("rest", "update_only"),
        ("rest-create-only", "create_only"),
        ("rest-update-only", "update_only"),
    ],
)
def test_driver_offering_every_needed_verb_passes(driver: str, policy: str) -> None:
    check_rules(parse_config(rule_doc(driver, policy)), {"crm": driver, "shop": None})


def test_check_rules_reads_drivers_from_known_connections() -> None:
    # The caller merges the file's connections over the database's; check_rules trusts that map.
    problems = check_problems(RULE % "policy: update_only", {"crm": "rest-create-only", "shop": None})
    assert problems[0].startswith("rules[0].policy: rule 'r': policy 'update_only' needs the 'update' verb")


@pytest.mark.parametrize("driver", ["rest", "rest-create-only", "rest-update-only"])
def test_rest_connection_without_base_url_is_refused(driver: str) -> None:
    text = f"connections:\n  - {{name: shop}}\n  - {{name: crm, driver: {driver}}}\n"
    problems = check_problems(text, {"crm": driver, "shop": None})
    assert problems == [f"connections[1].base_url: connection 'crm' with driver {driver!r} needs a base_url"]


def test_connection_without_writer_needs_no_base_url() -> None:
    check_rules(parse_config("connections:\n  - {name: shop}\n  - {name: files, driver: sftp}\n"), {})


def test_rule_and_connection_problems_together() -> None:
    text = "connections:\n  - {name: crm, driver: rest-create-only}\n" + RULE % "policy: update_only"
    problems = check_problems(text, {"crm": "rest-create-only"})
    assert [p.split(":")[0] for p in problems] == [
        "rules[0].source",
        "rules[0].policy",
        "connections[0].base_url",
    ]


# --- check_rules: saved rules under a connection the file changes --------------------------------

SAVED = SavedRule("contacts-to-crm", "crm", Policy.CREATE_AND_UPDATE)


def saved_problems(text: str, known: dict[str, str | None], saved: list[SavedRule]) -> list[str]:
    """`known` is what the caller passes: the file's drivers already merged over the database's."""
    with pytest.raises(ConfigError) as caught:
        check_rules(parse_config(text), known, saved)
    return caught.value.problems


def test_a_driver_change_that_drops_a_verb_a_saved_rule_needs_is_refused() -> None:
    text = "connections:\n  - {name: shop}\n  - {name: crm, driver: rest-create-only, base_url: 'http://t.test/api'}\n"
    assert saved_problems(text, {"shop": None, "crm": "rest-create-only"}, [SAVED]) == [
        "connections[1].driver: rule 'contacts-to-crm' (saved) targets 'crm', whose driver 'rest-create-only' "
        "does not offer the 'update' verb its policy 'create_and_update' needs"
    ]


def test_redeclaring_a_saved_rules_target_without_a_driver_is_refused() -> None:
    assert saved_problems("connections:\n  - {name: crm}\n", {"shop": None, "crm": None}, [SAVED]) == [
        "connections[0].driver: rule 'contacts-to-crm' (saved) targets 'crm', which the file declares without a "
        "driver, so no writer offers the 'create' and 'update' verbs its policy 'create_and_update' needs"
    ]


def test_a_driver_without_a_writer_under_a_saved_rule_is_refused() -> None:
    text = "connections:\n  - {name: crm, driver: soap}\n"
    (problem,) = saved_problems(text, {"shop": None, "crm": "soap"}, [SAVED])
    assert problem.startswith("connections[0].driver: rule 'contacts-to-crm' (saved) targets 'crm', whose driver")
    assert "'soap' has no registered writer" in problem and "'create' and 'update' verbs" in problem


def test_every_saved_rule_on_the_changed_target_is_named() -> None:
    saved = [SAVED, SavedRule("orders-to-crm", "crm", Policy.UPDATE_ONLY), SavedRule("new", "crm", Policy.CREATE_ONLY)]
    text = "connections:\n  - {name: crm, driver: rest-create-only, base_url: 'http://t.test/api'}\n"
    problems = saved_problems(text, {"shop": None, "crm": "rest-create-only"}, saved)
    assert len(problems) == 2
    assert "'contacts-to-crm' (saved)" in problems[0] and "'orders-to-crm' (saved)" in problems[1]


def test_a_file_that_fixes_the_connection_and_the_rule_together_passes() -> None:
    text = rule_doc("rest-create-only", "create_only").replace("name: r,", "name: contacts-to-crm,")
    check_rules(parse_config(text), {"shop": None, "crm": "rest-create-only"}, [SAVED])


def test_a_saved_rule_whose_target_the_file_leaves_alone_is_not_checked() -> None:
    # The file changes nothing under it; a rule broken by an uninstalled driver fails at run time.
    check_rules(parse_config("connections:\n  - {name: shop}\n"), {"shop": None, "crm": "soap"}, [SAVED])


def test_a_saved_rule_the_file_redeclares_is_checked_once_as_the_files_rule() -> None:
    text = rule_doc("rest-create-only", "create_and_update").replace("name: r,", "name: contacts-to-crm,")
    problems = saved_problems(text, {"shop": None, "crm": "rest-create-only"}, [SAVED])
    assert [p.split(":")[0] for p in problems] == ["rules[0].policy"]


# --- text neither database stores alike ------------------------------------------------------------


NUL = "holds a NUL character (\\u0000), which PostgreSQL cannot store"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (RULE % "enabled: true", None),
        (RULE.replace("domain: contact", 'domain: "con\\0tact"') % "enabled: true", f"rules[0].domain: {NUL}"),
        (RULE % 'fields: {email: "e\\x00"}', f"rules[0].fields.email: {NUL}"),
        (RULE % 'fields: {"e\\0": email}', f"rules[0].fields: a key {NUL}"),
        (
            CONNECTION % 'id_field: "\\ud800"',
            "connections[0].id_field: holds a lone surrogate (\\ud800), which is not valid Unicode",
        ),
        (CONNECTION % 'driver: "rest\\0"', f"connections[0].driver: {NUL}"),
    ],
    ids=["fine", "nul-in-domain", "nul-in-a-field", "nul-in-a-field-key", "surrogate", "nul-in-driver"],
)
def test_a_nul_or_a_lone_surrogate_anywhere_is_refused_by_its_path(text: str, problem: str | None) -> None:
    """YAML's "\\0" and "\\ud800" escapes: PostgreSQL refuses a NUL (SQLite would keep it), and a lone
    surrogate cannot be encoded for either; no pattern or length check stops them in a free-text field."""
    if problem is None:
        parse_config(text)
        return
    assert problems_of(text) == [problem]


def test_check_text_refuses_a_config_built_without_the_file() -> None:
    """`apply_config` takes a DeliveryConfig however it was built: it checks the text itself too."""
    config = DeliveryConfig.model_validate(
        {"rules": [{"name": "r", "source": "s", "domain": "a\x00", "target": "t", "collection": "c"}]}
    )
    with pytest.raises(ConfigError) as caught:
        check_text(config)
    assert caught.value.problems == [f"rules[0].domain: {NUL}"]
    check_text(parse_config(EXAMPLE))


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "connections:\n  - {name: shop}\nconnections:\n  - {name: crm}\n",
            "line 3, column 1: the key 'connections' is given twice in one mapping (first at line 1)",
        ),
        ("connections:\n  - {name: shop, name: crm}\n", "the key 'name' is given twice in one mapping"),
        ("rules: []\nconnections: []\nrules: []\n", "the key 'rules' is given twice"),
    ],
    ids=["top-level", "flow-mapping", "rules"],
)
def test_a_key_given_twice_is_refused_naming_it_and_its_line(text: str, problem: str) -> None:
    """Before: PyYAML kept the last value and dropped the first without a word (a second
    `connections:` lost every connection of the first, and apply said "created")."""
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert problem in str(caught.value)


def test_a_merged_key_may_still_be_overridden() -> None:
    text = (
        "connections:\n  - &shop {name: shop}\n"
        "  - <<: *shop\n    name: crm\n    driver: rest\n    base_url: 'http://127.0.0.1:9/api'\n"
    )
    assert [c.name for c in parse_config(text).connections] == ["shop", "crm"]


@pytest.mark.parametrize(
    "collection",
    [
        "contacts",
        "/contacts",  # httpx drops the leading slash: the same path as "contacts"
        "v2/contacts",
        "crm/v3/objects/contacts",
        "a.b_c-d~e",
        "people@x",
        "v1/records:batchCreate",
        "lists/My%20List/items",
        "kunden/bücher",
    ],
)
def test_collections_that_stay_under_the_base_url(collection: str) -> None:
    assert parse_config(rule_with(f"collection: '{collection}'")).rules[0].collection == collection


@pytest.mark.parametrize(
    ("text", "path"),
    [
        (CONNECTION % "driver: rest, base_url: 'http://127.0.0.1:9/api', timeout_seconds: true", "timeout_seconds"),
        (CONNECTION % "breaker: {fail_max: false}", "breaker.fail_max"),
        (RULE % "batch_size: true", "batch_size"),
        (RULE % "retry_schedule_seconds: [60, true]", "retry_schedule_seconds"),
    ],
    ids=["timeout", "breaker", "batch-size", "schedule"],
)
def test_true_or_false_is_not_a_number(text: str, path: str) -> None:
    """Before: lax pydantic read `true` as 1 (`timeout_seconds: true` saved a 1-second timeout)."""
    problems = problems_of(text)
    assert problems[0].endswith(f"{path}: must be a number, not true or false"), problems


# --- aliases, nesting, values a tag cannot build, base URLs (issue #16) -------------------------


def laughs(width: int, depth: int) -> str:
    """The "billion laughs": each anchor a list of `width` aliases of the one before."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * width)}]" for n in range(1, depth)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("text", "where", "anchor"),
    [
        ("a: &a [*a]\n", "line 1, column 8", "a"),
        ("a: &a {b: *a}\n", "line 1, column 11", "a"),
        ("a: &a {<<: *a}\n", "line 1, column 12", "a"),
        ("connections:\n  - &c\n    name: crm\n    breaker: [x, [*c]]\n", "line 4, column 19", "c"),
    ],
    ids=["list", "mapping", "merge", "nested"],
)
def test_a_recursive_alias_is_refused_naming_its_line(text: str, where: str, anchor: str) -> None:
    """Before: a RecursionError traceback (the checks walked a list holding itself)."""
    assert problems_of(text) == [
        f"config: refused at {where}: the alias *{anchor} stands inside the node &{anchor} names: "
        "a recursive alias, which never ends"
    ]


def test_a_billion_laughs_is_refused_at_once_naming_the_alias_past_the_limit() -> None:
    """Before: 9 anchors of 9 aliases each took over two minutes (387 million values, walked by
    every check), then gave one error line per anchor."""
    started = time.monotonic()
    (problem,) = problems_of(laughs(9, 9))
    assert time.monotonic() - started < 2
    assert problem.startswith("config: refused at line 6, column 10: with *l4, aliases repeat more than 100,000 values")


def test_aliases_below_the_limit_still_work() -> None:
    # A thousand rules, each merging one anchored set of defaults: about 17,000 values from aliases.
    rules = "".join(f"  - {{<<: *defaults, name: r{n}}}\n" for n in range(1000))
    text = (
        "connections:\n  - {name: shop}\n  - {name: crm}\nrules:\n"
        "  - &defaults {name: r, source: shop, domain: contact, target: crm, collection: contacts, "
        "batch_size: 10, retry_schedule_seconds: [1, 2, 3]}\n" + rules
    )
    config = parse_config(text)
    assert len(config.rules) == 1001
    assert config.rules[-1].name == "r999" and config.rules[-1].retry_schedule_seconds == [1, 2, 3]
    assert "aliases repeat" in problems_of(laughs(4, 10))[0]  # 4**9 = 262,144 values


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "a: " + "[" * 60 + "]" * 60 + "\n",
            "config: refused at line 1, column 53: mappings and lists nest more than 50",
        ),
        ("a: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", "config: refused at line 1, column 197: mappings and lists"),
        ("a: &a " + "[" * 30 + "]" * 30 + "\nb: " + "[" * 25 + "*a" + "]" * 25 + "\n", "with *a expanded"),
    ],
    ids=["lists", "mappings", "through-an-alias"],
)
def test_nesting_deeper_than_the_limit_is_refused(text: str, problem: str) -> None:
    """Before: a RecursionError traceback from PyYAML's composer, past about 300 levels."""
    (found,) = problems_of(text)
    assert problem in found


def test_nesting_up_to_the_limit_is_read() -> None:
    # The document's mapping, its list of 48 more lists, and the innermost value: 50 levels.
    problems = problems_of("a: " + "[" * 48 + "1" + "]" * 48 + "\n")
    assert problems == ["a: Extra inputs are not permitted"]


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("9" * 5000, "line 2, column 93: an integer of more than 4300 digits cannot be read"),
        ("!!int x", "this value cannot be read as !!int (invalid literal"),
        ("!!float x", "this value cannot be read as !!float (could not convert"),
        ("!!bool x", "this value cannot be read as !!bool"),
        ("!!timestamp x", "this value cannot be read as !!timestamp"),
        ("2001-13-45", "this value cannot be read as !!timestamp (month must be in 1..12)"),
    ],
    ids=["huge-int", "int", "float", "bool", "timestamp", "no-such-date"],
)
def test_a_value_its_tag_cannot_build_is_refused_at_its_place(value: str, problem: str) -> None:
    """Before: a ValueError, KeyError or AttributeError traceback from PyYAML's constructor."""
    (found,) = problems_of(RULE % f"batch_size: {value}")
    assert found.startswith("config: not valid YAML at line 2, column"), found
    assert problem in found


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("a: !!map [a]\n", "line 1, column 4: expected a mapping node, but found sequence"),
        ("a: !!map x\n", "line 1, column 4: expected a mapping node, but found scalar"),
    ],
)
def test_a_mapping_tag_on_something_else_is_refused(text: str, problem: str) -> None:
    """Before: a TypeError traceback from the check for a key given twice, which took every
    node tagged as a mapping for one (found by tests/acceptance/test_cli_fuzz.py)."""
    assert problems_of(text) == [f"config: not valid YAML at {problem}"]


def test_a_control_character_is_refused_on_one_line_naming_its_line_and_column() -> None:
    """Before: PyYAML's two-line message counting characters from the start of the file."""
    assert problems_of("connections:\n  - {name: crm\x01}\n") == [
        "config: not valid YAML at line 2, column 15: the character U+0001 (special characters are not allowed)"
    ]


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://127.0.0.1:99999/api", "has port 99999, outside 1 to 65535"),
        ("http://127.0.0.1:0/api", "has port 0, outside 1 to 65535"),
        ("http://[::1/api", "httpx cannot read it as a URL (Invalid port: ':1')"),
        ("http://x:80:80/", "httpx cannot read it as a URL (Invalid port: '80:80')"),
        ("http://xn--/api", "httpx cannot read it as a URL"),
        ("http://user:s3cr3t@xn--/api", "httpx cannot read it as a URL"),
        ("http:///api", "names no host"),
        ("http://:80/api", "names no host"),
        ("http://user@/api", "names no host"),
        ("http://x/api?key=1", "must hold no query"),
        ("http://x/api#top", "must hold no query"),
        ("http://x?", "must hold no query"),
    ],
)
def test_a_base_url_the_writer_cannot_send_to_is_refused(url: str, problem: str) -> None:
    """Before: saved, and every chain to the target failed at connect time (or the query and
    fragment garbled every request's path)."""
    (found,) = problems_of(CONNECTION % f"driver: rest, base_url: '{url}'")
    assert found.startswith(f"connections[0].base_url: {problem}"), found
    assert "s3cr3t" not in found  # a URL's password is never repeated


@pytest.mark.parametrize(
    "url",
    ["http://[::1]:8900/api", "https://crm.example:443/", "http://é.example/api", "http://u:p@crm.example/api"],
)
def test_base_urls_a_client_can_use_are_kept_as_written(url: str) -> None:
    assert parse_config(CONNECTION % f"base_url: '{url}'").connections[0].base_url == url
