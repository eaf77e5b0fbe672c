"""`make screenshots`: the pictures of docs/operator-guide.md, taken from the real Prefect UI.

    python -m tools.screenshots [--out docs/img] [--budget-ms 10000] [--keep]

What it does, in a temporary working directory (nothing of the checkout's own `delivery.db` or
Prefect home is touched):

1. three sandbox targets on free ports: one healthy, one down (every write answers 503), and the
   billing target, which takes only the bearer token `BILLING_TOKEN`;
2. `delivery apply` of three rules: `contacts-to-crm` (healthy target, `max_attempts: 1`, and two
   records too large for the target, so it catches up with two parked), `orders-to-erp` (the target
   that is down: its breaker opens mid-chain) and `companies-to-billing` (its target names a
   `token_secret` block nobody has created yet: it fails `MissingCredential`), and `delivery mirror
   load`;
3. `delivery serve` on a free port (its own local Prefect server), as an operator starts it;
4. through the served deployments, as the UI's "Run" would: one `deliver-rule` chain per rule, a
   dry-run `delivery-requeue` of the parked contacts, then one `delivery-tick` (it starts a chain for
   every rule with something left to do and publishes the `delivery-status` artifact);
5. the operator's fix and Retry: the Secret block `billing-token` is created (holding the billing
   target's token), and the tick's failed `companies-to-billing` chain is retried as the UI's Retry
   does it (`POST /api/flow_runs/ID/set_state`, Scheduled "AwaitingRetry"): the served runner runs it
   again, a fresh chain that catches up;
6. a few contacts change (`delivery mirror load`: one new, one renamed, one edited and then put
   back as it was delivered, one of the parked two edited), a `delivery-preview` run of
   `contacts-to-crm` (its `preview-contacts-to-crm` artifact: create, update, suppress, skip), then
   a second `contacts-to-crm` chain that parks nothing: the rule's standing
   `parked-contacts-to-crm` artifact, refreshed at that chain's end, still lists the two records
   parked by the first;
   the script waits until every run has ended and checks each run ended, and is tagged, as its
   picture says (a picture of the wrong thing fails the script);
7. headless Chromium (Debian's `chromium`) photographs the Prefect UI pages into `--out`, each
   checked first for the words it must show (and, for the runs list filtered on Failed, the words it
   must not);
8. SIGTERM to `delivery serve` (it cancels nothing, since nothing runs any more, stops its server
   and exits 0), the sandboxes stop, the working directory is removed (`--keep` keeps it).

Chromium is needed: when it is missing the script installs Debian's package itself if it runs as
root with apt-get, otherwise it says what to install and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import html
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "docs" / "img"

CAUGHT_UP_RULE = "contacts-to-crm"
BREAKER_RULE = "orders-to-erp"
FAULTY_RULE = "companies-to-billing"
MISSING_BLOCK = "billing-token"
#: The billing sandbox's bearer token: what the operator puts into the Secret block before the Retry.
BILLING_TOKEN = "billing-sandbox-token-not-a-secret"
#: The small contact loaded before the second chain of contacts-to-crm (the one that parks nothing).
LATE_CONTACT = "c-021"
#: The two contacts too large for the sandbox: the first chain parks them.
PARKED_CONTACTS = ("c-007", "c-014")

SERVE_START_SECONDS = 240.0
RUN_SECONDS = 300.0
SERVE_STOP_SECONDS = 120.0
#: A page whose PNG is smaller than this is (nearly) one colour: the UI had not rendered yet.
BLANK_PNG_BYTES = 25_000


class ScreenshotError(RuntimeError):
    """Something the pictures depend on did not happen; the message says what."""


@dataclass(frozen=True)
class Shot:
    """One picture: the file it goes to, the UI page (a path under the server's address), and
    texts the rendered page must hold (so a loading or error page is never kept as the picture)."""

    file: str
    path: str
    what: str
    shows: tuple[str, ...]
    #: Chromium's window: wide enough for a table's columns, tall enough for the list under a chart.
    size: str = "1400,900"
    #: Texts the rendered page must not hold (a filtered list showing what the filter leaves out).
    hides: tuple[str, ...] = ()


@dataclass
class Story:
    """What the runs left for the pictures: flow run, artifact and deployment ids."""

    caught_up_run: str = ""
    breaker_run: str = ""
    failed_run: str = ""
    retried_run: str = ""
    requeue_run: str = ""
    records_artifact: str = ""
    requeue_artifact: str = ""
    status_artifact: str = ""
    preview_artifact: str = ""
    parked_artifact: str = ""
    requeue_deployment: str = ""
    states: dict[str, tuple[str, str]] = field(default_factory=dict)

    def shots(self) -> list[Shot]:
        # The V2 UI (Prefect 3.9's default for a new browser) is served under /v2.
        run, artifact = "/v2/runs/flow-run/", "/v2/artifacts/artifact/"
        return [
            Shot(
                "runs-list.png",
                "/v2/runs",
                "the flow runs list, subflows named after their rule",
                (
                    "CaughtUp",
                    "BreakerOpen",
                    "Failed",
                    "fault:MissingCredential",
                    f"{CAUGHT_UP_RULE} · drain",
                    f"{CAUGHT_UP_RULE} · scan",
                ),
                size="1400,2450",
            ),
            Shot(
                "runs-failed.png",
                # The runs page keeps its filters in the address: `state` holds state names.
                "/v2/runs?state=Failed",
                "the runs list filtered on Failed",
                ("Failed", f"{FAULTY_RULE} -> billing", "fault:MissingCredential"),
                size="1400,900",
                hides=("CaughtUp", "BreakerOpen", f"{CAUGHT_UP_RULE} -> crm"),
            ),
            Shot("run-caught-up.png", run + self.caught_up_run, "a CaughtUp run", ("CaughtUp", "caught up")),
            Shot(
                "run-subflows.png",
                run + self.caught_up_run + "?tab=SubflowRuns",
                "a chain's subflows, named after its rule",
                (f"{CAUGHT_UP_RULE} · drain", f"{CAUGHT_UP_RULE} · scan"),
            ),
            Shot("run-breaker-open.png", run + self.breaker_run, "a BreakerOpen run", ("BreakerOpen", "breaker")),
            Shot(
                "run-failed.png",
                run + self.failed_run,
                "a Failed run",
                ("Failed", "fault:MissingCredential", "MissingCredential:", MISSING_BLOCK),
            ),
            Shot(
                "run-retried.png",
                run + self.retried_run,
                "a failed run retried after its fix, caught up",
                ("CaughtUp", "MissingCredential", "this run is a retry", "Finished in state CaughtUp"),
                size="1400,1250",
            ),
            Shot(
                "artifact-records.png",
                artifact + self.records_artifact,
                "the records artifact",
                ("delivery requeue",),
                size="1800,900",
            ),
            Shot(
                "artifact-status.png",
                artifact + self.status_artifact,
                "the status artifact, once the tick's chains have ended",
                ("Delivery status", "BreakerOpen", "Failed: MissingCredential", "CaughtUp"),
                size="2400,650",
            ),
            Shot(
                "artifact-parked.png",
                artifact + self.parked_artifact,
                "a rule's parked set after a chain that parked nothing",
                ("2 records parked", *PARKED_CONTACTS, "delivery requeue"),
                size="1800,1300",
            ),
            Shot(
                "artifact-preview.png",
                artifact + self.preview_artifact,
                "a preview of the next chain",
                ("create", "update", "suppress", "skip", LATE_CONTACT, "nothing was sent"),
                size="1800,750",
            ),
            Shot(
                "requeue-form.png",
                f"/v2/deployments/deployment/{self.requeue_deployment}/run",
                "the delivery-requeue run form",
                ("statuses", "exhausted", "remote_gone", "error_contains", "dry_run", "Which rows to take"),
                size="1400,1400",
            ),
            Shot(
                "requeue-artifact.png",
                artifact + self.requeue_artifact,
                "a requeue run's artifact",
                ("would requeue",),
                size="1800,800",
            ),
        ]


# -- the machinery -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise ScreenshotError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)
    return value


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        if found := shutil.which(name):
            return found
    return None


def ensure_chromium() -> str:
    """Debian's chromium: found, or installed when we may (root with apt-get), or exit 2 saying how."""
    found = find_chromium()
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("chromium is missing: installing Debian's package (apt-get install -y chromium)", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], check=True, env=env, stdout=subprocess.DEVNULL)
        found = find_chromium()
        if found:
            return found
    sys.stderr.write(
        "error: the screenshots need a headless Chromium. On Debian/Ubuntu install it with\n"
        "    sudo apt-get install -y chromium\n"
        "and run `make screenshots` again.\n"
    )
    raise SystemExit(2)


