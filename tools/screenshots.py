"""`make screenshots`: the pictures of docs/operator-guide.md, taken from the real Prefect UI.

    python -m tools.screenshots [--out docs/img] [--budget-ms 10000] [--keep]

What it does, in a temporary working directory (nothing of the checkout's own `delivery.db` or
Prefect home is touched):

1. two sandbox targets on free ports: one healthy, one down (every write answers 503);
2. `delivery apply` of three rules: `contacts-to-crm` (healthy target, `max_attempts: 1`, and two
   records too large for the target, so it catches up with two parked), `orders-to-erp` (the target
   that is down: its breaker opens mid-chain) and `companies-to-billing` (its target names a
   `token_secret` block nobody created: it fails `MissingCredential`), and `delivery mirror load`;
3. `delivery serve` on a free port (its own local Prefect server), as an operator starts it;
4. through the served deployments, as the UI's "Run" would: one `deliver-rule` chain per rule, a
   dry-run `delivery-requeue` of the parked contacts, then one `delivery-tick` (it starts a chain for
   every rule with something left to do and publishes the `delivery-status` artifact); it waits
   until every run has ended and checks each run ended as its picture says (a picture of the wrong
   thing fails the script);
5. headless Chromium (Debian's `chromium`) photographs the Prefect UI pages into `--out`;
6. SIGTERM to `delivery serve` (it cancels nothing, since nothing runs any more, stops its server
   and exits 0), the sandboxes stop, the working directory is removed (`--keep` keeps it).

Chromium is needed: when it is missing the script installs Debian's package itself if it runs as
root with apt-get, otherwise it says what to install and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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


@dataclass
class Story:
    """What the runs left for the pictures: flow run, artifact and deployment ids."""

    caught_up_run: str = ""
    breaker_run: str = ""
    failed_run: str = ""
    requeue_run: str = ""
    records_artifact: str = ""
    requeue_artifact: str = ""
    status_artifact: str = ""
    requeue_deployment: str = ""
    states: dict[str, tuple[str, str]] = field(default_factory=dict)

    def shots(self) -> list[Shot]:
        # The V2 UI (Prefect 3.9's default for a new browser) is served under /v2.
        run, artifact = "/v2/runs/flow-run/", "/v2/artifacts/artifact/"
        return [
            Shot(
                "runs-list.png",
                "/v2/runs",
                "the flow runs list",
                ("CaughtUp", "BreakerOpen", "MissingCredential"),
                size="1400,2300",
            ),
            Shot("run-caught-up.png", run + self.caught_up_run, "a CaughtUp run", ("CaughtUp", "caught up")),
            Shot("run-breaker-open.png", run + self.breaker_run, "a BreakerOpen run", ("BreakerOpen", "breaker")),
            Shot("run-failed.png", run + self.failed_run, "a Failed run", ("MissingCredential", MISSING_BLOCK)),
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
                "the status artifact",
                ("delivery status",),
                size="2400,700",
            ),
            Shot(
                "requeue-form.png",
                f"/v2/deployments/deployment/{self.requeue_deployment}/run",
                "the delivery-requeue run form",
                ("statuses", "error_contains", "dry_run"),
                size="1400,1250",
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


def config_yaml(healthy_url: str, down_url: str) -> str:
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
            # No Secret block of that name exists: every chain of the rule fails MissingCredential.
            {"name": "billing", "driver": "rest", "base_url": healthy_url, "token_secret": MISSING_BLOCK},
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


def mirror_files(workdir: Path) -> dict[str, Path]:
    """JSONL mirror files per domain: 20 contacts (two too large for the sandbox: 413, parked),
    12 orders, 5 companies."""
    names = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov"]
    contacts = []
    for n in range(20):
        name = f"{names[n % len(names)]} {n + 1}"
        payload: dict[str, Any] = {"email": f"contact{n + 1}@example.com", "full_name": name, "notes": ""}
        if n in (6, 13):
            payload["notes"] = "x" * (1024 * 1024 + 100)  # over the sandbox's 1 MiB body limit
        contacts.append({"id": f"c-{n + 1:03d}", "payload": payload})
    orders = [{"id": f"o-{n + 1:04d}", "payload": {"total": 10 + n, "currency": "EUR"}} for n in range(12)]
    companies = [{"id": f"co-{n + 1}", "payload": {"name": f"Company {n + 1}"}} for n in range(5)]
    files = {}
    for domain, rows in (("contact", contacts), ("order", orders), ("company", companies)):
        path = workdir / f"{domain}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        files[domain] = path
    return files


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


async def drive(story: Story) -> None:
    """The runs the pictures show, each through a served deployment, in the order an operator
    would meet them; every ending checked."""
    from prefect import get_client

    async with get_client() as client:
        # The 5-minute schedule would start a tick in the middle of the story (its chains would
        # supersede ours): the one tick of the story is started below, by hand.
        tick_deployment = await client.read_deployment_by_name("delivery-tick/delivery-tick")
        await client.pause_deployment(tick_deployment.id)
    print("running chains through the served deployments:", flush=True)
    caught_up = await _run("deliver-rule/deliver-rule", {"rule": CAUGHT_UP_RULE})
    _expect(caught_up, "COMPLETED", "CaughtUp", CAUGHT_UP_RULE)
    breaker = await _run("deliver-rule/deliver-rule", {"rule": BREAKER_RULE})
    _expect(breaker, "COMPLETED", "BreakerOpen", BREAKER_RULE)
    failed = await _run("deliver-rule/deliver-rule", {"rule": FAULTY_RULE})
    _expect(failed, "FAILED", "MissingCredential", FAULTY_RULE)
    requeue = await _run(
        "delivery-requeue/delivery-requeue",
        {"rule": CAUGHT_UP_RULE, "statuses": ["exhausted"], "dry_run": True, "by": "screenshots"},
    )
    _expect(requeue, "COMPLETED", "Completed", "delivery-requeue (dry run)")
    tick = await _run("delivery-tick/delivery-tick", {})
    _expect(tick, "COMPLETED", "Completed", "delivery-tick")
    # The tick only starts its chains; the list is photographed once they have all ended.
    deadline = time.monotonic() + RUN_SECONDS
    while await _unfinished_chains():
        if time.monotonic() > deadline:
            raise ScreenshotError("the chains the tick started did not end in time")
        await asyncio.sleep(1)

    story.caught_up_run, story.breaker_run = str(caught_up.id), str(breaker.id)
    story.failed_run, story.requeue_run = str(failed.id), str(requeue.id)
    story.records_artifact = await _artifact_id(f"chain-{CAUGHT_UP_RULE}-records", caught_up.id)
    story.requeue_artifact = await _artifact_id(f"requeue-{CAUGHT_UP_RULE}", requeue.id)
    story.status_artifact = await _artifact_id("delivery-status", tick.id)
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
            dom = rendered_text(chromium, url, shot.size, budget, profile)
            missing = [text for text in shot.shows if text not in dom]
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
        with healthy, down:
            (workdir / "config.yaml").write_text(config_yaml(healthy.url, down.url), encoding="utf-8")
            run_cli(["apply", "config.yaml"], env, workdir)
            for domain, path in mirror_files(workdir).items():
                run_cli(["mirror", "load", "--source", "shop", "--domain", domain, path.name], env, workdir)
            with delivery_serve(env, workdir, port) as ui:
                # This process's Prefect client talks to the served server; set before Prefect is imported.
                os.environ.update({k: env[k] for k in ("PREFECT_HOME", "PREFECT_SERVER_ANALYTICS_ENABLED")})
                os.environ["PREFECT_API_URL"] = f"{ui}/api"
                story = Story()
                asyncio.run(drive(story))
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
