"""The data files ship with the packages and load through importlib.resources, the one way the
engine finds them (delivery/package_data.py): the alert automations and the Alembic scripts."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
import yaml

from delivery.db import migrations_dir
from delivery.package_data import package_data
from flows.automations import AUTOMATIONS_DIR, automation_files

AUTOMATIONS = {
    "breaker-closed.yaml",
    "breaker-opened.yaml",
    "rule-failing.yaml",
    "rule-recovered.yaml",
    "tick-failed.yaml",
    "tick-missing.yaml",
}


def test_the_automations_load_through_importlib_resources() -> None:
    directory = package_data("flows", "automations", "automations")
    assert directory == AUTOMATIONS_DIR
    assert {path.name for path in automation_files(directory)} >= AUTOMATIONS
    for path in automation_files(directory):
        document = yaml.safe_load(path.read_text())
        assert isinstance(document, dict) and document.get("name"), path


def test_the_migrations_load_through_importlib_resources() -> None:
    assert (migrations_dir() / "env.py").is_file()


def test_inside_the_package_wins_over_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a wheel: the copy inside the package is the one used."""
    package = tmp_path / "pkg"
    (package / "_data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (tmp_path / "data").mkdir()
    monkeypatch.setattr(resources, "files", lambda name: package)
    assert package_data("pkg", "_data", "data") == package / "_data"
    (package / "_data").rmdir()
    assert package_data("pkg", "_data", "data") == tmp_path / "data"
    (tmp_path / "data").rmdir()
    with pytest.raises(RuntimeError, match="'_data' of the pkg package was not found"):
        package_data("pkg", "_data", "data")