def delivery_cli() -> str:
    """The `delivery` console script of the interpreter running us (the checkout's .venv)."""
    beside = Path(sys.executable).parent / "delivery"
    return str(beside) if beside.exists() else (shutil.which("delivery") or "delivery")


def run_cli(args: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run([delivery_cli(), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise ScreenshotError(f"delivery {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
    return done.stdout


# -- the world the pictures show ---------------------------------------------------------------


def config_yaml(healthy_url: str, down_url: str, billing_url: str) -> str:
    """Three rules that end three ways (see the module docstring)."""
    config = {
        "connections": [
            {"name": "shop"},
            {"name": "crm", "driver": "rest", "base_url": healthy_url},
            {
                "name": "erp",
                "driver": "rest",
                "base_url": down_url,
                "timeout_seconds": 5,
                # Open after three 503s, and stay open through the whole session: the tick's chain
                # then finds it open before sending anything.
                "breaker": {"fail_max": 3, "reset_seconds": 900},
            },
            # No Secret block of that name exists yet: every chain of the rule fails MissingCredential
            # until the story creates it (holding BILLING_TOKEN, which the billing sandbox asks for).
            {"name": "billing", "driver": "rest", "base_url": billing_url, "token_secret": MISSING_BLOCK},
        ],
        "rules": [
            {
                "name": CAUGHT_UP_RULE,
                "source": "shop",
                "domain": "contact",
                "target": "crm",
                "collection": "contacts",
                "fields": {"email": "email", "name": "full_name", "notes": "notes"},
                # A record the target refuses is parked at once, so one chain shows parked records.
                "max_attempts": 1,
            },
            {"name": BREAKER_RULE, "source": "shop", "domain": "order", "target": "erp", "collection": "orders"},
            {
                "name": FAULTY_RULE,
                "source": "shop",
                "domain": "company",
                "target": "billing",
                "collection": "companies",
            },
        ],
    }
    # JSON is YAML: no need for a YAML writer here.
    return json.dumps(config, indent=2)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _contact(n: int) -> dict[str, Any]:
    """Contact number n (1-20) as first loaded; c-007 and c-014 are over the sandbox's 1 MiB body
    limit (413: parked at once, with max_attempts 1)."""
    names = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov"]
    payload: dict[str, Any] = {
        "email": f"contact{n}@example.com",
        "full_name": f"{names[(n - 1) % 5]} {n}",
        "notes": "",
    }
    if f"c-{n:03d}" in PARKED_CONTACTS:
        payload["notes"] = "x" * (1024 * 1024 + 100)
    return {"id": f"c-{n:03d}", "payload": payload}


def mirror_files(workdir: Path) -> dict[str, Path]:
    """JSONL mirror files per domain: 20 contacts (two too large for the sandbox: 413, parked),
    12 orders, 5 companies."""
    contacts = [_contact(n) for n in range(1, 21)]
    orders = [{"id": f"o-{n + 1:04d}", "payload": {"total": 10 + n, "currency": "EUR"}} for n in range(12)]
    companies = [{"id": f"co-{n + 1}", "payload": {"name": f"Company {n + 1}"}} for n in range(5)]
    return {
        domain: _write_jsonl(workdir / f"{domain}.jsonl", rows)
        for domain, rows in (("contact", contacts), ("order", orders), ("company", companies))
    }


def late_contact_files(workdir: Path) -> list[Path]:
    """Contacts changed after the first chain, loaded in this order, so that the preview shows each
    action: c-003 edited, then back as it was delivered (suppress); c-021 new (create); c-002 renamed
    (update); c-007, parked, edited and still too large (skip: only a requeue puts it back). The
    chain after them parks nothing."""
    edited = _contact(3)
    edited["payload"] = {**edited["payload"], "full_name": "Edsger W. Dijkstra 3"}
    renamed = _contact(2)
    renamed["payload"] = {**renamed["payload"], "full_name": "Alan M. Turing 2"}
    parked = _contact(7)
    parked["payload"] = {**parked["payload"], "notes": "y" * (1024 * 1024 + 100)}
    new = {"id": LATE_CONTACT, "payload": {"email": "contact21@example.com", "full_name": "Alan Kay 21", "notes": ""}}
    return [
        _write_jsonl(workdir / "contact-edit.jsonl", [edited]),
        _write_jsonl(workdir / "contact-late.jsonl", [_contact(3), new, renamed, parked]),
    ]


# -- delivery serve ----------------------------------------------------------------------------


@contextlib.contextmanager
def delivery_serve(env: dict[str, str], workdir: Path, port: int) -> Iterator[str]:
    """`delivery serve --port PORT` until the block ends; yields the UI's address. Stopped with
    SIGTERM (a second one, its forced stop, if the first is not done in time); it must exit 0."""
    log_path = workdir / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [delivery_cli(), "serve", "--port", str(port)],
            env=env,
            cwd=workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own session: a Ctrl-C on `make screenshots` reaches us, and we stop it in order.
            start_new_session=True,
        )
    ui = f"http://127.0.0.1:{port}"

    def serving() -> bool:
        if process.poll() is not None:
            raise ScreenshotError(f"delivery serve exited {process.returncode}:\n{log_path.read_text()[-3000:]}")
        return "serving deliver-rule" in log_path.read_text(errors="replace")

    try:
        wait_for(serving, SERVE_START_SECONDS, "delivery serve to serve its deployments")
        print(f"delivery serve is up: {ui}", flush=True)
        yield ui
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=SERVE_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGTERM)  # the second signal: serve kills what is left
                process.wait(timeout=60)
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:]
        print(f"delivery serve exited {process.returncode} ({tail[0] if tail else 'no output'})", flush=True)
        if process.returncode != 0:
            raise ScreenshotError(f"delivery serve exited {process.returncode} on SIGTERM (log: {log_path})")


# -- runs through the served deployments -------------------------------------------------------


async def _run(deployment: str, parameters: dict[str, Any]) -> Any:
    from prefect.deployments import run_deployment

    run = await run_deployment(deployment, parameters=parameters, timeout=RUN_SECONDS, poll_interval=1)  # type: ignore[misc]
    if run.state is None or not run.state.is_final():
        raise ScreenshotError(f"{deployment} {parameters} did not end within {RUN_SECONDS:.0f} s")
    print(f"  {deployment} {json.dumps(parameters)}: {run.state.type.value} {run.state.name!r}", flush=True)
    return run


async def _artifact_id(key: str, flow_run_id: UUID | None = None) -> str:
    """The id of the newest artifact under `key` (of that flow run, when given)."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    of_run = None if flow_run_id is None else ArtifactFilterFlowRunId(any_=[flow_run_id])
    found = ArtifactFilter(key=ArtifactFilterKey(any_=[key]), flow_run_id=of_run)
    async with get_client() as client:
        artifacts = await client.read_artifacts(artifact_filter=found, sort=ArtifactSort.CREATED_DESC, limit=1)
    if not artifacts:
        raise ScreenshotError(f"no artifact {key!r}" + (f" on flow run {flow_run_id}" if flow_run_id else ""))
    return str(artifacts[0].id)


async def _unfinished_chains() -> int:
    """`deliver-rule` runs due by now that have not ended (the tick's, once it has started them)."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterExpectedStartTime,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    live = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.CANCELLING, StateType.PAUSED]
    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["deliver-rule"])),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=live)),
                expected_start_time=FlowRunFilterExpectedStartTime(before_=datetime.now(UTC)),
            ),
        )
    return len(runs)


