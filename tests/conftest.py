"""A cluster of real daemons on loopback, for the multi-process tests (tests/daemon, tests/engine)."""

from __future__ import annotations

import compileall
from pathlib import Path

import pytest

from tests.daemon.harness import Daemon, free_port, make_token, node_ids, wait_for

TTL = 2.0  # short leases keep the tests fast; renewals come every TTL/3


ENGINE = "tests/engine/"  # the tests that start real vLLM servers and engines
ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    """The checkout's own modules compiled to bytecode once, before any test (on the controller: xdist's
    workers configure too). The suite starts hundreds of Python processes (daemons, CLIs, engines),
    and with no bytecode cached each compiles sparrowd anew, about 0.4 CPU-second a process; where
    ``PYTHONDONTWRITEBYTECODE`` is set, as on the CI machines, none would ever be cached."""
    if not hasattr(config, "workerinput"):
        for folder in ("sparrowd", "tests", "bench"):
            compileall.compile_dir(ROOT / folder, quiet=1, workers=0)


def pytest_collection_modifyitems(config, items):
    """The vLLM tests first: under ``-n 2`` (the README's test command) they take one worker from the
    start, the longest share of the suite, while the other works through the rest."""
    items.sort(key=lambda item: not item.nodeid.startswith(ENGINE))  # stable: each module keeps its order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduling by scope, the vLLM tests one scope: they run on one worker, one at a time
    and in order (one module's tests share a server and build on each other's steps, and each server
    keeps this machine's two cores busy while it loads). Every other test is its own scope, shared out
    as workers come free. (``--dist loadgroup`` would say this with a mark, but it groups nothing under
    pytest 9, whose node ids it can no longer suffix.)"""
    if config.getvalue("dist") != "load":  # -n's own default; any other --dist asked for is left alone
        return None
    from xdist.scheduler import LoadScopeScheduling

    class VllmApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ENGINE if nodeid.startswith(ENGINE) else nodeid

    return VllmApart(config, log)


@pytest.fixture
def cluster(tmp_path):
    """Start daemons with ``cluster.add(...)``; whatever still runs is killed at the end."""

    class Cluster:
        def __init__(self):
            self.token_file = make_token(tmp_path / "swarm.token")
            self.token = self.token_file.read_text().strip()
            self.port = free_port()
            self.tracker = f"http://127.0.0.1:{self.port}"
            self.daemons: list[Daemon] = []

        def trainer(self, **kw) -> Daemon:
            kw.setdefault("ttl", TTL)
            d = Daemon(tmp_path, "trainer", "trainer", kw.pop("region", "eu"), self.token_file, port=self.port,
                       **kw).start()
            self.daemons.append(d)
            return d

        def rollout(self, name: str, region: str, **kw) -> Daemon:
            token_file = kw.pop("token_file", self.token_file)
            wait = kw.pop("wait", True)
            d = Daemon(tmp_path, name, "rollout", region, token_file, tracker=self.tracker, **kw)
            self.daemons.append(d)
            return d.start(wait=wait)

        def pair(self, region: str = "us", **kw) -> tuple[Daemon, Daemon]:
            """A trainer and one rollout node "r1" that has joined."""
            trainer = self.trainer(**{k: v for k, v in kw.items() if k == "extra"})
            node = self.rollout("r1", region, **kw)
            wait_for(lambda: len(self.nodes()) == 2, 15, "two nodes")
            return trainer, node

        def nodes(self) -> set[str]:
            return node_ids(self.tracker, self.token)

    c = Cluster()
    yield c
    for d in c.daemons:
        if d.proc and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


