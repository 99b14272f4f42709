"""``sparrowd bench rl``: RL across regions end to end, sparrowd against full-weight broadcast.

Runs where vLLM is installed (the engine environment). A real RL loop, small
enough for 2 CPUs, runs four times with the same seeds, prompts and compute,
once per way of handing the trainer's weights to the rollout servers:

* ``full``: after each step the trainer writes the whole bf16 checkpoint and
  serves it over HTTP; each rollout box downloads it through the emulated WAN
  and its server loads it through vLLM's own path (``reload_weights``);
* ``star``: sparrowd patches, every rollout node fetching from the trainer
  only (the WAN emulator lets no connection between rollout regions through);
* ``swarm``: sparrowd as shipped (nodes relay to each other);
* ``ideal``: the servers read each version from the trainer daemon's own
  engine socket, no network at all: the "single datacenter" reference.

The loop: a tiny Qwen3 (random init) samples completions on real ``vllm
serve`` processes (CPU) in regions other than the trainer's; the reward is a
rule over the generated token ids (the share of ids below ``TARGET``); a
GRPO-style update (group-normalised advantages, policy gradient on the
sampled tokens) steps AdamW on fp32 master weights; the bf16 cast is what
the servers get. One-step off-policy by default: generation of batch k runs
on version k-2 while version k-1 travels, as SparrowRL does; ``on_policy``
makes generation k wait for version k-1.

Every strategy is bit-exact, so all four must give identical rewards and
identical server weights (vLLM's ``/weight_checker`` checksums) at every
step; the benchmark checks both and fails loudly otherwise.

The WAN is the swarm benchmark's (``sparrowd.bench.wan``): regions on their
own loopback blocks, proxies adding round-trip time and shaping each ordered
pair of regions; the trainer's uplink is its daemon's upload limit (``full``:
the file server's, at the same rate).
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..units import format_bytes, parse_size
from . import write_json

__all__ = ["RLConfig", "run"]

TARGET = 100  # the reward: the share of generated token ids below this
PROMPT_LEN = 8
VOCAB = 1000
MB = 1 << 20


@dataclass
class RLConfig:
    servers: int = 2
    steps: int = 8
    prompts: int = 8  # per step
    samples: int = 4  # per prompt (the GRPO group)
    max_tokens: int = 32
    hidden: int = 512
    layers: int = 4
    lr: float = 1e-6
    link_rate: str = "4M"  # each ordered pair of regions, bytes/s
    trainer_rate: str = "1280K"  # the trainer's uplink
    node_rate: str = "8M"
    rtt: float = 0.08
    on_policy: bool = False
    strategies: tuple[str, ...] = ("full", "star", "swarm", "ideal")
    seed: int = 0

    @classmethod
    def quick(cls, **kw) -> "RLConfig":
        return cls(**{"steps": 3, "prompts": 4, "samples": 2, "max_tokens": 16, "hidden": 256, "layers": 2, **kw})


@dataclass
class StepRecord:
    step: int
    seconds: float = 0.0
    generate: float = 0.0
    train: float = 0.0
    publish: float = 0.0
    wait: float = 0.0  # the servers idle, waiting for the version they must generate on (pause included)
    pause: float = 0.0  # of that, the servers paused for the update
    wire: float | None = None  # publish to every rollout box holding the version (overlaps the next steps)
    tokens: int = 0
    reward: float = 0.0
    wan_bytes: int = 0


@dataclass
class StrategyResult:
    name: str
    steps: list[StepRecord] = field(default_factory=list)
    checksums: dict = field(default_factory=dict)  # version -> the servers' weight checksums
    seconds: float = 0.0

    def summary(self) -> dict:
        """Figures over the steady state: every step but the first (warm-up, and no version to wait
        for yet), when there are more than two."""
        steady = self.steps[1:] if len(self.steps) > 2 else self.steps
        n = len(steady)
        total = sum(s.seconds for s in steady)
        return {"name": self.name, "steps": len(self.steps), "seconds_per_step": total / n,
                "tokens_per_second": sum(s.tokens for s in steady) / total,
                "rollout_idle_fraction": sum(s.wait for s in steady) / total,
                "wan_bytes_per_step": sum(s.wan_bytes for s in self.steps) / len(self.steps),
                "rewards": [s.reward for s in self.steps],
                "split": {k: sum(getattr(s, k) for s in steady) / n
                          for k in ("generate", "train", "publish", "wait", "pause")},
                "wire_seconds": [s.wire for s in self.steps]}


def _addr(region: int, kind: int, j: int) -> str:
    """127.(10+region).kind.(j+1): kind 0 a daemon or server, 1 its WAN proxy, 2 a download client."""
    return f"127.{10 + region}.{kind}.{j + 1}"


# ---------------------------------------------------------------------------- the policy and its update


def _model(cfg: RLConfig):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    c = Qwen3Config(vocab_size=VOCAB, hidden_size=cfg.hidden, intermediate_size=3 * cfg.hidden,
                    num_hidden_layers=cfg.layers, num_attention_heads=cfg.hidden // 64,
                    num_key_value_heads=max(1, cfg.hidden // 128), head_dim=64, max_position_embeddings=256,
                    tie_word_embeddings=False)
    torch.manual_seed(cfg.seed)
    return Qwen3ForCausalLM(c)


def _save_bf16(model, folder: Path) -> None:
    import copy

    import torch

    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder)


def _prompts(cfg: RLConfig, step: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng([cfg.seed, step])
    return rng.integers(TARGET, VOCAB, (cfg.prompts, PROMPT_LEN)).tolist()  # prompts hold no target ids


def _reward(tokens: list[int]) -> float:
    return sum(t < TARGET for t in tokens) / len(tokens)


def _train_step(model, opt, batch: list[tuple[list[int], list[int], float]], group: int) -> float:
    """One GRPO-style policy-gradient step on (prompt, completion, reward) samples, grouped by
    prompt in order: advantages are rewards normalised within each group."""
    import torch

    prompts = torch.tensor([p for p, _, _ in batch])
    completions = torch.tensor([c for _, c, _ in batch])
    rewards = torch.tensor([r for _, _, r in batch]).view(-1, group)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
    ids = torch.cat([prompts, completions], 1)
    logits = model(input_ids=ids).logits[:, prompts.shape[1] - 1:-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    loss = -(adv.unsqueeze(1) * logp).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


# ---------------------------------------------------------------------------- infrastructure


class _Procs:
    """Child processes of one strategy, stopped together."""

    def __init__(self, root: Path):
        self.root, self.procs = root, []

    def start(self, args: list[str], name: str, **kw) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")
        p = subprocess.Popen(args, stdout=kw.pop("stdout", log), stderr=log, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def daemon(self, *args: str, name: str) -> subprocess.Popen:
        return self.start([sys.executable, "-m", "sparrowd_cli.main", "run", *args], name)

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


def _wait(pred, timeout: float, what: str, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def _wan(procs: _Procs, root: Path, proxies: list[dict], cfg: RLConfig, blocked=()) -> None:
    (root / "wan.json").write_text(json.dumps({"proxies": proxies, "rtt": cfg.rtt,
                                               "link_rate": parse_size(cfg.link_rate), "blocked": blocked}))
    p = procs.start([sys.executable, "-m", "sparrowd.bench.wan", str(root / "wan.json")], "wan",
                    stdout=subprocess.PIPE)
    if p.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"the WAN emulator did not start; see {root / 'wan.log'}")


class _FileServer:
    """The trainer's checkpoints over HTTP, its uplink shaped to ``rate`` bytes/s (all downloads
    share it), in a thread of its own."""

    def __init__(self, folder: Path, host: str, port: int, rate: int):
        self.folder, self.host, self.port, self.rate = folder, host, port, rate
        self._loop = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()

    def start(self) -> "_FileServer":
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

        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(main())


def _download(host: str, port: int, source: str, remote: str, names: list[str], dest: Path) -> int:
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


def _metric(url: str, token: str, name: str) -> float:
    from .swarm import _metric as metric

    return metric(url, token, name)


# ---------------------------------------------------------------------------- the strategies


class _Strategy:
    """How versions reach the servers. ``publish`` after each training step starts the transfer;
    ``ensure(v)`` returns once every server runs version ``v`` (idle time, pause)."""

    name = ""

    def __init__(self, world: "_World"):
        self.w = world
        self.cfg = world.cfg
        self.root = world.root / self.name
        self.root.mkdir()
        self.procs = _Procs(self.root)
        self.held: dict[int, float] = {}  # version -> when every rollout box held it
        self.published: dict[int, float] = {}

    def start(self, model) -> None: ...

    def publish(self, model, version: int) -> None: ...

    def wan_bytes(self) -> int:
        return 0

    def stop(self) -> None:
        self.procs.stop()

    # helpers for the sparrowd strategies

    def _attach(self, sockets: list[Path], token_file: Path) -> None:
        for server, sock in zip(self.w.servers, sockets, strict=True):
            server.post("init_weight_transfer_engine", {"init_info": {
                "socket": str(sock), "token_file": str(token_file), "version": 0, "engine": "bench-rl"}})

    def _update(self, version: int) -> float:
        """Every server moved to ``version`` through the sparrowd backend, at once; the longest pause."""
        def one(server) -> float:
            server.post("start_weight_update")
            t0 = time.monotonic()
            server.post("pause?mode=keep")
            try:
                server.post("update_weights", {"update_info": {"version": version, "timeout": 600}})
                server.post("finish_weight_update", {"weight_version": str(version)})
                server.post("reset_prefix_cache")
            finally:
                server.post("resume")
            return time.monotonic() - t0

        with ThreadPoolExecutor(len(self.w.servers)) as pool:
            return max(pool.map(one, self.w.servers))


class _Sparrow(_Strategy):
    """``swarm``, or ``star`` (rollout regions cannot reach each other)."""

    def __init__(self, world, star: bool):
        self.name = "star" if star else "swarm"
        super().__init__(world)
        self.star = star

    def start(self, model) -> None:
        from ..publisher import Publisher

        cfg, w, root = self.cfg, self.w, self.root
        token_file = w.token_file
        t_host, t_proxy = _addr(0, 0, 100), _addr(0, 1, 100)
        from ..localswarm import free_port

        port = free_port(t_host)
        proxies = [{"listen": [t_proxy, port], "target": [t_host, port], "region": 0}]
        self.nodes = []
        for i in range(cfg.servers):
            r = w.region_of(i)
            host = _addr(r, 0, i)
            p = free_port(host)
            proxies.append({"listen": [_addr(r, 1, i), p], "target": [host, p], "region": r})
            self.nodes.append((i, r, host, p))
        regions = sorted({r for _, r, _, _ in self.nodes})
        blocked = [[a, b] for a in regions for b in regions if a < b] if self.star else []
        _wan(self.procs, root, proxies, cfg, blocked)
        self.direct = f"http://{t_host}:{port}"
        self.procs.daemon("--role", "trainer", "--region", "r0", "--listen", f"{t_host}:{port}", "--advertise",
                          f"{t_proxy}:{port}", "--data-dir", str(root / "trainer"), "--token-file", str(token_file),
                          "--node-id", "trainer", "--upload-rate", cfg.trainer_rate, "--lease-ttl", "3",
                          "--super-seed", "off" if self.star else "on", "--log-level", "warning", name="trainer")
        _wait(lambda: (root / "trainer" / "daemon.json").exists(), 30, "the trainer")
        for i, r, host, p in self.nodes:
            self.procs.daemon("--role", "rollout", "--region", f"r{r}", "--listen", f"{host}:{p}", "--advertise",
                              f"{_addr(r, 1, i)}:{p}", "--data-dir", str(root / f"n{i}"), "--token-file",
                              str(token_file), "--node-id", f"n{i}", "--tracker", f"http://{t_proxy}:{port}",
                              "--upload-rate", cfg.node_rate, "--log-level", "warning", name=f"n{i}")
        self.pub = Publisher(daemon=self.direct, token_file=token_file, anchor_every=0)
        _wait(lambda: len(self.pub.status()["nodes"]) == cfg.servers + 1, 60, "every node to join")
        self.urls = [json.loads((root / f"n{i}" / "daemon.json").read_text())["url"] for i in range(cfg.servers)]
        self.pub.start(model, version=0, anchor=False)  # the servers loaded the base: no anchor to ship
        self._attach([root / f"n{i}" / "engine.sock" for i in range(cfg.servers)], token_file)
        self._watch = ThreadPoolExecutor(1)

    def publish(self, model, version: int) -> None:
        self.pub.publish(model, version=version)
        self.published[version] = time.monotonic()
        self._watch.submit(self._until_held, version)

    def _until_held(self, version: int) -> None:
        from ..daemon.calls import http_call

        token = self.w.token
        _wait(lambda: all(version in http_call(f"{u}/v1/node", token)["versions"] for u in self.urls), 600,
              f"every node to hold version {version}", every=0.05)
        self.held[version] = time.monotonic()

    def ensure(self, version: int) -> float:
        if version == 0:
            return 0.0
        _wait(lambda: version in self.held, 600, f"every node to hold version {version}")  # before any pause
        return self._update(version)

    def wan_bytes(self) -> int:
        return int(sum(_metric(u, self.w.token, 'sparrowd_bytes_total{direction="down",region_class="other"}')
                       for u in self.urls))

    def stop(self) -> None:
        if hasattr(self, "pub"):
            self.pub.close()
        if hasattr(self, "_watch"):
            self._watch.shutdown(wait=False, cancel_futures=True)
        super().stop()


class _Ideal(_Strategy):
    """The servers read each version from the trainer daemon's own engine socket: no network."""

    name = "ideal"

    def start(self, model) -> None:
        from ..localswarm import free_port
        from ..publisher import Publisher

        port = free_port()
        self.procs.daemon("--role", "trainer", "--region", "r0", "--listen", f"127.0.0.1:{port}", "--data-dir",
                          str(self.root / "trainer"), "--token-file", str(self.w.token_file), "--node-id",
                          "trainer", "--log-level", "warning", name="trainer")
        _wait(lambda: (self.root / "trainer" / "daemon.json").exists(), 30, "the trainer")
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