def _expect(run: Any, state_type: str, name: str, what: str) -> None:
    got = (run.state.type.value, run.state.name)
    if got != (state_type, name):
        raise ScreenshotError(f"{what}: expected {state_type} {name!r}, the run ended {got[0]} {got[1]!r}")


def _expect_tags(run: Any, present: tuple[str, ...], absent_prefixes: tuple[str, ...], what: str) -> None:
    tags = set(run.tags)
    missing = [tag for tag in present if tag not in tags]
    unwanted = sorted(tag for tag in tags if tag.startswith(absent_prefixes))
    if missing or unwanted:
        raise ScreenshotError(f"{what}: tags {sorted(tags)}; expected {missing or ''} absent {unwanted or ''}")


async def _wait_for_chains() -> None:
    """Until every `deliver-rule` run due by now has ended (those a tick started, for instance)."""
    deadline = time.monotonic() + RUN_SECONDS
    while await _unfinished_chains():
        if time.monotonic() > deadline:
            raise ScreenshotError("the chains the tick started did not end in time")
        await asyncio.sleep(1)


async def _latest_chain(rule: str, state_type: str) -> Any:
    """The newest `deliver-rule` run of `rule` (by its `rule:` tag) in that state type."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["deliver-rule"])),
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[f"rule:{rule}"]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType(state_type)])),
            ),
            sort=FlowRunSort.START_TIME_DESC,
            limit=1,
        )
    if not runs:
        raise ScreenshotError(f"no {state_type} deliver-rule run of {rule}")
    return runs[0]


async def _retry_as_the_ui_does(run_id: UUID) -> Any:
    """The UI's Retry on a finished run: its state set to Scheduled "AwaitingRetry" (not forced);
    the served deployment's runner then runs it again. Returns the run once it has ended again."""
    import httpx
    from prefect import get_client

    body = {"state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"}, "force": False}
    async with httpx.AsyncClient(timeout=30) as http:
        answer = await http.post(f"{os.environ['PREFECT_API_URL']}/flow_runs/{run_id}/set_state", json=body)
    if answer.status_code >= 300 or answer.json().get("status") != "ACCEPT":
        said = f"{answer.status_code} {answer.text[:500]}"
        raise ScreenshotError(f"Retry of flow run {run_id}: the server answered {said}")
    deadline = time.monotonic() + RUN_SECONDS
    async with get_client() as client:
        while True:
            run = await client.read_flow_run(run_id)
            if run.state is not None and run.state.is_final() and run.run_count >= 2:
                break
            if time.monotonic() > deadline:
                raise ScreenshotError(f"the retried run {run_id} did not end within {RUN_SECONDS:.0f} s")
            await asyncio.sleep(1)
    print(f"  retried {run.name} (run count {run.run_count}): {run.state.type.value} {run.state.name!r}", flush=True)
    return run


