"""A trainer daemon on loopback for the benchmarks (``LocalSwarm`` with only the trainer)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..localswarm import LocalSwarm

__all__ = ["BenchTrainer", "trainer_daemon"]


@dataclass
class BenchTrainer:
    root: Path  # scratch folder: models and checkpoints may go here too
    url: str
    token_file: Path
    data_dir: Path


@contextmanager
def trainer_daemon(prefix: str, *extra: str) -> Iterator[BenchTrainer]:
    with LocalSwarm(prefix=prefix) as swarm:
        t = swarm.trainer(*extra, region="bench")
        yield BenchTrainer(swarm.root, swarm.url, swarm.token_file, t.data_dir)
