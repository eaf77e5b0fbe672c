"""The data files the engine ships, found one way: `importlib.resources`, from the package that owns them.

A wheel carries them inside that package (`[tool.hatch.build.targets.wheel.force-include]` in
pyproject.toml: `migrations/` as `delivery/_migrations`, `automations/` as `flows/automations`). A
checkout, and the editable install `make install` makes, keeps them at the top of the repository,
beside the package, where `prefect.yaml`, Alembic and the docs name them.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def package_data(package: str, installed_as: str, checkout_name: str) -> Path:
    """The directory of data owned by `package`: `installed_as` inside it in a wheel, else
    `checkout_name` beside it (a checkout). The engine's packages are plain directories, never
    zipped, so the resource is a real path that Alembic and `glob` can use."""
    root = Path(str(resources.files(package)))
    for candidate in (root / installed_as, root.parent / checkout_name):
        if candidate.is_dir():
            return candidate
    raise RuntimeError(
        f"the data directory {installed_as!r} of the {package} package was not found "
        f"(neither inside the package nor as {checkout_name!r} beside it)"
    )