async def drive(story: Story, env: dict[str, str], workdir: Path) -> None:
    """The runs the pictures show, each through a served deployment, in the order an operator
    would meet them; every ending checked."""
    from prefect import get_client
    from prefect.blocks.system import Secret

    async with get_client() as client:
        # The 5-minute schedule would start a tick in the middle of the story (its chains would
        # supersede ours): the one tick of the story is started below, by hand.
        tick_deployment = await client.read_deployment_by_name("delivery-tick/delivery-tick")
        await client.pause_deployment(tick_deployment.id)
    print("running chains through the served deployments:", flush=True)
    caught_up = await _run("deliver-rule/deliver-rule", {"rule": CAUGHT_UP_RULE})
    _expect(caught_up, "COMPLETED", "CaughtUp", CAUGHT_UP_RULE)
    _expect_tags(caught_up, ("ended:caught_up", "parked:2"), ("fault:",), CAUGHT_UP_RULE)
    breaker = await _run("deliver-rule/deliver-rule", {"rule": BREAKER_RULE})
    _expect(breaker, "COMPLETED", "BreakerOpen", BREAKER_RULE)
    failed = await _run("deliver-rule/deliver-rule", {"rule": FAULTY_RULE})
    _expect(failed, "FAILED", "Failed", FAULTY_RULE)
    _expect_tags(failed, ("fault:MissingCredential",), (), FAULTY_RULE)
    if not (failed.state.message or "").startswith("MissingCredential: "):
        raise ScreenshotError(f"{FAULTY_RULE}: the Failed state's message is {failed.state.message!r}")
    requeue = await _run(
        "delivery-requeue/delivery-requeue",
        {"rule": CAUGHT_UP_RULE, "statuses": ["exhausted"], "dry_run": True, "by": "screenshots"},
    )
    _expect(requeue, "COMPLETED", "Completed", "delivery-requeue (dry run)")
    tick = await _run("delivery-tick/delivery-tick", {})
    _expect(tick, "COMPLETED", "Completed", "delivery-tick")
    # The tick only starts its chains; the story goes on once they have all ended. Each chain's end
    # refreshes the delivery-status artifact: the newest now shows the three endings.
    await _wait_for_chains()
    story.status_artifact = await _artifact_id("delivery-status")

    # The operator's fix: the Secret block the billing connection names, then Retry on the tick's
    # failed chain of the rule (the hand-started one stays Failed, for its own picture).
    ticks_failed = await _latest_chain(FAULTY_RULE, "FAILED")
    if ticks_failed.id == failed.id:
        raise ScreenshotError(f"the tick started no chain of {FAULTY_RULE}")
    await Secret(value=BILLING_TOKEN).asave(MISSING_BLOCK, overwrite=True)
    retried = await _retry_as_the_ui_does(ticks_failed.id)
    _expect(retried, "COMPLETED", "CaughtUp", f"{FAULTY_RULE} retried")

    # A preview of the next chain of contacts-to-crm once a few contacts have changed, then that
    # chain: it parks nothing, and the rule's parked set still holds the first chain's two.
    for path in late_contact_files(workdir):
        run_cli(["mirror", "load", "--source", "shop", "--domain", "contact", path.name], env, workdir)
    preview = await _run("delivery-preview/delivery-preview", {"rule": CAUGHT_UP_RULE})
    _expect(preview, "COMPLETED", "Completed", "delivery-preview")
    second = await _run("deliver-rule/deliver-rule", {"rule": CAUGHT_UP_RULE})
    _expect(second, "COMPLETED", "CaughtUp", f"{CAUGHT_UP_RULE} (second chain)")
    _expect_tags(second, ("ended:caught_up",), ("parked:", "failed:", "fault:"), f"{CAUGHT_UP_RULE} (second chain)")
    await _wait_for_chains()

    story.caught_up_run, story.breaker_run = str(caught_up.id), str(breaker.id)
    story.failed_run, story.requeue_run = str(failed.id), str(requeue.id)
    story.retried_run = str(retried.id)
    story.records_artifact = await _artifact_id(f"chain-{CAUGHT_UP_RULE}-records", caught_up.id)
    story.requeue_artifact = await _artifact_id(f"requeue-dry-run-{CAUGHT_UP_RULE}", requeue.id)
    story.preview_artifact = await _artifact_id(f"preview-{CAUGHT_UP_RULE}", preview.id)
    # The rule's standing parked set, as the second chain's end refreshed it.
    story.parked_artifact = await _artifact_id(f"parked-{CAUGHT_UP_RULE}", second.id)
    async with get_client() as client:
        deployment = await client.read_deployment_by_name("delivery-requeue/delivery-requeue")
    story.requeue_deployment = str(deployment.id)


