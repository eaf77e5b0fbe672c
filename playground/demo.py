"""`delivery demo`: a stranger's first ten minutes, in under two.

Starts the sandbox target, applies the sample configuration shipped with this package
(`playground/examples/demo-config.yaml`), loads a deterministic sample mirror, and runs chains
through the real `deliver-rule` flow: a first delivery, changes (updates and suppressions), faults
(failed and parked records, a breaker opening) and recovery (due retries drained). Everything it
starts it stops; its database is a SQLite file in its work directory.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from delivery import db
from delivery.apply import apply_config
from delivery.clock import utcnow
from delivery.config import parse_config
from delivery.domain import LedgerStatus
from delivery.mirror_file import read_mirror_file
from delivery.store import catalog, ledger
from delivery.store.mirror import load_records
from playground.sandbox import SandboxServer, SandboxSettings

RULE = "contacts-to-crm"
TOKEN = "demo-token-not-a-secret"
#: The sample configuration, package data of `playground`: found the same way in a checkout and in
#: an installed wheel, never through the working directory.
DEMO_CONFIG = resources.files("playground") / "examples" / "demo-config.yaml"

FIRST = [
    "Ada",
    "Grace",
    "Alan",
    "Edsger",
    "Barbara",
    "Donald",
    "Frances",
    "Ken",
    "Margaret",
    "Dennis",
    "Radia",
    "Leslie",
]
LAST = ["Lovelace", "Hopper", "Turing", "Dijkstra", "Liskov", "Knuth", "Allen", "Thompson", "Hamilton", "Ritchie"]
COMPANIES = ["Analytical Engines", "Cobol Works", "Bletchley Labs", "Semaphore & Co", "Mesa Systems", "Unix Guild"]


def contacts(count: int, seed: int = 7) -> Iterator[dict[str, Any]]:
    """A deterministic, realistic-looking sample: the same records on every machine."""
    rng = random.Random(seed)
    for n in range(1, count + 1):
        first, last = rng.choice(FIRST), rng.choice(LAST)
        yield {
            "id": f"contact-{n:05d}",
            "payload": {
                "email": f"{first}.{last}.{n}@example.com".lower(),
                "full_name": f"{first} {last}",
                "company": rng.choice(COMPANIES),
                "phone": f"+44 20 {rng.randrange(1000, 9999)} {rng.randrange(1000, 9999)}",
                "notes": "",
                "last_seen_page": f"/products/{rng.randrange(1, 500)}",  # not mapped: changes are suppressed
            },
        }


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return path


class Demo:
    def __init__(self, workdir: Path, records: int, console: Console) -> None:
        self.workdir = workdir
        self.records = records
        self.console = console
        self.sample = list(contacts(records))

    # -- steps --------------------------------------------------------------------------------

    def run(self) -> dict[str, int]:
        from flows.deliver_rule import run_now

        self.run_now = run_now
        started = time.monotonic()
        if self.workdir.exists():
            shutil.rmtree(self.workdir)
        self.workdir.mkdir(parents=True)
        url = f"sqlite:///{self.workdir / 'delivery.db'}"
        os.environ[db.DATABASE_URL_ENV] = url
        os.environ["DEMO_CRM_TOKEN"] = TOKEN
        self.engine = db.shared_engine(url)
        os.environ["DEMO_OAUTH_CLIENT_ID"] = OAUTH_CLIENT_ID
        os.environ["DEMO_OAUTH_CLIENT_SECRET"] = OAUTH_CLIENT_SECRET
        settings = SandboxSettings(
            port=0,
            token=TOKEN,
            seed=42,
            oauth2_client_id=OAUTH_CLIENT_ID,
            oauth2_client_secret=OAUTH_CLIENT_SECRET,
            token_lifetime_seconds=OAUTH_TOKEN_SECONDS,
        )
        with SandboxServer(settings) as sandbox:
            self.sandbox = sandbox
            self._step("1. configuration", self._configure)
            self._step("2. first delivery", self._first_delivery)
            self._step("3. changes: updates and suppressions", self._changes)
            self._step("4. faults: failed, parked and a breaker opening", self._faults)
            self._step("5. recovery: due retries drained first", self._recovery)
            self._step("6. traffic control: a target with a rate budget", self._rate_limited)
            self._step("7. a target that wants OAuth2 tokens that expire", self._oauth2)
            self._step("8. deletes: propagated, and a guard that holds", self._deletes)
        counts = self._summary(time.monotonic() - started)
        return counts

    def _step(self, title: str, body: Callable[[], None]) -> None:
        self.console.rule(f"[bold]{title}")
        body()

    def _configure(self) -> None:
        config = yaml.safe_load(DEMO_CONFIG.read_text(encoding="utf-8"))
        for connection in config["connections"]:
            if connection["name"] == "crm":
                connection["base_url"] = self.sandbox.url
        with self.engine.begin() as conn:
            report = apply_config(conn, parse_config(yaml.safe_dump(config)))
        self.console.print(f"applied playground/examples/demo-config.yaml: {', '.join(report.created)}")
        self.console.print(f"sandbox target listening on {self.sandbox.url}")
        path = _write(self.workdir / "contacts.jsonl", self.sample)
        self._load(path)

    def _load(self, path: Path) -> None:
        with self.engine.begin() as conn:
            report = load_records(conn, "shop", "contact", read_mirror_file(path))
        self.console.print(
            f"mirror load {path.name}: {report.inserted} new, {report.changed} changed, {report.unchanged} unchanged"
        )

    def _chain(self, label: str, name: str = RULE) -> dict[str, Any]:
        """Run one chain of rule `name` through the flow, with a progress bar fed by the ledger as it fills."""
        with self.engine.connect() as conn:
            rule = catalog.get_rule(conn, name)
        since = utcnow()
        done = threading.Event()
        with Progress(
            TextColumn(label),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
        ) as progress:
            bar = progress.add_task(label, total=None)

            def watch() -> None:
                while not done.wait(0.2):
                    with self.engine.connect() as conn:
                        progress.update(bar, completed=ledger.settled_since(conn, rule.id, since))

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            try:
                result = self.run_now(name)
            finally:
                done.set()
                watcher.join()
        counts = {k: v for k, v in result["counts"].items() if v}
        self.console.print(
            f"{label}: [bold]{result['state']}[/bold] ended by {result['ended_by']}"
            + (f" ({result['message']})" if result["ended_by"] != "caught_up" else "")
            + f"; drained {self._nonzero(result['drained'])}, scanned {self._nonzero(result['scanned'])}"
        )
        return {**result, "nonzero": counts}

    @staticmethod
    def _nonzero(counts: dict[str, int]) -> str:
        return ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "nothing"

    def _first_delivery(self) -> None:
        self._chain("deliver-rule")
        self.console.print(f"the sandbox now holds {len(self._api('GET', 'contacts'))} contacts")
        self._chain("run again (caught up, sends nothing)")

    def _changes(self) -> None:
        rng = random.Random(11)
        changed = []
        for record in rng.sample(self.sample, k=max(self.records // 10, 2)):
            record["payload"]["full_name"] += " Jr."
            changed.append(record)
        for record in rng.sample([r for r in self.sample if r not in changed], k=max(self.records // 15, 2)):
            record["payload"]["last_seen_page"] = "/checkout"  # unmapped: nothing to send
            changed.append(record)
        self._load(_write(self.workdir / "changes.jsonl", changed))
        self._chain("deliver-rule")

    def _faults(self) -> None:
        rng = random.Random(23)
        rows_by_id = self._ledger_by_id()
        # Somebody deleted a few contacts in the CRM on purpose: their next update finds them gone.
        gone = rng.sample([r for r in self.sample if rows_by_id[r["id"]]["remote_id"]], k=3)
        for record in gone:
            self._api("DELETE", f"contacts/{rows_by_id[record['id']]['remote_id']}")
            record["payload"]["phone"] = "+44 20 0000 0000"
        # A few records the target refuses (too large for it): they fail, then park as exhausted.
        refused = rng.sample([r for r in self.sample if r not in gone], k=3)
        for record in refused:
            record["payload"]["notes"] = "x" * (1024 * 1024 + 10)
        self.console.print("3 contacts were deleted in the CRM, 3 others grew too large for it")
        self._load(_write(self.workdir / "parked.jsonl", gone + refused))
        self._chain("deliver-rule")

        wobbly = rng.sample([r for r in self.sample if r not in gone + refused], k=max(self.records // 10, 5))
        for record in wobbly:
            record["payload"]["phone"] = "+44 20 1111 1111"
        self._load(_write(self.workdir / "wobbly.jsonl", wobbly))
        self._api("PUT", "_faults", {"fail_rate": 0.2})
        self.console.print("sandbox: 20% of writes now answer 503")
        self._chain("deliver-rule")
        self._api("PUT", "_faults", {"fail_rate": 1.0})
        self.console.print("sandbox: the target is down (every write answers 503); more changes arrive")
        untouched = [r for r in self.sample if r not in gone + refused + wobbly]
        # `--records 20`, the smallest the CLI takes, leaves only 9 untouched contacts.
        more = rng.sample(untouched, k=min(20, len(untouched)))
        for record in more:
            record["payload"]["company"] = "Moved Ltd"
        self._load(_write(self.workdir / "more.jsonl", more))
        time.sleep(2.1)  # let the first retries come due
        self._chain("deliver-rule")
        self._chain("run again while the breaker is open")

    def _recovery(self) -> None:
        self._api("PUT", "_faults", {"fail_rate": 0.0})
        self.console.print("sandbox: healthy again; waiting for the breaker's cooldown and the retry times")
        time.sleep(3.2)
        self._chain("deliver-rule")
        time.sleep(2.1)
        self._chain("deliver-rule")

    def _rate_limited(self) -> None:
        config = yaml.safe_load(DEMO_CONFIG.read_text(encoding="utf-8"))
        for connection in config["connections"]:
            if connection["name"] == "crm":
                connection["base_url"] = self.sandbox.url
                connection["rate_limit"] = {"per_second": RATE_PER_SECOND}
        with self.engine.begin() as conn:
            apply_config(conn, parse_config(yaml.safe_dump(config)))
        self.console.print(
            f"crm now takes at most {RATE_PER_SECOND} requests a second from every rule and worker together "
            f"(rate_limit: {{per_second: {RATE_PER_SECOND}}})"
        )
        rng = random.Random(31)
        rows_by_id = self._ledger_by_id()
        # Records in play (not parked): each change is one update under the budget.
        live = [r for r in self.sample if rows_by_id.get(r["id"], {}).get("status") in ("delivered", "suppressed")]
        moved = rng.sample(live, k=min(RATE_CHANGES, len(live)))
        for record in moved:
            record["payload"]["company"] = "Budget Ltd"
        self._load(_write(self.workdir / "budget.jsonl", moved))
        started = time.monotonic()
        result = self._chain("deliver-rule")
        seconds = time.monotonic() - started
        sent = result["counts"].get("delivered", 0)
        self.console.print(
            f"{sent} updates in {seconds:.1f} s; its workers waited {result['waited_seconds']:.1f} s in all "
            f"for the budget (see `delivery connection-status crm`)"
        )

    def _oauth2(self) -> None:
        """A second target connection to the sandbox that authenticates with OAuth2 (client
        credentials), its tokens living `OAUTH_TOKEN_SECONDS`: a rule delivers every contact to it
        through a chain that outlasts several tokens, each renewed before it expires."""
        config = {
            "connections": [
                {
                    "name": "crm-oauth",
                    "driver": "rest",
                    "base_url": self.sandbox.url,
                    "timeout_seconds": 5,
                    "auth": {
                        "kind": "oauth2",
                        "token_url": self.sandbox.url.removesuffix("/api") + "/oauth/token",
                        "grant": "client_credentials",
                        "client_id_env": "DEMO_OAUTH_CLIENT_ID",
                        "client_secret_env": "DEMO_OAUTH_CLIENT_SECRET",
                    },
                },
                {"name": "shop"},
            ],
            "rules": [
                {
                    "name": OAUTH_RULE,
                    "source": "shop",
                    "domain": "contact",
                    "target": "crm-oauth",
                    "collection": "contacts-oauth",
                    "batch_size": 200,
                    "concurrency": 4,
                    "fields": {"email": "email", "name": "full_name"},
                    "max_attempts": 2,
                    "retry_schedule_seconds": [1, 2],
                }
            ],
        }
        with self.engine.begin() as conn:
            apply_config(conn, parse_config(yaml.safe_dump(config)))
        self.console.print(
            f"crm-oauth: the same sandbox, auth {{kind: oauth2, grant: client_credentials}}; "
            f"each access token lives {OAUTH_TOKEN_SECONDS} s"
        )
        before = self._api("GET", "_stats")["token_requests"]
        started = time.monotonic()
        result = self._chain("deliver-rule", OAUTH_RULE)
        seconds = time.monotonic() - started
        tokens = self._api("GET", "_stats")["token_requests"] - before
        counts = result["counts"]
        self.console.print(
            f"{counts.get('delivered', 0)} contacts delivered in {seconds:.1f} s with {tokens} access tokens, "
            f"{counts.get('failed', 0)} failed: each token was renewed before it expired"
        )

    def _deletes(self) -> None:
        """The rule now propagates deletes, at most `MAX_DELETES` a chain: three contacts deleted
        in the source are deleted in the CRM; then a source that deletes more than that at once
        (a glitch that emptied a table, say) fails the chain before it deletes anything."""
        config = yaml.safe_load(DEMO_CONFIG.read_text(encoding="utf-8"))
        for connection in config["connections"]:
            if connection["name"] == "crm":
                connection["base_url"] = self.sandbox.url
        config["rules"][0].update({"deletes": "propagate", "max_deletes_per_chain": MAX_DELETES})
        with self.engine.begin() as conn:
            apply_config(conn, parse_config(yaml.safe_dump(config)))
        self.console.print(f"{RULE}: deletes: propagate, max_deletes_per_chain: {MAX_DELETES}")
        rng = random.Random(31)
        rows = self._ledger_by_id()
        delivered = [r for r in self.sample if rows[r["id"]]["status"] == "delivered"]
        chosen = rng.sample(delivered, k=3 + MAX_DELETES + 1)
        deleted, purge = chosen[:3], chosen[3:]
        self._load(_write(self.workdir / "deleted.jsonl", [{**r, "deleted": True} for r in deleted]))
        before = len(self._api("GET", "contacts"))
        self._chain("deliver-rule")
        self.console.print(f"the sandbox held {before} contacts, now {len(self._api('GET', 'contacts'))}")
        self._load(_write(self.workdir / "purge.jsonl", [{**r, "deleted": True} for r in purge]))
        self.console.print(f"the source deletes {len(purge)} contacts at once: more than the rule allows a chain")
        result = self._chain("deliver-rule")
        self.console.print(
            f"the guard held ({result['state']}): the sandbox still holds {len(self._api('GET', 'contacts'))}; "
            "if the deletes are meant, raise max_deletes_per_chain and run again"
        )

    # -- helpers --------------------------------------------------------------------------------

    def _api(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = httpx.request(
            method, f"{self.sandbox.url}/{path}", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
        )
        response.raise_for_status()
        return response.json() if response.content else None

    def _ledger_by_id(self) -> dict[str, dict[str, Any]]:
        with self.engine.connect() as conn:
            return {row["external_id"]: row for row in ledger.ledger_rows(conn, RULE)}

    def _summary(self, seconds: float) -> dict[str, int]:
        with self.engine.connect() as conn:
            counts = ledger.counts_by_status(conn, catalog.get_rule(conn, RULE).id)
        self.console.rule("[bold]summary")
        table = Table("status", "records", "meaning")
        meaning = {
            LedgerStatus.DELIVERED: "in the CRM, up to date",
            LedgerStatus.SUPPRESSED: "considered, nothing to send (unmapped change)",
            LedgerStatus.FAILED: "waiting for their next attempt",
            LedgerStatus.EXHAUSTED: "parked: refused until max_attempts",
            LedgerStatus.REMOTE_GONE: "parked: deleted in the CRM",
            LedgerStatus.DELETED: "deleted in the source, so deleted in the CRM",
        }
        for status in LedgerStatus:
            table.add_row(status.value, str(counts[status.value]), meaning[status])
        self.console.print(table)
        env = f"DELIVERY_DATABASE_URL=sqlite:///{self.workdir / 'delivery.db'}"
        self.console.print(f"finished in {seconds:.0f} s. Next, against the demo's database:")
        for line in (
            f"export {env}",
            "delivery status",
            "delivery ledger --status exhausted",
            "delivery ledger --status remote_gone --json",
            f"delivery requeue {RULE} --status remote_gone --dry-run",
            "delivery sandbox &   # a target to deliver to again (port 8900)",
            f"delivery run {RULE}",
            "prefect server start   # then, in another shell:",
            f"PREFECT_API_URL=http://127.0.0.1:4200/api delivery run {RULE}",
            "# and open http://127.0.0.1:4200 (the UI)",
        ):
            self.console.print(f"  [cyan]{line}[/cyan]")
        return counts


#: Step 7: an OAuth2 client the sandbox takes, and how long its tokens live: the step's chain
#: (every contact, a second time, to another collection) outlasts a few of them.
OAUTH_CLIENT_ID = "demo-client"
OAUTH_CLIENT_SECRET = "demo-client-secret"
OAUTH_TOKEN_SECONDS = 1
OAUTH_RULE = "contacts-to-crm-oauth"
#: Step 8: the most deletes one chain of the demo's rule may send.
MAX_DELETES = 5
#: Step 6: the sandbox's budget, and how many contacts change under it (a couple of seconds' worth).
RATE_PER_SECOND = 40
RATE_CHANGES = 80


def run_demo(workdir: Path, records: int = 3000, console: Console | None = None) -> dict[str, int]:
    return Demo(workdir, records, console or Console()).run()
