"""The sandbox's records, id sequences and idempotency keys, in SQLite. Nothing here knows HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["SandboxStore", "UnusableDatabase"]


class UnusableDatabase(ValueError):
    """`db_path` cannot hold the sandbox's records. `reason` is kept apart so that `delivery
    sandbox` can say it of its `--db` flag rather than of the setting."""

    def __init__(self, path: str | None, reason: str) -> None:
        super().__init__(f"db_path {path!r} {reason}")
        self.path = path
        self.reason = reason


class SandboxStore:
    """Records, id sequences and idempotency keys in SQLite: `:memory:` by default, or a file that
    survives restarts. One code path for both, so the in-memory sandbox is the tested one too.

    The lock is there because `close()` may come from another thread than the event loop's; the
    requests themselves all run on the loop thread, so check-then-create is never interleaved.
    """

    SCHEMA_VERSION = 1

    def __init__(self, path: str | None) -> None:
        self._lock = threading.Lock()
        target = path if path is not None else ":memory:"
        directory = os.path.dirname(path) if path is not None else ""
        if directory and not os.path.isdir(directory):
            # SQLite would only say "unable to open database file".
            raise UnusableDatabase(path, f"its directory {directory} does not exist")
        try:
            self._db = sqlite3.connect(target, check_same_thread=False, isolation_level=None, timeout=5.0)
            self._migrate(path)
        except sqlite3.Error as exc:
            raise UnusableDatabase(path, f"cannot be used as the sandbox database: {exc}") from exc
        self._closed = False

    def _migrate(self, path: str | None) -> None:
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        if version == self.SCHEMA_VERSION:
            return
        tables = self._db.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]
        if version != 0 or tables:
            # Never add tables to somebody else's database (say, the engine's own SQLite file).
            raise UnusableDatabase(path, "is an SQLite database but not a sandbox one")
        self._db.executescript(
            f"""
            BEGIN;
            CREATE TABLE records (
                collection TEXT NOT NULL, id TEXT NOT NULL, seq INTEGER NOT NULL, body TEXT NOT NULL,
                PRIMARY KEY (collection, id)
            );
            CREATE INDEX records_order ON records (collection, seq);
            -- Ids are never reused: a deleted record's id must stay gone for the engine's updates.
            CREATE TABLE sequences (collection TEXT PRIMARY KEY, last INTEGER NOT NULL);
            CREATE TABLE idempotency_keys (
                collection TEXT NOT NULL, key TEXT NOT NULL, record_id TEXT NOT NULL, answer TEXT NOT NULL,
                PRIMARY KEY (collection, key)
            );
            PRAGMA user_version = {self.SCHEMA_VERSION};
            COMMIT;
            """
        )

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the sandbox store is closed")
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def create(self, collection: str, body: dict[str, Any], key: str | None) -> tuple[dict[str, Any], bool]:
        """The stored record and whether it was created now (False: replayed for a known key)."""
        with self._transaction() as db:
            if key is not None:
                seen = db.execute(
                    "SELECT record_id, answer FROM idempotency_keys WHERE collection = ? AND key = ?",
                    (collection, key),
                ).fetchone()
                if seen is not None:
                    live = self._get(db, collection, seen[0])
                    # The live record if it was patched since; the first answer if it was deleted,
                    # so a late retry learns the id (and the engine's next update finds it gone).
                    return (live if live is not None else json.loads(seen[1])), False
            row = db.execute(
                "INSERT INTO sequences (collection, last) VALUES (?, 1) "
                "ON CONFLICT (collection) DO UPDATE SET last = last + 1 RETURNING last",
                (collection,),
            ).fetchone()
            seq = int(row[0])
            record = {"id": f"{_id_prefix(collection)}-{seq}", **{k: v for k, v in body.items() if k != "id"}}
            text = json.dumps(record)
            db.execute(
                "INSERT INTO records (collection, id, seq, body) VALUES (?, ?, ?, ?)",
                (collection, record["id"], seq, text),
            )
            if key is not None:
                db.execute(
                    "INSERT INTO idempotency_keys (collection, key, record_id, answer) VALUES (?, ?, ?, ?)",
                    (collection, key, record["id"], text),
                )
            return record, True

    def update(self, collection: str, record_id: str, patch: dict[str, Any]) -> dict[str, Any] | None:
        with self._transaction() as db:
            record = self._get(db, collection, record_id)
            if record is None:
                return None
            record.update({k: v for k, v in patch.items() if k != "id"})  # the id is the address
            db.execute(
                "UPDATE records SET body = ? WHERE collection = ? AND id = ?",
                (json.dumps(record), collection, record_id),
            )
            return record

    def get(self, collection: str, record_id: str) -> dict[str, Any] | None:
        with self._transaction() as db:
            return self._get(db, collection, record_id)

    def records(self, collection: str, limit: int | None) -> list[dict[str, Any]]:
        with self._transaction() as db:
            rows = db.execute(
                "SELECT body FROM records WHERE collection = ? ORDER BY seq LIMIT ?",
                (collection, -1 if limit is None else limit),
            ).fetchall()
        return [json.loads(body) for (body,) in rows]

    def delete(self, collection: str, record_id: str) -> bool:
        with self._transaction() as db:
            deleted = db.execute("DELETE FROM records WHERE collection = ? AND id = ?", (collection, record_id))
            return deleted.rowcount > 0

    def counts(self) -> dict[str, int]:
        with self._transaction() as db:
            rows = db.execute("SELECT collection, count(*) FROM records GROUP BY collection").fetchall()
        return {str(name): int(n) for name, n in rows}

    def close(self) -> None:
        """Idempotent: both the lifespan shutdown and the owner call it."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()

    @staticmethod
    def _get(db: sqlite3.Connection, collection: str, record_id: str) -> dict[str, Any] | None:
        row = db.execute("SELECT body FROM records WHERE collection = ? AND id = ?", (collection, record_id)).fetchone()
        if row is None:
            return None
        record: dict[str, Any] = json.loads(row[0])
        return record


def _id_prefix(collection: str) -> str:
    """`contacts` -> `c`, so ids read like `c-1` and a wrong-collection id is easy to spot."""
    first = collection[:1].lower()
    return first if first.isascii() and first.isalnum() else "r"