# -- the pictures ------------------------------------------------------------------------------


def _chromium(chromium: str, url: str, size: str, budget_ms: int, profile: Path, *action: str) -> str:
    done = subprocess.run(
        [
            chromium,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",  # Chromium refuses to run as root with its sandbox
            "--hide-scrollbars",
            "--no-first-run",
            f"--user-data-dir={profile}",
            f"--window-size={size}",
            # The UI is a single-page app: give its requests and rendering time before the shot.
            f"--virtual-time-budget={budget_ms}",
            *action,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    return done.stdout


def rendered_text(chromium: str, url: str, size: str, budget_ms: int, profile: Path) -> str:
    """The page's DOM once rendered (what the screenshot of it will show)."""
    return _chromium(chromium, url, size, budget_ms, profile, "--dump-dom")


def photograph(chromium: str, url: str, size: str, out: Path, budget_ms: int, profile: Path) -> int:
    """One headless Chromium screenshot of `url`; returns the PNG's size in bytes."""
    out.unlink(missing_ok=True)
    _chromium(chromium, url, size, budget_ms, profile, f"--screenshot={out}")
    return out.stat().st_size if out.exists() else 0


def take_all(chromium: str, ui: str, story: Story, out_dir: Path, budget_ms: int, workdir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    taken = []
    for shot in story.shots():
        target = out_dir / shot.file
        budget = budget_ms
        # A page still loading is one flat colour (a small PNG): try again with more time.
        profile, url = workdir / "chromium-profile", ui + shot.path
        missing: list[str] = []
        for _ in range(3):
            dom = html.unescape(rendered_text(chromium, url, shot.size, budget, profile))
            missing = [text for text in shot.shows if text not in dom]
            shown = [text for text in shot.hides if text in dom]
            if shown:
                raise ScreenshotError(f"{shot.file} ({shot.what}, {url}): the page shows {shown}, which it must not")
            if not missing and photograph(chromium, url, shot.size, target, budget, profile) >= BLANK_PNG_BYTES:
                break
            budget *= 2
        else:
            raise ScreenshotError(f"{shot.file} ({shot.what}, {url}): the page never showed {missing or 'anything'}")
        print(f"  {target.relative_to(REPO) if target.is_relative_to(REPO) else target}: {shot.what}", flush=True)
        taken.append(target)
    return taken


# -- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.screenshots", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the PNGs go (default docs/img)")
    parser.add_argument("--budget-ms", type=int, default=10_000, help="Chromium's virtual time budget per page")
    parser.add_argument("--keep", action="store_true", help="keep the temporary working directory")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chromium = ensure_chromium()
    from playground.sandbox import SandboxServer, SandboxSettings

    workdir = Path(tempfile.mkdtemp(prefix="delivery-screenshots-"))
    port = free_port()
    env = {
        **os.environ,
        "DELIVERY_DATABASE_URL": f"sqlite:///{workdir / 'delivery.db'}",
        "PREFECT_HOME": str(workdir / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # No marketing banner in the pictures.
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
        # The runner looks for scheduled runs every 2 s instead of 10: the session takes less long.
        "PREFECT_RUNNER_POLL_FREQUENCY": "2",
    }
    env.pop("PREFECT_API_URL", None)  # `delivery serve` starts its own server
    try:
        healthy = SandboxServer(SandboxSettings(port=0))
        down = SandboxServer(SandboxSettings(port=0, fail_rate=1.0, seed=7))
        billing = SandboxServer(SandboxSettings(port=0, token=BILLING_TOKEN))
        with healthy, down, billing:
            config = config_yaml(healthy.url, down.url, billing.url)
            (workdir / "config.yaml").write_text(config, encoding="utf-8")
            run_cli(["apply", "config.yaml"], env, workdir)
            for domain, path in mirror_files(workdir).items():
                run_cli(["mirror", "load", "--source", "shop", "--domain", domain, path.name], env, workdir)
            with delivery_serve(env, workdir, port) as ui:
                # This process's Prefect client talks to the served server; set before Prefect is imported.
                os.environ.update({k: env[k] for k in ("PREFECT_HOME", "PREFECT_SERVER_ANALYTICS_ENABLED")})
                os.environ["PREFECT_API_URL"] = f"{ui}/api"
                story = Story()
                asyncio.run(drive(story, env, workdir))
                print("photographing the Prefect UI (headless Chromium):", flush=True)
                take_all(chromium, ui, story, args.out, args.budget_ms, workdir)
    except ScreenshotError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    finally:
        if args.keep:
            print(f"kept the working directory {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print("done; every process this script started has stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
