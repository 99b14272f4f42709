"""How the trainer's weights reach the rollout servers in ``sparrowd bench rl``: the four strategies.

Each strategy starts what it needs (daemons, the WAN emulator, a file
server), is told when the trainer has a new version (``publish``: the transfer
starts) and when the servers must run a version (``ensure``: returns the
longest pause, once every server runs it). ``held[v]`` records when every
rollout box held version ``v``, for the time on the wire.

* ``full``: the whole bf16 checkpoint over HTTP, the trainer's uplink shaped,
  through the WAN; each box's server reloads it with vLLM's own
  ``reload_weights``;
* ``star`` and ``swarm``: sparrowd, a rollout daemon per box behind the WAN
  emulator (``star``: no connection between rollout regions, super-seeding off,
  so every node fetches from the trainer); the servers take each version
  through the sparrowd backend once their node holds it;
* ``ideal``: the servers read each version from the trainer daemon's engine
  socket on this machine: no network.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from ..localswarm import wait_for
from ..sizes import parse_size
from .swarm import metric

if TYPE_CHECKING:
    from .vllm_server import VllmServer

__all__ = ["STRATEGIES", "Strategy", "Procs", "FileServer", "address", "download", "save_bf16", "start_wan",
           "wait"]


def address(region: int, kind: int, j: int) -> str:
    """127.(10+region).kind.(j+1): kind 0 a daemon or server, 1 its WAN proxy, 2 a download client."""
    return f"127.{10 + region}.{kind}.{j + 1}"


def save_bf16(model, folder: Path) -> None:
    """``model`` in bf16 as a model folder, quietly: transformers' "Writing model shards" bar came
    between a benchmark's own lines at every step."""
    import copy

    import torch
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


