"""The alerts: Prefect automations kept as files in `automations/*.yaml`, one automation per file,
that `delivery alerts install --block TYPE/NAME` creates or updates in place (by name).

Each file is an automation as Prefect loads it (`prefect automation create --from-file` takes one as
well once it names a block): the notification block of its send-notification actions is the one
thing it leaves out, filled in at install time. What they watch:

- a rule starts failing / recovers (`delivery.rule.failing` / `.recovered`, from `deliver-rule`),
- a target's breaker opens / closes again (`delivery.breaker.opened` / `.closed`, flows/breaker_events.py),
- no `delivery-tick` run Completed for 15 minutes (a proactive trigger whose window restarts at
  every completed tick; `--tick-missing-minutes` installs it with another window), a tick Failed or
  Crashed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import yaml
from prefect import get_client
from prefect.client.orchestration import PrefectClient
from prefect.events.schemas.automations import Automation, AutomationCore
from prefect.exceptions import ObjectNotFound
from pydantic import ValidationError

from delivery.errors import InputError
from delivery.package_data import package_data

#: The automation files: `flows/automations` in an installed wheel, `automations/` in a checkout.
AUTOMATIONS_DIR = package_data("flows", "automations", "automations")

#: The file of the "no tick completed" alert, whose window `--tick-missing-minutes` sets.
TICK_MISSING_FILE = "tick-missing.yaml"
#: Prefect refuses a proactive trigger's window under 10 seconds; a week is the longest we take.
TICK_MISSING_SHORTEST = timedelta(seconds=10)
TICK_MISSING_LONGEST = timedelta(days=7)

#: Names an automation was installed under before. An install renames the automation it finds
#: under one (in place: same id and history) instead of leaving it beside the new one; the old
#: "no tick completed for 15 minutes" never fired in time (see automations/tick-missing.yaml).
FORMER_NAMES: dict[str, tuple[str, ...]] = {
    "delivery: no tick completed": ("delivery: no tick completed for 15 minutes",),
}


@dataclass(frozen=True)
class Installed:
    name: str
    file: str
    action: str  # "created" or "updated"
    id: str
    enabled: bool


def automation_files(directory: Path = AUTOMATIONS_DIR) -> list[Path]:
    files = sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")])
    if not files:
        raise InputError(f"--dir: no automation files (*.yaml) in {directory}")
    return files


def tick_missing_window(minutes: float) -> timedelta:
    """`--tick-missing-minutes` as the window of the no-tick alert: 10 seconds (Prefect's shortest
    for an alert on an event that does not come) to a week."""
    shortest, longest = TICK_MISSING_SHORTEST.total_seconds() / 60, TICK_MISSING_LONGEST.total_seconds() / 60
    if not (math.isfinite(minutes) and shortest <= minutes <= longest):
        raise InputError(
            f"--tick-missing-minutes: {minutes:g} is not a window Prefect can watch; "
            "give 0.17 (10 seconds) to 10080 (a week)"
        )
    return timedelta(minutes=minutes)


def load_automation(
    path: Path, block_document_id: UUID, enabled: bool, within: timedelta | None = None
) -> AutomationCore:
    """One file as the automation to install: its notification actions sent through
    `block_document_id`, enabled or paused, and its trigger's window `within` when given."""
    try:
        document: Any = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise InputError(f"{path}: cannot read an automation from it: {exc}") from exc
    if not isinstance(document, dict):
        raise InputError(f"{path}: an automation file holds one automation (a mapping)")
    document = {**document, "enabled": enabled}
    if within is not None:
        trigger = document.get("trigger")
        if not isinstance(trigger, dict):
            raise InputError(f"{path}: an automation file holds one trigger (a mapping)")
        document["trigger"] = {**trigger, "within": within.total_seconds()}
    document["actions"] = [
        {**action, "block_document_id": str(block_document_id)}
        if isinstance(action, dict) and action.get("type") == "send-notification"
        else action
        for action in document.get("actions") or []
    ]
    try:
        return AutomationCore.model_validate(document)
    except ValidationError as exc:
        raise InputError(f"{path}: not an automation Prefect accepts: {exc}") from exc


def automations(
    block_document_id: UUID,
    enabled: bool,
    directory: Path = AUTOMATIONS_DIR,
    tick_missing_within: timedelta | None = None,
) -> list[tuple[Path, AutomationCore]]:
    """Every automation file, loaded; refused as a whole (nothing installed) if one is bad.
    `tick_missing_within` is the window of the no-tick alert (default: the file's, 15 minutes)."""
    files = automation_files(directory)
    if tick_missing_within is not None and TICK_MISSING_FILE not in {path.name for path in files}:
        raise InputError(f"--tick-missing-minutes: no {TICK_MISSING_FILE} in {directory}")
    loaded = [
        (
            path,
            load_automation(
                path, block_document_id, enabled, tick_missing_within if path.name == TICK_MISSING_FILE else None
            ),
        )
        for path in files
    ]
    names = [automation.name for _, automation in loaded]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise InputError(f"--dir: two automation files share the name {', '.join(map(repr, twice))}")
    return loaded


async def _by_name_oldest_first(client: PrefectClient, name: str) -> list[Automation]:
    """The automations named `name` (or one of its former names), the oldest first: the one an
    install keeps (the client's own lookup by name orders by last update, which would keep a
    duplicate made yesterday by hand)."""
    response = await client.request(
        "POST",
        "/automations/filter",
        json={"sort": "CREATED_DESC", "automations": {"name": {"any_": [name, *FORMER_NAMES.get(name, ())]}}},
    )
    return list(reversed(Automation.model_validate_list(response.json())))


async def install(
    block: str, enabled: bool, directory: Path = AUTOMATIONS_DIR, tick_missing_within: timedelta | None = None
) -> list[Installed]:
    """Create every automation of `directory`, or update in place the one of the same name, for
    notification block `TYPE/NAME` (e.g. slack-webhook/ops). Updating in place keeps each
    automation's id and history and never leaves two of one name; a duplicate made some other way
    (by hand, by an older install) is removed. `tick_missing_within`: the no-tick alert's window
    (default: the file's, 15 minutes)."""
    block_type, _, name = block.partition("/")
    if not block_type or not name:
        raise InputError(f"--block: {block!r} must be BLOCK-TYPE/NAME, e.g. slack-webhook/delivery-alerts")
    async with get_client() as client:
        try:
            document = await client.read_block_document_by_name(name, block_type)
        except ObjectNotFound as exc:
            raise InputError(f"--block: no notification block {block!r} exists; create it in the UI first") from exc
        wanted = automations(document.id, enabled, directory, tick_missing_within)
        done = []
        for path, automation in wanted:
            existing = await _by_name_oldest_first(client, automation.name)
            if existing:
                keep, *extra = existing
                await client.update_automation(keep.id, automation)
                for duplicate in extra:
                    await client.delete_automation(duplicate.id)
                done.append(Installed(automation.name, path.name, "updated", str(keep.id), enabled))
            else:
                made = await client.create_automation(automation)
                done.append(Installed(automation.name, path.name, "created", str(made), enabled))
    return done
