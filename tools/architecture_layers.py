"""The layers picture of docs/architecture.md, drawn from the import contracts that `lint-imports` checks.

Every `layers` contract of `[tool.importlinter]` in pyproject.toml is drawn top to bottom, each layer
with its modules as the contract names them and a few words on what it holds (`WORDS` below). The
picture sits between two markers in docs/architecture.md; `python -m tools.architecture_layers`
rewrites it, `--check` only says whether it is out of date. tests/unit/test_architecture_layers.py
compares the committed picture with a fresh one, so a contract changed without the doc (or the doc
without the contract) fails `make test-fast` with the command to run.

The words are keyed by one module of the layer they describe. A layer with no words is drawn
without them; words for a module no contract names any longer are an error, so a module renamed in
a contract cannot leave its layer's words behind unnoticed.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
DOC = ROOT / "docs" / "architecture.md"
COMMAND = ".venv/bin/python -m tools.architecture_layers"
BEGIN = f"<!-- layers: generated from pyproject.toml's [tool.importlinter] by `{COMMAND}`; edit the contracts -->"
END = "<!-- /layers -->"

#: What each layer holds, keyed by the full name of one of its modules.
WORDS: dict[str, str] = {
    # the packages
    "playground": "the demo and the sandbox target: tries the product; the product never imports it",
    "flows": "Prefect wiring: the CLI, serve, the tick, deliver-rule and the other flows",
    "delivery": "the engine, no Prefect",
    # flows
    "flows.console": "the `delivery` console script: takes the stop signals on `delivery serve`, then runs the CLI",
    "flows.cli": "the command line: a module per concern (configure, runs, records, services, output)",
    "flows.serve": "`delivery serve` and the warm worker that runs many chains in one process",
    "flows.tick": "the tick: which rules get a deliver-rule run",
    "flows.deliver_rule": "the flows: deliver-rule, requeue, preview, record, the alert automations",
    "flows.chain_reporting": "what a deliver-rule run tells the operator, under the flow it serves",
    "flows.lock": "their helpers: the rule lock, events, artifacts, secrets, stop signals, metrics",
    "flows.prefect_private": "the only module that touches Prefect internals",
    # delivery
    "delivery.apply": "the services the command line and the flows call (`reports`: what the runs publish)",
    "delivery.status": "what `delivery status` shows; `listings` reads its connection overview",
    "delivery.chain": "one chain of a rule; when a phase is done; what a chain's end says of its rule",
    "delivery.job": "the job, its senders (one chosen in `senders`), its settles and workers, the step that sends",
    "delivery.breaker": "the target controls: the breaker, the liveness windows, the traffic control",
    "delivery.pybreaker_private": "the only module that reads pybreaker's private names",
    "delivery.config": "the operator's files: the YAML configuration, the mirror's input",
    "delivery.store": "writers talk to a target over httpx; the store holds all the SQL",
    "delivery.decisions": "pure decisions, storable text, budgets, request templates, what a writer heard",
    "delivery.db": "engines and migrations",
    "delivery.settings": "the environment; the shipped data files",
    "delivery.domain": "plain values",
}

LEGEND = (
    "Each layer imports only the layers under it. In a layer, `a | b`: independent, neither imports\n"
    "the other; `a : b`: they may import each other; `(a)`: a module that may be absent."
)


@dataclass(frozen=True)
class Layers:
    """One `layers` contract: its name, the container its modules are in (none for packages), the
    layers top to bottom, and the imports it lets through."""

    name: str
    container: str | None
    layers: list[str]
    exhaustive: bool
    ignored: list[str]


def contracts(pyproject: Path = PYPROJECT) -> list[Layers]:
    config: dict[str, Any] = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    found = []
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["type"] != "layers":
            continue
        containers = contract.get("containers", [])
        if len(containers) > 1:
            raise ValueError(f"{contract['name']!r}: a contract with several containers is not drawn yet")
        found.append(
            Layers(
                name=contract["name"],
                container=containers[0] if containers else None,
                layers=list(contract["layers"]),
                exhaustive=bool(contract.get("exhaustive", False)),
                ignored=list(contract.get("ignore_imports", [])),
            )
        )
    return found


def modules(layer: str) -> list[str]:
    """The module names of a layer as written, without separators and the parentheses of an optional one."""
    return [name.strip("() ") for name in re.split(r"[|:]", layer) if name.strip()]


def _full(contract: Layers, module: str) -> str:
    return f"{contract.container}.{module}" if contract.container else module


def _words(contract: Layers, layer: str) -> str | None:
    said = [WORDS[_full(contract, m)] for m in modules(layer) if _full(contract, m) in WORDS]
    if len(said) > 1:
        raise ValueError(f"two modules of the layer {layer!r} have words in WORDS: keep one")
    return said[0] if said else None


def stale_words(found: list[Layers] | None = None) -> list[str]:
    """Keys of `WORDS` that name a module no layers contract names."""
    named = {
        _full(c, m) for c in (found if found is not None else contracts()) for layer in c.layers for m in modules(layer)
    }
    return sorted(set(WORDS) - named)


def picture(found: list[Layers] | None = None) -> str:
    """The markdown between the markers: a legend, then each contract drawn top to bottom."""
    parts = [LEGEND]
    for contract in found if found is not None else contracts():
        where = f"the modules of `{contract.container}`" if contract.container else "the packages"
        heading = f"**{contract.name}** ({where}, top to bottom"
        heading += (
            "; exhaustive: a new module fails `lint-imports` until it is placed in a layer)"
            if contract.exhaustive
            else ")"
        )
        lines = []
        for i, layer in enumerate(contract.layers):
            if i:
                lines += ["    │", "    ▼"]
            lines.append(f"  {' '.join(layer.split())}")
            words = _words(contract, layer)
            if words:
                lines.append(f"      {words}")
        block = [heading, "", "```", *lines, "```"]
        if contract.ignored:
            block += ["", "Imports this contract lets through: " + ", ".join(f"`{i}`" for i in contract.ignored) + "."]
        parts.append("\n".join(block))
    return "\n\n".join(parts)


def section(text: str) -> str:
    """What stands between the markers in `text`; ValueError when they are missing."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{DOC.relative_to(ROOT)} must hold the markers once each, in order: {BEGIN} ... {END}")
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip("\n")


def regenerated(text: str, found: list[Layers] | None = None) -> str:
    """`text` with the picture between its markers drawn anew."""
    section(text)  # the markers are there
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{picture(found)}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the picture is out of date")
    args = parser.parse_args(argv)
    stale = stale_words()
    if stale:
        print(f"tools/architecture_layers.py WORDS names modules no layers contract names: {stale}", file=sys.stderr)
        return 1
    text = DOC.read_text(encoding="utf-8")
    new = regenerated(text)
    if new == text:
        return 0
    if args.check:
        print(f"{DOC.relative_to(ROOT)}: the layers picture is out of date; run {COMMAND}", file=sys.stderr)
        return 1
    DOC.write_text(new, encoding="utf-8")
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