class Procs:
    """Child processes of one strategy, stopped together."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], name: str, **kw) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")
        p = subprocess.Popen(args, stdout=kw.pop("stdout", log), stderr=log, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def daemon(self, *args: str, name: str) -> subprocess.Popen:
        return self.start([sys.executable, "-m", "sparrowd.cli.main", "run", *args], name)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []


def wait(pred, timeout: float, what: str, every: float = 0.02):
    """``localswarm.wait_for`` polling every 20 ms: the waits that bench rl times."""
    return wait_for(pred, timeout, what, every)


def start_wan(procs: Procs, root: Path, proxies: list[dict], cfg, blocked=()) -> None:
    (root / "wan.json").write_text(json.dumps({"proxies": proxies, "rtt": cfg.rtt,
                                               "link_rate": parse_size(cfg.link_rate), "blocked": blocked}))
    p = procs.start([sys.executable, "-m", "sparrowd.bench.wan", str(root / "wan.json")], "wan",
                    stdout=subprocess.PIPE)
    assert p.stdout is not None  # (stdout=PIPE)
    if p.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"the WAN emulator did not start; see {root / 'wan.log'}")


class FileServer:
    """The trainer's checkpoints over HTTP, its uplink shaped to ``rate`` bytes/s (all downloads
    share it), in a thread of its own."""

    def __init__(self, folder: Path, host: str, port: int, rate: int):
        self.folder, self.host, self.port, self.rate = folder, host, port, rate
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()

    def start(self) -> "FileServer":
        self._thread.start()
        self._ready.wait(10)
        return self

    def _run(self) -> None:
        import asyncio

        from aiohttp import web

        from ..swarm.bucket import TokenBucket

        bucket = TokenBucket(self.rate)

        async def get(request):
            path = (self.folder / request.match_info["path"]).resolve()
            if self.folder.resolve() not in path.parents or not path.is_file():
                return web.Response(status=404)
            resp = web.StreamResponse(headers={"Content-Length": str(path.stat().st_size)})
            await resp.prepare(request)
            with open(path, "rb") as f:
                while data := f.read(64 << 10):
                    wait = bucket.take(time.monotonic(), len(data))
                    if wait > 0:
                        await asyncio.sleep(wait)
                    await resp.write(data)
            await resp.write_eof()
            return resp

        async def main():
            app = web.Application()
            app.add_routes([web.get("/{path:.+}", get)])
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, self.host, self.port).start()
            self._ready.set()
            await asyncio.Event().wait()

        self._loop = loop = asyncio.new_event_loop()
        loop.run_until_complete(main())


def download(host: str, port: int, source: str, remote: str, names: list[str], dest: Path) -> int:
    """Files of a checkpoint folder, fetched from ``source`` (a rollout region's address)."""
    dest.mkdir(parents=True, exist_ok=True)
    total = 0
    for name in names:
        conn = http.client.HTTPConnection(host, port, timeout=600, source_address=(source, 0))
        try:
            conn.request("GET", f"/{remote}/{name}")
            r = conn.getresponse()
            if r.status != 200:
                raise RuntimeError(f"download {remote}/{name}: HTTP {r.status}")
            with open(dest / name, "wb") as f:
                while data := r.read(1 << 20):
                    f.write(data)
                    total += len(data)
        finally:
            conn.close()
    return total


# ---------------------------------------------------------------------------- the strategies


class Strategy:
    """How versions reach the servers. ``publish`` after each training step starts the transfer;
    ``ensure(v)`` returns once every server runs version ``v`` (idle time, pause)."""

    name = ""

    def __init__(self, world):  # rl._World: the config, the servers, the token
        self.w = world
        self.cfg = world.cfg
        self.root = world.root / self.name
        self.root.mkdir()
        self.procs = Procs(self.root)
        self.held: dict[int, float] = {}  # version -> when every rollout box held it
        self.published: dict[int, float] = {}

    def start(self, model) -> None: ...

    def publish(self, model, version: int) -> None: ...

    def ensure(self, version: int) -> float:
        raise NotImplementedError

    def wan_bytes(self) -> int:
        return 0

    def versions(self) -> dict[str, int | None]:
        """The version each server runs now, by name."""
        return {f"s{i}": _version_of(s) for i, s in enumerate(self.w.servers)}

    def more(self, elapsed: float) -> bool:
        """Whether the run goes on past its steps (``elapsed`` seconds into it)."""
        return False

    def pace(self) -> float:
        """The least time the step now ending lasts (the loop waits out the rest)."""
        return 0.0

    def finish(self, last: int) -> dict | None:
        """After the last step: what the strategy checks or reports beyond the steps."""
        return None

    def stop(self) -> None:
        self.procs.stop()

    # helpers for the sparrowd strategies

    def _attach(self, sockets: list[Path], token_file: Path) -> None:
        for server, sock in zip(self.w.servers, sockets, strict=True):
            server.post("init_weight_transfer_engine", {"init_info": {
                "socket": str(sock), "token_file": str(token_file), "version": 0, "engine": "bench-rl"}})

    def _update(self, version: int) -> float:
        """Every server moved to ``version`` through the sparrowd backend, at once, the way the
        trainer-side engine does it (``move_server``); the longest pause."""
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

        from ..integrations.vllm_backend import move_server

        clients = [HTTPVLLMWeightSyncClient(s.url) for s in self.w.servers]
        with ThreadPoolExecutor(len(clients)) as pool:
            return max(pool.map(lambda c: move_server(c, version, timeout=600), clients))


class _Sparrow(Strategy):
    """``swarm``, or ``star`` (rollout regions cannot reach each other)."""

    extra = 0  # boxes beyond the servers' own (``churn``): their WAN proxies exist from the start
    anchor = False  # the servers loaded the base: no anchor to ship

    def __init__(self, world, star: bool = False):
        self.name = self.name or ("star" if star else "swarm")
        super().__init__(world)
        self.star = star

    def start(self, model) -> None:
        from ..publisher import Publisher

        cfg, w, root = self.cfg, self.w, self.root
        token_file = w.token_file
        t_host, t_proxy = address(0, 0, 100), address(0, 1, 100)
        from ..localswarm import free_port

        port = free_port(t_host)
        proxies = [{"listen": [t_proxy, port], "target": [t_host, port], "region": 0}]
        self.nodes = []
        for i in range(cfg.servers + self.extra):
            r = w.region_of(i)
            host = address(r, 0, i)
            p = free_port(host)
            proxies.append({"listen": [address(r, 1, i), p], "target": [host, p], "region": r})
            self.nodes.append((i, r, host, p))
        regions = sorted({r for _, r, _, _ in self.nodes})
        blocked = [[a, b] for a in regions for b in regions if a < b] if self.star else []
        start_wan(self.procs, root, proxies, cfg, blocked)
        self.direct = f"http://{t_host}:{port}"
        self.procs.daemon("--role", "trainer", "--region", "r0", "--listen", f"{t_host}:{port}", "--advertise",
                          f"{t_proxy}:{port}", "--data-dir", str(root / "trainer"), "--token-file", str(token_file),
                          "--node-id", "trainer", "--upload-rate", cfg.trainer_rate, "--lease-ttl", "3",
                          "--super-seed", "off" if self.star else "on", "--log-level", "warning", name="trainer")
        wait(lambda: (root / "trainer" / "daemon.json").exists(), 30, "the trainer")
        self.tracker = f"http://{t_proxy}:{port}"
        for i in range(cfg.servers):
            self._rollout(i)
        # A deployment that takes new boxes ships the model's files (config, tokenizer) with its anchors.
        self.pub = Publisher(daemon=self.direct, token_file=token_file, anchor_every=0,
                             model_files=w.base if self.anchor else None)
        wait(lambda: len(self.pub.status()["nodes"]) == cfg.servers + 1, 60, "every node to join")
        self.urls = [json.loads((root / f"n{i}" / "daemon.json").read_text())["url"] for i in range(cfg.servers)]
        self.pub.start(model, version=0, anchor=self.anchor)
        self._attach([root / f"n{i}" / "engine.sock" for i in range(cfg.servers)], token_file)
        self._watch = ThreadPoolExecutor(1)

    def _rollout(self, i: int, *extra: str) -> subprocess.Popen:
        """Box i's rollout daemon, behind its WAN proxy."""
        _, r, host, p = self.nodes[i]
        return self.procs.daemon(
            "--role", "rollout", "--region", f"r{r}", "--listen", f"{host}:{p}", "--advertise",
            f"{address(r, 1, i)}:{p}", "--data-dir", str(self.root / f"n{i}"), "--token-file", str(self.w.token_file),
            "--node-id", f"n{i}", "--tracker", self.tracker, "--upload-rate", self.cfg.node_rate, "--current", "off",
            "--log-level", "warning", *extra, name=f"n{i}")

    def publish(self, model, version: int) -> None:
        self.pub.publish(model, version=version)
        self.published[version] = time.monotonic()
        self._watch.submit(self._until_held, version)

    def _until_held(self, version: int) -> None:
        from ..client import http_call

        token = self.w.token
        wait(lambda: all(version in http_call(f"{u}/v1/node", token)["versions"] for u in self.urls), 600,
              f"every node to hold version {version}", every=0.05)
        self.held[version] = time.monotonic()

    def ensure(self, version: int) -> float:
        if version == 0:
            return 0.0
        wait(lambda: version in self.held, 600, f"every node to hold version {version}")  # before any pause
        return self._update(version)

    def wan_bytes(self) -> int:
        return int(sum(metric(u, self.w.token, 'sparrowd_bytes_total{direction="down",region_class="other"}')
                       for u in self.urls))

    def stop(self) -> None:
        if hasattr(self, "pub"):
            self.pub.close()
        if hasattr(self, "_watch"):
            self._watch.shutdown(wait=False, cancel_futures=True)
        super().stop()


class _Churn(_Sparrow):
    """``swarm`` while boxes come and go, the trainer side unchanged. A spare box (its own
    ``vllm serve``, kept on the newest version by its daemon's follow mode) is killed, daemon and
    server, right after the publish of step ``churn_step``; at the same moment an empty box joins:
    its daemon boots ``DATA/current`` from the swarm (the base ships as anchor 0, as a deployment
    that takes new boxes does), ``vllm serve DATA/current`` starts on it, and follow mode moves the
    server from then on. The steady servers sample every step, so their rewards must equal the run
    without churn; at the end the joiner must reach the last version with the steady servers'
    weights."""

    name = "churn"
    extra = 2
    anchor = True

    def start(self, model) -> None:
        super().start(model)
        cfg, n = self.cfg, self.cfg.servers
        self.leaver, self.joiner = n, n + 1
        self.leaver_server = self.w.spare  # started with the steady servers, on the base
        self.leaver_daemon = self._rollout(self.leaver, "--follow-vllm", self.leaver_server.url)
        wait(lambda: len(self.pub.status()["nodes"]) == n + 2, 60, "the spare box to join")
        wait(lambda: _version_of(self.leaver_server) == 0, 60, "follow mode to attach the spare box's server")
        self.churn_step = max(1, cfg.steps // 3)
        self.joiner_server: VllmServer | None = None
        self.events: dict[str, float] = {}
        self.joiner_seen: list[int] = []  # the joiner's versions at the steps it served
        self._boot = ThreadPoolExecutor(1)
        self._boot_job: Future[None] | None = None

    def publish(self, model, version: int) -> None:
        super().publish(model, version)
        if version == self.churn_step:
            t0 = time.monotonic()
            for p in (self.leaver_daemon, self.leaver_server.proc):
                os.killpg(p.pid, signal.SIGKILL)
            self.leaver_server.proc.wait()
            self.events["killed"] = t0
            self._boot_job = self._boot.submit(self._join, t0)

    def _join(self, t0: float) -> None:
        """The empty box: its daemon, then its server once ``DATA/current`` is ready."""
        from ..client import http_call
        from ..localswarm import free_port
        from .vllm_server import VllmServer

        _, r, _, _ = self.nodes[self.joiner]
        host = address(r, 0, 50 + self.joiner)
        url = f"http://{host}:{free_port(host)}"
        self._rollout(self.joiner, "--current", "on", "--follow-vllm", url)
        info = self.root / f"n{self.joiner}" / "daemon.json"
        wait(lambda: info.exists(), 60, "the joining box's daemon")
        node = json.loads(info.read_text())["url"]
        wait(lambda: ((http_call(f"{node}/v1/node", self.w.token).get("current") or {}).get("state") == "ready"),
             300, "the joining box's current folder", every=0.1)
        self.events["folder_ready"] = time.monotonic()
        folder = http_call(f"{node}/v1/node", self.w.token)["current"]
        self.events["folder_version"] = folder["version"]
        server = VllmServer(sys.executable, self.root / f"n{self.joiner}" / "current", int(url.rsplit(":", 1)[1]),
                            host=host, log_path=self.root / "joiner-server.log",
                            env={"VLLM_CPU_OMP_THREADS_BIND": str(self.joiner % (os.cpu_count() or 1))})
        self.joiner_server = server.start()
        server.wait_ready(600)
        self.events["serving"] = time.monotonic()

    def versions(self) -> dict[str, int | None]:
        out = super().versions()
        out["leaver"] = None if "killed" in self.events else _version_of(self.leaver_server)
        out["joiner"] = _version_of(self.joiner_server) if "serving" in self.events else None
        if out["joiner"] is not None:
            self.joiner_seen.append(out["joiner"])
        return out

    def pace(self) -> float:
        """``join_pace`` while the joiner boots. Every emulated box shares this machine's CPUs, and
        the steps, run back to back, slow the joiner's vLLM start several times over; a real box
        boots on its own machine, at no cost to the others."""
        booting = self._boot_job is not None and not self._boot_job.done()
        return self.cfg.join_pace if booting else 0.0

    def more(self, elapsed: float) -> bool:
        """Training goes on until follow mode has moved the joiner while the steps run (its server
        takes about a minute to start on CPU)."""
        if self._boot_job is not None and self._boot_job.done():
            self._boot_job.result()  # a failed join fails the run now
        if len(set(self.joiner_seen)) >= 2:
            return False
        if elapsed > JOIN_WITHIN:
            raise RuntimeError(f"the joining box's server did not follow a version within {JOIN_WITHIN:.0f} s")
        return True

    def finish(self, last: int) -> dict:
        """The joiner on the last version, then every server's weights and greedy outputs (tokens,
        logprobs, version labels) compared there."""
        from .vllm_server import generate

        if self._boot_job is None:
            raise RuntimeError(f"the churn happens after step {self.churn_step}; run at least that many steps")
        self._boot_job.result()  # a failed join fails the run
        wait(lambda: _version_of(self.joiner_server) == last, 300, f"the joining box's server to reach version {last}",
             every=0.1)
        caught_up = time.monotonic()
        self.ensure(last)
        servers = [*self.w.servers, self.joiner_server]
        sums = [s.post("weight_checker", {"action": "checksum"})["checksums"] for s in servers]
        said = [[generate(s.url, p) for p in GREEDY_PROMPTS] for s in servers]
        ev = self.events
        return {"churn_step": self.churn_step, "joiner_folder_version": ev["folder_version"],
                "joiner_folder_seconds": ev["folder_ready"] - ev["killed"],
                "joiner_serving_seconds": ev["serving"] - ev["killed"],
                "joiner_caught_up_after_last_publish": caught_up - self.published[last],
                "joiner_weights_equal": all(x == sums[0] for x in sums),
                "joiner_generates_equal": all(x == said[0] for x in said)}

    def stop(self) -> None:
        if self.joiner_server is not None:
            self.joiner_server.stop()
        self._boot.shutdown(wait=True, cancel_futures=True)
        super().stop()


JOIN_WITHIN = 600.0  # seconds into a ``churn`` run by which the joiner must have followed a version
GREEDY_PROMPTS = [[11, 250, 37, 903, 4], [600, 2, 2, 71, 18, 333, 9], [5]]  # token ids, greedy, at the end of ``churn``


def _version_of(server) -> int | None:
    """The version a server runs, from vLLM's own label; None if it does not answer."""
    try:
        label = server.weight_version()
    except Exception:  # a killed or starting server
        return None
    return int(label) if str(label).isdigit() else None


class _Ideal(Strategy):
    """The servers read each version from the trainer daemon's own engine socket: no network."""

    name = "ideal"

    def start(self, model) -> None:
        from ..localswarm import free_port
        from ..publisher import Publisher

        port = free_port()
        self.procs.daemon("--role", "trainer", "--region", "r0", "--listen", f"127.0.0.1:{port}", "--data-dir",
                          str(self.root / "trainer"), "--token-file", str(self.w.token_file), "--node-id",
                          "trainer", "--log-level", "warning", name="trainer")
        wait(lambda: (self.root / "trainer" / "daemon.json").exists(), 30, "the trainer")
        self.pub = Publisher(daemon=f"http://127.0.0.1:{port}", token_file=self.w.token_file, anchor_every=0)
        self.pub.start(model, version=0, anchor=False)
        self._attach([self.root / "trainer" / "engine.sock"] * self.cfg.servers, self.w.token_file)

    def publish(self, model, version: int) -> None:
        self.pub.publish(model, version=version)
        self.published[version] = self.held[version] = time.monotonic()

    def ensure(self, version: int) -> float:
        return self._update(version) if version > 0 else 0.0

    def stop(self) -> None:
        if hasattr(self, "pub"):
            self.pub.close()
        super().stop()


class _Full(Strategy):
    """The whole bf16 checkpoint over HTTP through the WAN; vLLM's own reload on each box."""

    name = "full"

    def start(self, model) -> None:
        from ..localswarm import free_port

        cfg = self.cfg
        host, proxy = address(0, 0, 100), address(0, 1, 100)
        self.port = free_port(host)
        self.proxy = proxy
        start_wan(self.procs, self.root, [{"listen": [proxy, self.port], "target": [host, self.port], "region": 0}],
             cfg)
        self.served = self.root / "served"
        self.served.mkdir()
        self.files = FileServer(self.served, host, self.port, parse_size(cfg.trainer_rate)).start()
        self.downloads = ThreadPoolExecutor(cfg.servers)
        self.pending: dict[int, list] = {}
        self.bytes = 0
        self._lock = threading.Lock()
        for s in self.w.servers:
            s.post("update_weight_version", {"new_version": "0"})

    def publish(self, model, version: int) -> None:
        folder = self.served / f"v{version}"
        save_bf16(model, folder)
        names = sorted(p.name for p in folder.iterdir())
        self.published[version] = time.monotonic()
        futures = [self.downloads.submit(download, self.proxy, self.port, address(self.w.region_of(i), 2, i),
                                         f"v{version}", names, self.root / f"box{i}" / f"v{version}")
                   for i in range(self.cfg.servers)]
        self.pending[version] = futures

        def held(f):
            with self._lock:
                if not f.exception():
                    self.bytes += f.result()
                if all(x.done() for x in futures):
                    self.held.setdefault(version, time.monotonic())

        for f in futures:
            f.add_done_callback(held)

    def ensure(self, version: int) -> float:
        if version == 0:
            return 0.0
        for f in self.pending.pop(version):
            f.result()  # a failed download fails the run

        def one(i) -> float:
            server = self.w.servers[i]
            t0 = time.monotonic()
            server.post("pause?mode=keep")
            try:
                server.post("collective_rpc", {"method": "reload_weights", "kwargs": {
                    "weights_path": str(self.root / f"box{i}" / f"v{version}")}})
                server.post("update_weight_version", {"new_version": str(version)})
                server.post("reset_prefix_cache")
            finally:
                server.post("resume")
            return time.monotonic() - t0

        with ThreadPoolExecutor(self.cfg.servers) as pool:
            return max(pool.map(one, range(self.cfg.servers)))

    def wan_bytes(self) -> int:
        return self.bytes

    def stop(self) -> None:
        if hasattr(self, "downloads"):
            self.downloads.shutdown(wait=True, cancel_futures=True)
        super().stop()


STRATEGIES = {"full": _Full, "star": lambda w: _Sparrow(w, True), "swarm": lambda w: _Sparrow(w, False),
              "ideal": _Ideal, "churn": _Churn}
