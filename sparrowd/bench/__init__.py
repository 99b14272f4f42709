"""Benchmarks behind ``sparrowd bench``: each prints what it measured beside a baseline taken in
the same run, and can write its figures as JSON (``--json FILE``)."""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint import atomic_file


def write_json(path: str | Path, doc) -> None:
    """Write a benchmark's figures whole or not at all (a temporary file, then a rename)."""
    with atomic_file(Path(path)) as tmp:
        tmp.write_text(json.dumps(doc, indent=2) + "\n")


def write_lines(path: str | Path, records) -> None:
    """Records as JSON Lines (one object a line), whole or not at all."""
    with atomic_file(Path(path)) as tmp:
        tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
