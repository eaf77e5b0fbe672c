"""The save-time checks and the batch verbs: a policy's verb is found in a single or a batch
capability, and a connection's `batch` paths must name verbs its driver offers in batches."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from delivery.config import check_rules, parse_config
from delivery.domain import Policy, SavedRule
from delivery.errors import ConfigError
from delivery.writers.base import (
    CreateItem,
    CreateResult,
    CreatesMany,
    UpdateItem,
    UpdateResult,
    Updates,
    UpdatesMany,
    Writer,
)
from delivery.writers.registry import register_writer, reset_registry


class BatchCreatesOnly(Writer, CreatesMany):
    """Creates, but only many at a time."""

    def create_many(self, items: Sequence[CreateItem]) -> list[CreateResult]:
        return [f"id-{n}" for n, _ in enumerate(items)]


class BatchUpdatesOnly(Writer, UpdatesMany):
    """Updates, but only many at a time."""

    def update_many(self, items: Sequence[UpdateItem]) -> list[UpdateResult]:
        return [None for _ in items]


class NoVerbs(Writer):
    pass


@pytest.fixture(autouse=True)
def drivers() -> Iterator[None]:
    reset_registry()
    register_writer("bulk-create", BatchCreatesOnly)
    register_writer("bulk-update", BatchUpdatesOnly)
    register_writer("nothing", NoVerbs)
    yield
    reset_registry()


def doc(driver: str | None, policy: str = "create_only", batch: str | None = None) -> str:
    fields = ["name: crm, base_url: 'http://t.test/api'"]
    if driver is not None:
        fields.append(f"driver: {driver}")
    if batch is not None:
        fields.append(f"batch: {batch}")
    return (
        "connections:\n"
        f"  - {{{', '.join(fields)}}}\n"
        "  - {name: shop}\n"
        "rules:\n"
        f"  - {{name: r, source: shop, domain: contact, target: crm, collection: contacts, policy: {policy}}}\n"
    )


def problems(text: str, saved: list[SavedRule] | None = None) -> list[str]:
    config = parse_config(text)
    known = {c.name: c.driver for c in config.connections}
    with pytest.raises(ConfigError) as caught:
        check_rules(config, known, saved or [])
    return caught.value.problems


def passes(text: str) -> None:
    config = parse_config(text)
    check_rules(config, {c.name: c.driver for c in config.connections})


# --- a policy's verbs, single or batch -----------------------------------------------------------


@pytest.mark.parametrize(
    ("driver", "policy"), [("bulk-create", "create_only"), ("bulk-update", "update_only")], ids=["create", "update"]
)
def test_a_verb_offered_only_in_batches_satisfies_the_policy(driver: str, policy: str) -> None:
    passes(doc(driver, policy))


def test_a_policy_needing_update_is_refused_without_a_single_or_batch_update() -> None:
    assert problems(doc("bulk-create", "create_and_update")) == [
        "rules[0].policy: rule 'r': policy 'create_and_update' needs the 'update' verb, "
        "which driver 'bulk-create' does not offer"
    ]
    assert problems(doc("nothing", "update_only")) == [
        "rules[0].policy: rule 'r': policy 'update_only' needs the 'update' verb, which driver 'nothing' does not offer"
    ]


def test_a_saved_rule_finds_its_verbs_in_batch_capabilities_too() -> None:
    text = "connections:\n  - {name: crm, driver: bulk-update}\n"
    update_only = SavedRule(name="old", target="crm", policy=Policy.UPDATE_ONLY)
    check_rules(parse_config(text), {"crm": "bulk-update"}, [update_only])
    both = SavedRule(name="old", target="crm", policy=Policy.CREATE_AND_UPDATE)
    assert problems(text, [both]) == [
        "connections[0].driver: rule 'old' (saved) targets 'crm', whose driver 'bulk-update' does not offer "
        "the 'create' verb its policy 'create_and_update' needs"
    ]


# --- a connection's batch paths -----------------------------------------------------------------


@pytest.mark.parametrize(
    "batch",
    [
        "{create_path: contacts/batch}",
        "{update_path: contacts/batch}",
        "{create_path: contacts/batch, update_path: contacts/batch-update, max_items: 500}",
    ],
)
def test_the_rest_driver_takes_batch_paths(batch: str) -> None:
    passes(doc("rest", "create_and_update", batch))


def test_rest_create_only_takes_a_batch_create_path_but_no_update_path() -> None:
    passes(doc("rest-create-only", "create_only", "{create_path: contacts/batch}"))
    assert problems(doc("rest-create-only", "create_only", "{create_path: c/batch, update_path: c/batch}")) == [
        "connections[0].batch.update_path: connection 'crm' names a batch update path, "
        "but driver 'rest-create-only' does not offer the 'update' verb at all: remove batch.update_path"
    ]


def test_rest_update_only_takes_no_batch_create_path() -> None:
    passes(doc("rest-update-only", "update_only", "{update_path: contacts/batch}"))
    assert problems(doc("rest-update-only", "update_only", "{create_path: contacts/batch}")) == [
        "connections[0].batch.create_path: connection 'crm' names a batch create path, "
        "but driver 'rest-update-only' does not offer the 'create' verb at all: remove batch.create_path"
    ]


def test_a_driver_with_no_batch_verbs_is_refused_its_batch_paths() -> None:
    found = problems(doc("nothing", "create_only", "{create_path: c/batch, update_path: c/batch}"))
    assert found[0].startswith("rules[0].policy: ")
    assert found[1:] == [
        "connections[0].batch.create_path: connection 'crm' names a batch create path, "
        "but driver 'nothing' does not offer the 'create' verb at all: remove batch.create_path",
        "connections[0].batch.update_path: connection 'crm' names a batch update path, "
        "but driver 'nothing' does not offer the 'update' verb at all: remove batch.update_path",
    ]


class Mixed(Writer, CreatesMany, Updates):
    """Creates in batches, updates one record at a time."""

    def create_many(self, items: Sequence[CreateItem]) -> list[CreateResult]:
        return ["x" for _ in items]

    def update(self, remote_id: str, body: Mapping[str, Any]) -> None:
        pass


def test_a_verb_offered_singly_but_not_in_batches_is_named_so() -> None:
    register_writer("mixed", Mixed)
    passes(doc("mixed", "create_and_update", "{create_path: c/batch}"))
    assert problems(doc("mixed", "create_and_update", "{update_path: c/batch}")) == [
        "connections[0].batch.update_path: connection 'crm' names a batch update path, "
        "but driver 'mixed' offers no batch 'update' verb: remove batch.update_path"
    ]


def test_a_connection_without_a_driver_is_refused_its_batch_paths() -> None:
    text = (
        "connections:\n"
        "  - {name: shop, batch: {create_path: c/batch}}\n"
        "  - {name: crm, driver: rest, base_url: 'http://t.test/api'}\n"
    )
    assert problems(text) == [
        "connections[0].batch.create_path: connection 'shop' names a batch create path, but has no driver to send to it"
    ]


def test_an_unregistered_driver_is_not_judged_on_its_batch_paths() -> None:
    # Its writer may be installed later; a rule targeting it is refused for the driver already.
    text = "connections:\n  - {name: crm, driver: soap, batch: {create_path: c/batch}}\n"
    check_rules(parse_config(text), {"crm": "soap"})


def test_problems_of_paths_and_policies_are_reported_together() -> None:
    found = problems(doc("rest-create-only", "update_only", "{update_path: c/batch}"))
    assert [problem.split(":")[0] for problem in found] == ["rules[0].policy", "connections[0].batch.update_path"]
