"""A trainer daemon on loopback for the benchmarks, in a scratch folder removed afterwards."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BenchTrainer", "trainer_daemon"]


@dataclass
class BenchTrainer:
    root: Path  # scratch folder: models and checkpoints may go here too
    url: str
    token_file: Path
    data_dir: Path


@contextmanager
def trainer_daemon(prefix: str, *extra: str) -> Iterator[BenchTrainer]:
    root = Path(tempfile.mkdtemp(prefix=prefix))
    token = root / "swarm.token"
    token.write_text(secrets.token_hex(24) + "\n")
    os.chmod(token, 0o600)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(root / "trainer.log", "wb")
    daemon = subprocess.Popen([sys.executable, "-m", "sparrowd_cli.main", "run", "--role", "trainer", "--region",
                               "bench", "--listen", f"127.0.0.1:{port}", "--data-dir", str(root / "trainer"),
                               "--token-file", str(token), "--log-level", "warning", *extra],
                              stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while not (root / "trainer" / "daemon.json").exists():
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise RuntimeError(f"the trainer daemon did not start; see {root / 'trainer.log'}")
            time.sleep(0.1)
        yield BenchTrainer(root, f"http://127.0.0.1:{port}", token, root / "trainer")
    finally:
        daemon.terminate()
        daemon.wait(10)
        log.close()
        shutil.rmtree(root, ignore_errors=True)
