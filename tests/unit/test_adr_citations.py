"""Every `ADR-NNNN` the code and the docs cite is a record in docs/adr/, and the index lists each
record: the decisions stay in the repository, next to the code that carries them out."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ADR_DIR = ROOT / "docs" / "adr"
CITED = re.compile(r"\bADR-(\d{4})\b")
SEARCHED = ("delivery", "flows", "playground", "docs", "tests", "bench", "tools")


def _citations() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    files = [ROOT / "README.md"]
    for folder in SEARCHED:
        files += [*(ROOT / folder).rglob("*.py"), *(ROOT / folder).rglob("*.md")]
    for path in files:
        for number in CITED.findall(path.read_text(encoding="utf-8")):
            found.setdefault(number, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_cited_adr_is_a_record_in_the_repo() -> None:
    records = {path.name[:4] for path in ADR_DIR.glob("[0-9][0-9][0-9][0-9]-*.md")}
    citations = _citations()
    assert {"0015", "0021", "0029"} <= set(citations)
    missing = {number: sorted(where) for number, where in citations.items() if number not in records}
    assert not missing, f"cited but no docs/adr/NNNN-*.md: {missing}"


def test_the_index_lists_every_record() -> None:
    index = (ADR_DIR / "README.md").read_text(encoding="utf-8")
    for path in ADR_DIR.glob("[0-9][0-9][0-9][0-9]-*.md"):
        assert f"]({path.name})" in index, path.name
        text = path.read_text(encoding="utf-8")
        assert text.startswith(f"# ADR-{path.name[:4]}: "), path.name
        for part in ("## Context", "## Decision", "## Consequences"):
            assert part in text, (path.name, part)
