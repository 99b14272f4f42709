"""The lease table on disk: SQLite in WAL mode inside the data dir.

One row per live lease (the lease as JSON), a small key/value table for the epoch counter and
the latest version, the node id -> key bindings and the credentials issued (``swarm.identity``).
Joins, leaves and the counter are written at once, each its own short
transaction; WAL with ``synchronous=NORMAL`` makes that a sequential append. Renewals only move
a lease's expiry and what the node reports, so they are kept in memory and written together by
``flush()``, which the daemon calls every second: one transaction instead of thousands a second
in a large swarm. A crash loses at most the last second of renewals (which the nodes repeat within
a third of a TTL), never an epoch: the counter is written before the lease that uses it.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path

from ..errors import SparrowError
from ..swarm.identity import Binding
from ..swarm.leases import Node

__all__ = ["SqliteLeaseStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (node_id TEXT PRIMARY KEY, lease TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS bindings (node_id TEXT PRIMARY KEY, key BLOB NOT NULL, credential TEXT,
                                     last_ts REAL NOT NULL);
CREATE TABLE IF NOT EXISTS credentials (id TEXT PRIMARY KEY, record TEXT NOT NULL);
"""
_ORDER = tuple(f.name for f in dataclasses.fields(Node))
_FIELDS = set(_ORDER)


def _row(node: Node) -> tuple[str, str]:
    return node.node_id, json.dumps({k: getattr(node, k) for k in _ORDER}, separators=(",", ":"))


class SqliteLeaseStore:
    """One row per lease, the lease as JSON: fields added later read back with their defaults."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._later: dict[str, Node] = {}  # renewed leases not written yet
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as e:
            raise SparrowError(f"lease database {self.path}: {e}") from None

    def load(self) -> tuple[list[Node], dict[str, int]]:
        try:
            rows = self._db.execute("SELECT lease FROM nodes").fetchall()
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.Error as e:
            raise SparrowError(f"lease database {self.path}: {e}") from None
        nodes = []
        for (blob,) in rows:
            d = {k: v for k, v in json.loads(blob).items() if k in _FIELDS}
            d["versions"] = tuple(d.get("versions", ()))
            if d.get("progress") is not None:
                d["progress"] = tuple(d["progress"])
            nodes.append(Node(**d))
        return nodes, meta

    def save(self, node: Node) -> None:
        self._later.pop(node.node_id, None)
        self._db.execute("INSERT OR REPLACE INTO nodes (node_id, lease) VALUES (?, ?)", _row(node))

    def save_later(self, node: Node) -> None:
        """A renewal: written at the next ``flush()``."""
        self._later[node.node_id] = node

    def flush(self) -> int:
        """Write the renewals kept since the last flush, in one transaction; returns how many."""
        if not self._later:
            return 0
        rows = [_row(n) for n in self._later.values()]
        self._later.clear()
        with self._db:  # BEGIN ... COMMIT
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR REPLACE INTO nodes (node_id, lease) VALUES (?, ?)", rows)
        return len(rows)

    def delete(self, node_id: str) -> None:
        self._later.pop(node_id, None)
        self._db.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,))

    def save_meta(self, key: str, value: int) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, int(value)))

    # Identities: node id -> key bindings and issued credentials, written at once (joins are rare).

    def save_binding(self, b: Binding) -> None:
        self._db.execute("INSERT OR REPLACE INTO bindings (node_id, key, credential, last_ts) VALUES (?, ?, ?, ?)",
                         (b.node_id, b.key, b.credential, b.last_ts))

    def load_bindings(self) -> list[Binding]:
        rows = self._db.execute("SELECT node_id, key, credential, last_ts FROM bindings").fetchall()
        return [Binding(i, bytes(k), c, float(t)) for i, k, c, t in rows]

    def forget_binding(self, node_id: str) -> None:
        self._db.execute("DELETE FROM bindings WHERE node_id = ?", (node_id,))

    def save_credential(self, record: dict) -> None:
        self._db.execute("INSERT OR REPLACE INTO credentials (id, record) VALUES (?, ?)",
                         (record["id"], json.dumps(record, separators=(",", ":"))))

    def load_credentials(self) -> list[dict]:
        return [json.loads(r) for (r,) in self._db.execute("SELECT record FROM credentials").fetchall()]

    def close(self) -> None:
        self.flush()
        self._db.close()
