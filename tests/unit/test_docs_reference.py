"""The generated reference pages of the documentation site (docs/reference/) match the code they are
generated from: the configuration models and the `delivery` Typer app. A key, a default, a bound, a
command or an option changed without `make docs-reference` fails here."""

from __future__ import annotations

import pytest

from tools import docs_reference


@pytest.mark.parametrize("page", ["configuration.md", "cli.md"])
def test_the_committed_reference_pages_are_up_to_date(page: str) -> None:
    generated = {path.name: text for path, text in docs_reference.pages().items()}
    committed = (docs_reference.ROOT / "docs" / "reference" / page).read_text(encoding="utf-8")
    assert committed == generated[page], f"docs/reference/{page} is out of date: run make docs-reference"


def test_every_key_of_the_models_has_words_and_no_words_are_stale() -> None:
    assert docs_reference.missing_descriptions() == [], "add them to tools/docs_reference.py DESCRIPTIONS"
    assert docs_reference.stale_descriptions() == []


def test_the_configuration_page_shows_every_key_with_its_default_and_bounds() -> None:
    page = docs_reference.configuration_page()
    for model, _, _ in docs_reference.CONFIG_MODELS:
        for name in model.model_fields:
            assert f"| `{name}` |" in page, (model.__name__, name)
    row = next(line for line in page.splitlines() if line.startswith("| `batch_size` |"))
    assert "`100`" in row and "≥ 1; ≤ 10,000" in row
    assert "`DELIVERY_BATCH_TIMEOUT_SECONDS` | number | `600` | ≥ 1; ≤ 86,400" in page


def test_a_new_key_without_words_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(docs_reference.DESCRIPTIONS, "RuleConfig.batch_size")
    assert docs_reference.missing_descriptions() == ["RuleConfig.batch_size"]
    monkeypatch.setitem(docs_reference.DESCRIPTIONS, "RuleConfig.gone", "a key the model no longer has")
    assert docs_reference.stale_descriptions() == ["RuleConfig.gone"]


def test_the_cli_page_shows_every_command_and_option() -> None:
    import typer.main

    from flows.cli import app

    page = docs_reference.cli_page(app)
    root = typer.main.get_command(app)
    for path, command in docs_reference._commands(root, ["delivery"]):
        assert f"## `{' '.join(path)}`" in page, path
        for option in docs_reference._options(command):
            assert f"`{option.opts[0]}`" in page, (path, option.opts)
    assert "| `--limit` | integer, 1 to 10,000 | `50` |" in page  # delivery preview --limit
