"""The lease table on disk: SQLite in WAL mode inside the data dir.

One row per live lease (the lease as JSON) and a small key/value table for the epoch counter and
the latest version. Every change is its own short transaction; WAL with
``synchronous=NORMAL`` makes that a sequential append, and a crash loses at
most the last few renewals (which the nodes repeat within a third of a TTL),
never an epoch: the counter is written before the lease that uses it.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from pathlib import Path

from ..errors import SparrowError
from ..swarm.leases import Node

__all__ = ["SqliteLeaseStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (node_id TEXT PRIMARY KEY, lease TEXT NOT NULL);
"""
_FIELDS = {f.name for f in dataclasses.fields(Node)}


class SqliteLeaseStore:
    """One row per lease, the lease as JSON: fields added later read back with their defaults."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
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
        self._db.execute("INSERT OR REPLACE INTO nodes (node_id, lease) VALUES (?, ?)",
                         (node.node_id, json.dumps(dataclasses.asdict(node))))

    def delete(self, node_id: str) -> None:
        self._db.execute("DELETE FROM nodes WHERE node_id = ?", (node_id,))

    def save_meta(self, key: str, value: int) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, int(value)))

    def close(self) -> None:
        self._db.close()