class _Full(_Strategy):
    """The whole bf16 checkpoint over HTTP through the WAN; vLLM's own reload on each box."""

    name = "full"

    def start(self, model) -> None:
        from ..localswarm import free_port

        cfg = self.cfg
        host, proxy = _addr(0, 0, 100), _addr(0, 1, 100)
        self.port = free_port(host)
        self.proxy = proxy
        _wan(self.procs, self.root, [{"listen": [proxy, self.port], "target": [host, self.port], "region": 0}],
             cfg)
        self.served = self.root / "served"
        self.served.mkdir()
        self.files = _FileServer(self.served, host, self.port, parse_size(cfg.trainer_rate)).start()
        self.downloads = ThreadPoolExecutor(cfg.servers)
        self.pending: dict[int, list] = {}
        self.bytes = 0
        self._lock = threading.Lock()
        for s in self.w.servers:
            s.post("update_weight_version", {"new_version": "0"})

    def publish(self, model, version: int) -> None:
        folder = self.served / f"v{version}"
        _save_bf16(model, folder)
        names = sorted(p.name for p in folder.iterdir())
        self.published[version] = time.monotonic()
        futures = [self.downloads.submit(_download, self.proxy, self.port, _addr(self.w.region_of(i), 2, i),
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


# ---------------------------------------------------------------------------- the run


class _World:
    def __init__(self, cfg: RLConfig, root: Path):
        self.cfg, self.root = cfg, root
        self.token_file = root / "swarm.token"
        self.token_file.write_text(secrets.token_hex(24) + "\n")
        os.chmod(self.token_file, 0o600)
        self.token = self.token_file.read_text().strip()
        self.servers = []

    @staticmethod
    def region_of(i: int) -> int:
        """Server i's region: 1, 2, 1, 2, ... (the trainer is region 0)."""
        return 1 + i % 2

    def reset(self) -> None:
        """Every server back on the base weights (vLLM's own reload), version 0."""
        for s in self.servers:
            s.post("pause?mode=keep")
            try:
                s.post("collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(self.base)}})
                s.post("update_weight_version", {"new_version": "0"})
                s.post("reset_prefix_cache")
            finally:
                s.post("resume")


def _generate(w: _World, cfg: RLConfig, step: int, version: int) -> list[tuple[list[int], list[int], float]]:
    from .vllm_server import generate

    prompts = _prompts(cfg, step)
    jobs = [(k, g) for k in range(cfg.prompts) for g in range(cfg.samples)]

    def one(job):
        k, g = job
        server = w.servers[k % len(w.servers)]
        r = generate(server.url, prompts[k], max_tokens=cfg.max_tokens, logprobs=None, temperature=1.0,
                     seed=(cfg.seed * 1_000_003 + step * 10_007 + k * 101 + g) % (1 << 31))
        labels = {s["version"] for s in r["versions"]}
        if labels != {str(version)}:
            raise RuntimeError(f"step {step}: a sample was generated on versions {sorted(labels)}, not {version}")
        return prompts[k], r["tokens"], _reward(r["tokens"])

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


def _run_strategy(w: _World, strategy: _Strategy) -> StrategyResult:
    import torch

    cfg = w.cfg
    res = StrategyResult(strategy.name)
    model = _model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    strategy.start(model)
    wan0 = strategy.wan_bytes()
    try:
        t_run = time.monotonic()
        for step in range(1, cfg.steps + 1):
            rec = StepRecord(step)
            t_step = time.monotonic()
            version = step - 1 if cfg.on_policy else max(0, step - 2)
            t0 = time.monotonic()
            rec.pause = strategy.ensure(version)
            rec.wait = time.monotonic() - t0
            if version > 0 and version not in res.checksums:
                res.checksums[version] = [s.post("weight_checker", {"action": "checksum"})["checksums"]
                                          for s in w.servers]
            t0 = time.monotonic()
            batch = _generate(w, cfg, step, version)
            rec.generate = time.monotonic() - t0
            rec.tokens = sum(len(c) for _, c, _ in batch)
            rec.reward = sum(r for _, _, r in batch) / len(batch)
            t0 = time.monotonic()
            _train_step(model, opt, batch, cfg.samples)
            rec.train = time.monotonic() - t0
            t0 = time.monotonic()
            strategy.publish(model, step)
            rec.publish = time.monotonic() - t0
            rec.seconds = time.monotonic() - t_step
            res.steps.append(rec)
            print(f"   {strategy.name:<5} step {step}: {rec.seconds:5.2f} s (generate {rec.generate:.2f} on version "
                  f"{version}, train {rec.train:.2f}, publish {rec.publish:.2f}, waited {rec.wait:.2f} for weights, "
                  f"paused {rec.pause:.2f}), reward {rec.reward:.4f}", flush=True)
        # The last versions' transfers finish, so every step's wire time and bytes are known.
        for v in range(1, cfg.steps + 1):
            _wait(lambda v=v: v in strategy.held, 600, f"version {v} to arrive")
        res.seconds = time.monotonic() - t_run
        wan = strategy.wan_bytes() - wan0
        for rec in res.steps:
            rec.wire = strategy.held[rec.step] - strategy.published[rec.step]
            rec.wan_bytes = wan // cfg.steps
    finally:
        strategy.stop()
    return res


STRATEGIES = {"full": _Full, "star": lambda w: _Sparrow(w, True), "swarm": lambda w: _Sparrow(w, False),
              "ideal": _Ideal}


def run(cfg: RLConfig | None = None, *, json_path: str | None = None, plot_path: str | None = None,
        keep: bool = False) -> int:
    cfg = cfg or RLConfig()
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        import vllm  # noqa: F401
    except ImportError as e:
        print(f"sparrowd bench rl needs vLLM and transformers ({e.name} is missing): run it with the engine "
              f"environment, e.g. .venv-engine/bin/sparrowd bench rl", file=sys.stderr)
        return 2
    from ..localswarm import free_port
    from .vllm_server import VllmServer

    root = Path(tempfile.mkdtemp(prefix="sparrowd-bench-rl-"))
    w = _World(cfg, root)
    results: list[StrategyResult] = []
    try:
        model = _model(cfg)
        w.base = root / "base"
        _save_bf16(model, w.base)
        model_bytes = sum(t.numel() for t in model.state_dict().values()) * 2
        ncpu = os.cpu_count() or 1
        for i in range(cfg.servers):
            host = _addr(w.region_of(i), 0, 50 + i)
            server = VllmServer(sys.executable, w.base, free_port(host), host=host, log_path=root / f"server{i}.log",
                                env={"VLLM_CPU_OMP_THREADS_BIND": str(i % ncpu)})
            w.servers.append(server.start())
        for s in w.servers:
            s.wait_ready(600)
        rate = parse_size(cfg.link_rate)
        print(f"sparrowd bench rl: tiny Qwen3 of {model_bytes / MB:.1f} MiB bf16, {cfg.servers} vllm serve (CPU) in "
              f"regions {sorted({w.region_of(i) for i in range(cfg.servers)})}, trainer in region 0; "
              f"{cfg.prompts} prompts x {cfg.samples} samples x {cfg.max_tokens} tokens per step, "
              f"{'on-policy' if cfg.on_policy else 'one-step off-policy'}, {cfg.steps} steps, {ncpu} CPUs", flush=True)
        print(f"   WAN: {cfg.rtt * 1000:.0f} ms RTT, {format_bytes(rate)}/s per region pair, trainer uplink "
              f"{cfg.trainer_rate}/s: a full copy to one box takes {model_bytes / parse_size(cfg.trainer_rate):.1f} s",
              flush=True)
        for name in cfg.strategies:
            w.reset()
            results.append(_run_strategy(w, STRATEGIES[name](w)))
    finally:
        for s in w.servers:
            s.stop()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"   folders and logs kept in {root}")

    # Bit-exact: identical rewards and server weights at every step, whatever carried them.
    ref = results[0]
    problems = []
    for r in results[1:]:
        if [s.reward for s in r.steps] != [s.reward for s in ref.steps]:
            problems.append(f"{r.name}'s rewards differ from {ref.name}'s: {[s.reward for s in r.steps]} vs "
                            f"{[s.reward for s in ref.steps]}")
        if r.checksums != ref.checksums:
            problems.append(f"{r.name}'s server weights differ from {ref.name}'s at versions "
                            f"{sorted(v for v in ref.checksums if r.checksums.get(v) != ref.checksums[v])}")
    for r in results:
        for v, sums in r.checksums.items():
            if any(x != sums[0] for x in sums):
                problems.append(f"{r.name}: the servers disagree on version {v}'s weights")

    summaries = {r.name: r.summary() for r in results}
    gen = sum(s["split"]["generate"] for s in summaries.values()) / len(summaries)
    full_copy = model_bytes / parse_size(cfg.trainer_rate)
    print(f"\n   a full copy to one box over the trainer's uplink: {full_copy:.1f} s = {full_copy / gen:.1f}x a "
          f"generation phase ({gen:.2f} s)")
    print(f"   {'strategy':<8}{'s/step':>8}{'tokens/s':>10}{'idle':>7}{'WAN/step':>11}  split per step (generate, "
          f"train, publish, wait, pause), wire")
    for name, s in summaries.items():
        sp = s["split"]
        wires = [x for x in s["wire_seconds"] if x is not None]
        print(f"   {name:<8}{s['seconds_per_step']:8.2f}{s['tokens_per_second']:10.1f}"
              f"{100 * s['rollout_idle_fraction']:6.0f}%{format_bytes(s['wan_bytes_per_step']):>11}  "
              f"{sp['generate']:.2f}, {sp['train']:.2f}, {sp['publish']:.2f}, {sp['wait']:.2f}, {sp['pause']:.2f}; "
              f"wire {min(wires):.2f}-{max(wires):.2f} s")
    out = {"config": asdict(cfg), "model_bytes": model_bytes, "full_copy_over_generation": full_copy / gen,
           "strategies": list(summaries.values()), "identical": not problems, "problems": problems}
    if "swarm" in summaries:
        sw = summaries["swarm"]
        if "full" in summaries:
            out["speedup_vs_full"] = summaries["full"]["seconds_per_step"] / sw["seconds_per_step"]
        if "ideal" in summaries:
            out["gap_to_ideal"] = sw["seconds_per_step"] / summaries["ideal"]["seconds_per_step"] - 1
        print("\n   targets")
        if "speedup_vs_full" in out:
            ok = out["speedup_vs_full"] >= 3
            print(f"   swarm throughput / full broadcast {out['speedup_vs_full']:6.2f}x  >= 3     "
                  f"{'PASS' if ok else 'MISS'}  (SparrowRL: 2.4-9.5x)")
        if "gap_to_ideal" in out:
            ok = out["gap_to_ideal"] <= 0.10
            print(f"   swarm step time over ideal        {100 * out['gap_to_ideal']:5.1f}%  <= 10%   "
                  f"{'PASS' if ok else 'MISS'}  (SparrowRL: 8.91%)")
    if json_path:
        write_json(json_path, out)
    if plot_path:
        _plot(summaries, plot_path)
    if problems:
        print("\n   NOT BIT-EXACT:\n   " + "\n   ".join(problems), file=sys.stderr)
        return 1
    print(f"\n   rewards and server weights identical across {', '.join(summaries)} at every step")
    return 0


def _plot(summaries: dict, path: str) -> None:
    """Tokens per second per strategy, and the step-time split (matplotlib, the `plot` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("   (no plot: pip install 'sparrowd[plot]' for matplotlib)", file=sys.stderr)
        return
    names = list(summaries)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(names, [summaries[n]["tokens_per_second"] for n in names], color="#4a7")
    a.set_ylabel("generated tokens / s")
    a.set_title("RL throughput")
    bottom = [0.0] * len(names)
    for part, color in (("generate", "#4a7"), ("train", "#47a"), ("publish", "#aa4"), ("wait", "#c55")):
        vals = [summaries[n]["split"][part] for n in names]
        b.bar(names, vals, bottom=bottom, label=part if part != "wait" else "wait for weights", color=color)
        bottom = [x + y for x, y in zip(bottom, vals, strict=True)]
    b.set_ylabel("seconds per step")
    b.set_title("where a step goes")
    b.legend()
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
