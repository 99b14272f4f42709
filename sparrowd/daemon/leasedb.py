"""The lease table on disk: SQLite in WAL mode inside the data dir.

One row per live lease and a small key/value table for the epoch counter and
the latest version. Every change is its own short transaction; WAL with
``synchronous=NORMAL`` makes that a sequential append, and a crash loses at
most the last few renewals (which the nodes repeat within a third of a TTL),
never an epoch: the counter is written before the lease that uses it.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from ..errors import SparrowError
from ..swarm.leases import Node

__all__ = ["SqliteLeaseStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    node_id TEXT PRIMARY KEY,
    role TEXT NOT NULL,
    region TEXT NOT NULL,
    address TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    joined_at REAL NOT NULL,
    renewed_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    versions TEXT NOT NULL,
    engine_version INTEGER,
    bytes_up INTEGER NOT NULL,
    bytes_down INTEGER NOT NULL,
    rate_up REAL NOT NULL,
    rate_down REAL NOT NULL
);
"""
_COLUMNS = (
    "node_id role region address epoch joined_at renewed_at expires_at versions "
    "engine_version bytes_up bytes_down rate_up rate_down"
).split()


class SqliteLeaseStore:
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
            rows = self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM leases").fetchall()
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.Error as e:
            raise SparrowError(f"lease database {self.path}: {e}") from None
        nodes = []
        for row in rows:
            d = dict(zip(_COLUMNS, row))
            d["versions"] = tuple(json.loads(d["versions"]))
            nodes.append(Node(**d))
        return nodes, meta

    def save(self, node: Node) -> None:
        values = [getattr(node, c) for c in _COLUMNS]
        values[_COLUMNS.index("versions")] = json.dumps(list(node.versions))
        self._db.execute(
            f"INSERT OR REPLACE INTO leases ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})", values
        )

    def delete(self, node_id: str) -> None:
        self._db.execute("DELETE FROM leases WHERE node_id = ?", (node_id,))

    def save_meta(self, key: str, value: int) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, int(value)))

    def close(self) -> None:
        self._db.close()
