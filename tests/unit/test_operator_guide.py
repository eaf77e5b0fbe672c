"""docs/operator-guide.md shows only pictures that exist, and `make screenshots` takes every one of
them (tools/screenshots.py imports without Prefect, Chromium or a server)."""

from __future__ import annotations

import re
from pathlib import Path

from tools import screenshots

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "operator-guide.md"


def _images() -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", GUIDE.read_text(encoding="utf-8"))


def test_the_guide_shows_only_pictures_that_exist() -> None:
    images = _images()
    assert len(images) >= 7
    missing = [image for image in images if not (GUIDE.parent / image).is_file()]
    assert missing == []


def test_the_script_takes_every_picture_the_guide_shows() -> None:
    taken = {f"img/{shot.file}" for shot in screenshots.Story().shots()}
    assert set(_images()) == taken
    assert GUIDE.parent / "img" == screenshots.DEFAULT_OUT


def test_each_picture_is_checked_for_what_its_caption_says() -> None:
    for shot in screenshots.Story().shots():
        assert shot.shows, shot.file
