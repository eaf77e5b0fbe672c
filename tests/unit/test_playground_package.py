"""The playground ships its sample data inside the package, so `delivery demo` finds it in an
installed wheel as well as in a checkout, and from any working directory."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import resources
from pathlib import Path

import playground
from delivery.config import parse_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_demo_config_is_package_data_and_parses() -> None:
    config = resources.files("playground") / "examples" / "demo-config.yaml"
    assert config.is_file()
    parsed = parse_config(config.read_text(encoding="utf-8"))
    assert [rule.name for rule in parsed.rules] == ["contacts-to-crm"]
    # Inside the package directory, which the wheel ships whole: not beside it in the checkout.
    assert Path(playground.__file__).parent in Path(str(config)).parents


def test_the_wheel_ships_the_playground_package() -> None:
    build = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "playground" in build["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]


def test_the_demo_finds_its_config_from_another_working_directory(tmp_path: Path) -> None:
    probe = "from playground.demo import DEMO_CONFIG; print(DEMO_CONFIG.is_file())"
    answer = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True
    )
    assert answer.stdout.strip() == "True"
