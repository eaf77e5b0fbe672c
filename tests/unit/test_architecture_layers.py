"""The layers picture of docs/architecture.md is the import contracts of pyproject.toml, drawn by
tools/architecture_layers.py: a layer moved, split or renamed in one and not the other fails here."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tools import architecture_layers as layers


def test_the_committed_picture_is_the_contracts_drawn() -> None:
    committed = layers.DOC.read_text(encoding="utf-8")
    assert layers.section(committed) == layers.picture(), (
        f"docs/architecture.md's layers picture and pyproject.toml's contracts disagree: run {layers.COMMAND}"
    )


def test_every_layer_of_every_contract_is_drawn_in_its_order() -> None:
    drawn = layers.section(layers.DOC.read_text(encoding="utf-8")).splitlines()
    found = layers.contracts()
    assert [c.container for c in found] == [None, "flows", "delivery"]
    for contract in found:
        at = [drawn.index(f"  {' '.join(layer.split())}") for layer in contract.layers]
        assert at == sorted(at), contract.name


def test_no_words_for_a_module_the_contracts_no_longer_name() -> None:
    assert layers.stale_words() == [], "remove them from tools/architecture_layers.py WORDS, or rename them"


def test_a_contract_changed_without_the_doc_is_caught(tmp_path: Path) -> None:
    """Two layers of the delivery contract swapped in a copy of pyproject.toml: the picture drawn
    from it is not the committed one, and `--check` would say so."""
    pyproject = tmp_path / "pyproject.toml"
    text = layers.PYPROJECT.read_text(encoding="utf-8")
    assert '    "config | mirror_file",\n    "writers | store",\n' in text
    pyproject.write_text(
        text.replace(
            '    "config | mirror_file",\n    "writers | store",\n',
            '    "writers | store",\n    "config | mirror_file",\n',
        ),
        encoding="utf-8",
    )
    committed = layers.DOC.read_text(encoding="utf-8")
    assert layers.section(committed) != layers.picture(layers.contracts(pyproject))
    assert layers.regenerated(committed, layers.contracts(pyproject)) != committed


def test_a_module_renamed_in_a_contract_leaves_stale_words() -> None:
    found = layers.contracts()
    renamed = [
        replace(c, layers=[layer.replace("chain |", "chains |") for layer in c.layers])
        if c.container == "delivery"
        else c
        for c in found
    ]
    assert layers.stale_words(renamed) == ["delivery.chain"]


def test_the_check_fails_with_the_command_when_the_doc_was_edited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "architecture.md"
    doc.write_text(
        layers.DOC.read_text(encoding="utf-8").replace("  writers | store\n", "  store | writers\n"), encoding="utf-8"
    )
    monkeypatch.setattr(layers, "DOC", doc)
    monkeypatch.setattr(layers, "ROOT", tmp_path)
    assert layers.main(["--check"]) == 1
    assert layers.COMMAND in capsys.readouterr().err
    assert layers.main([]) == 0  # redraws it
    assert layers.section(doc.read_text(encoding="utf-8")) == layers.picture()
    assert layers.main(["--check"]) == 0


def test_missing_markers_are_an_error() -> None:
    with pytest.raises(ValueError, match="markers"):
        layers.section("# Architecture\n\nno picture here\n")
