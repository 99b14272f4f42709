"""``sparrowd bench coldstart``: empty boxes boot the current policy from the swarm.

A trainer daemon (its uplink capped, in region 0) publishes a model of
``model_mib`` MiB of bf16 with its config and tokenizer: the base as anchor 0,
then ``versions`` RL-like steps (about 1% of the elements nudged) with an
anchor every ``anchor_every``. Then ``boxes`` rollout daemons with empty data
dirs, spread over ``regions`` other regions behind the WAN emulator
(``sparrowd.bench.wan``), start at once. Each fetches the newest anchor and the
patches after it from whoever has them, preferring its region, and writes
``DATA/current``. Reported:

* the time from the boxes' start until every box reports its folder ``ready``
  at the newest version, against the bound: the model's bytes over the
  trainer's uplink (the trainer must send one copy at least);
* the trainer's upload over the model's size (about one copy is the aim);
* the same for ``star``: every box downloads the checkpoint folder from the
  trainer over HTTP through the same WAN and uplink, as a plain download would.
"""

from __future__ import annotations

import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..checkpoint import atomic_file
from ..client import http_call
from ..errors import SparrowError
from ..sizes import format_bytes, parse_size
from . import write_json
from .handover import FileServer, Procs, address, download, start_wan, wait
from .swarm import metric

__all__ = ["ColdstartConfig", "run"]

PROGRESS_EVERY = 15.0  # seconds between progress lines while boxes boot or download

MB = 1 << 20
FILES = {"config.json": '{"model_type": "llama", "hidden_size": 4096}\n',
         "generation_config.json": '{"temperature": 1.0}\n',
         "tokenizer_config.json": '{"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}\n'}


@dataclass
class ColdstartConfig:
    model_mib: int = 256
    boxes: int = 8
    regions: int = 3  # the boxes' regions; the trainer has one of its own
    versions: int = 4
    anchor_every: int = 3
    trainer_rate: str = "4M"
    node_rate: str = "64M"
    link_rate: str = "64M"  # each ordered pair of regions
    rtt: float = 0.05
    star: bool = True
    seed: int = 0


def _model(cfg: ColdstartConfig):
    """bf16 tensors of 4 Mi elements (8 MiB) each, ``model_mib`` MiB in all."""
    import torch

    g = torch.Generator().manual_seed(cfg.seed)
    n = max(1, cfg.model_mib // 8)
    return {f"model.layers.{i}.weight": (torch.randn(2048, 2048, generator=g) * 0.02).to(torch.bfloat16)
            for i in range(n)}


def _step(state, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    for t in state.values():
        mask = torch.rand(t.shape, generator=g) < 0.01
        t[mask] = (t.float()[mask] * 1.01 + 1e-4).to(t.dtype)


def _folder_of(state, folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name, text in FILES.items():
        (folder / name).write_text(text)


def _swarm(cfg: ColdstartConfig, root: Path, state) -> dict:
    from ..localswarm import free_port
    from ..publisher import Publisher

    procs = Procs(root)
    try:
        token_file = root / "swarm.token"
        with atomic_file(token_file, private=True) as tmp:
            tmp.write_text(f"bench-{time.time_ns()}-coldstart-token\n")
        token = token_file.read_text().strip()
        t_host, t_proxy = address(0, 0, 100), address(0, 1, 100)
        port = free_port(t_host)
        proxies = [{"listen": [t_proxy, port], "target": [t_host, port], "region": 0}]
        boxes = []
        for i in range(cfg.boxes):
            r = 1 + i % cfg.regions
            host = address(r, 0, i)
            p = free_port(host)
            proxies.append({"listen": [address(r, 1, i), p], "target": [host, p], "region": r})
            boxes.append((i, r, host, p))
        start_wan(procs, root, proxies, cfg)
        procs.daemon("--role", "trainer", "--region", "r0", "--listen", f"{t_host}:{port}", "--advertise",
                     f"{t_proxy}:{port}", "--data-dir", str(root / "trainer"), "--token-file", str(token_file),
                     "--node-id", "trainer", "--upload-rate", cfg.trainer_rate, "--lease-ttl", "3",
                     "--log-level", "warning", name="trainer")
        wait(lambda: (root / "trainer" / "daemon.json").exists(), 30, "the trainer")
        direct = f"http://{t_host}:{port}"
        src = root / "model"
        _folder_of({}, src)  # the files the anchors carry
        pub = Publisher(daemon=direct, token_file=token_file, anchor_every=cfg.anchor_every, model_files=src)
        t0 = time.perf_counter()
        print(f"   swarm: publishing versions 0-{cfg.versions} from the trainer...", flush=True)
        pub.start(state, version=0)
        for v in range(1, cfg.versions + 1):
            _step(state, cfg.seed + v)
            pub.publish(state, version=v)
        publish_s = time.perf_counter() - t0
        pub.close()
        up_before = metric(direct, token, "sparrowd_bytes_total{direction=\"up\",region_class=\"other\"}")
        start = time.perf_counter()
        for i, r, host, p in boxes:
            procs.daemon("--role", "rollout", "--region", f"r{r}", "--listen", f"{host}:{p}", "--advertise",
                         f"{address(r, 1, i)}:{p}", "--data-dir", str(root / f"box{i}"), "--token-file",
                         str(token_file), "--node-id", f"box{i}", "--tracker", f"http://{t_proxy}:{port}",
                         "--upload-rate", cfg.node_rate, "--engine-socket", "off", "--log-level", "warning",
                         name=f"box{i}")
        ready: dict[int, float] = {}
        print(f"   swarm: {cfg.boxes} empty boxes joining, each booting version {cfg.versions} into DATA/current...",
              flush=True)
        told = [start]

        def all_ready() -> bool:
            if time.perf_counter() - told[0] >= PROGRESS_EVERY:
                told[0] = time.perf_counter()
                print(f"   ... {len(ready)} of {cfg.boxes} boxes ready after {told[0] - start:.0f} s", flush=True)
            for i, *_ in boxes:
                if i in ready:
                    continue
                try:
                    info = json.loads((root / f"box{i}" / "daemon.json").read_text())
                    cur = http_call(f"{info['url']}/v1/node", token, timeout=5)["current"]
                except (OSError, ValueError, KeyError, SparrowError):
                    continue
                if cur and cur["state"] == "ready" and cur["version"] == cfg.versions:
                    ready[i] = time.perf_counter() - start
            return len(ready) == len(boxes)

        wait(all_ready, 3600, "every box's folder", every=0.2)
        seconds = time.perf_counter() - start
        up = metric(direct, token, "sparrowd_bytes_total{direction=\"up\",region_class=\"other\"}") - up_before
        # Every folder is the trainer's last version, bit for bit (its fingerprints were checked as it was
        # written; here the bytes are compared once more with the trainer's own tensors).
        import torch

        from ..checkpoint import open_checkpoint

        want = {n: t.contiguous().view(torch.int16).reshape(-1).numpy().view("<u2") for n, t in state.items()}
        for i, *_ in boxes[:2]:
            with open_checkpoint(root / f"box{i}" / "current") as c:
                assert all(np.array_equal(c[n].bits, want[n]) for n in want), f"box{i}'s folder differs"
        return {"seconds": seconds, "per_box": [ready[i] for i, *_ in boxes], "trainer_upload": up,
                "publish_seconds": publish_s}
    finally:
        procs.stop()


def _star(cfg: ColdstartConfig, root: Path, state) -> dict:
    """Every box downloads the checkpoint folder from the trainer over HTTP (the uplink shaped)."""
    from ..localswarm import free_port

    procs = Procs(root)
    try:
        host, proxy = address(0, 0, 100), address(0, 1, 100)
        port = free_port(host)
        start_wan(procs, root, [{"listen": [proxy, port], "target": [host, port], "region": 0}], cfg)
        served = root / "served"
        _folder_of(state, served / "latest")
        names = sorted(p.name for p in (served / "latest").iterdir())
        FileServer(served, host, port, parse_size(cfg.trainer_rate)).start()
        model = sum((served / "latest" / n).stat().st_size for n in names)
        print(f"   star: {cfg.boxes} boxes each downloading the model from the trainer, about "
              f"{cfg.boxes * model / parse_size(cfg.trainer_rate):.0f} s at its uplink (--no-star skips this)...",
              flush=True)
        start = time.perf_counter()
        with ThreadPoolExecutor(cfg.boxes) as pool:
            futures = [pool.submit(download, proxy, port, address(1 + i % cfg.regions, 2, i), "latest", names,
                                   root / f"box{i}") for i in range(cfg.boxes)]
            while futures_wait(futures, timeout=PROGRESS_EVERY).not_done:
                print(f"   ... {sum(f.done() for f in futures)} of {cfg.boxes} boxes downloaded after "
                      f"{time.perf_counter() - start:.0f} s", flush=True)
            sizes = [f.result() for f in futures]
        return {"seconds": time.perf_counter() - start, "trainer_upload": sum(sizes)}
    finally:
        procs.stop()


def run(cfg: ColdstartConfig | None = None, *, json_path: str | None = None) -> dict:
    cfg = cfg or ColdstartConfig()
    state = _model(cfg)
    model_bytes = sum(t.numel() * 2 for t in state.values())
    rate = parse_size(cfg.trainer_rate)
    bound = model_bytes / rate
    print(f"sparrowd bench coldstart: a {model_bytes / MB:.0f} MiB bf16 model, {cfg.versions} versions (anchor every "
          f"{cfg.anchor_every}), then {cfg.boxes} empty boxes in {cfg.regions} regions join at once", flush=True)
    print(f"   trainer uplink {format_bytes(rate)}/s, boxes {cfg.node_rate}/s, {cfg.rtt * 1000:.0f} ms RTT and "
          f"{cfg.link_rate}/s between regions; bound (model / trainer uplink): {bound:.1f} s", flush=True)
    out = {"config": asdict(cfg), "model_bytes": model_bytes, "bound_seconds": bound}
    with tempfile.TemporaryDirectory(prefix="sparrowd-coldstart-") as tmp:
        root = Path(tmp)
        (root / "swarm").mkdir()
        s = _swarm(cfg, root / "swarm", state)
        out["swarm"] = s
        print(f"swarm: every box ready in {s['seconds']:.1f} s = {s['seconds'] / bound:.2f}x the bound; trainer "
              f"uploaded {s['trainer_upload'] / model_bytes:.2f}x the model (boxes ready from "
              f"{min(s['per_box']):.1f} to {max(s['per_box']):.1f} s)", flush=True)
        if cfg.star:
            (root / "star").mkdir()
            st = _star(cfg, root / "star", state)
            out["star"] = st
            print(f"star:  every box downloaded in {st['seconds']:.1f} s = {st['seconds'] / bound:.2f}x the bound; "
                  f"trainer uploaded {st['trainer_upload'] / model_bytes:.2f}x the model; "
                  f"{st['seconds'] / s['seconds']:.1f}x the swarm's time", flush=True)
    targets = [("every box ready within 1.3x the bound", s["seconds"] <= 1.3 * bound),
               ("trainer upload at most 1.2x the model", s["trainer_upload"] <= 1.2 * model_bytes)]
    if cfg.star:
        targets.append(("star at least 4x slower than the swarm", out["star"]["seconds"] >= 4 * s["seconds"]))
    out["targets"] = {name: ok for name, ok in targets}
    for name, ok in targets:
        print(f"{'PASS' if ok else 'MISS'}  {name}", flush=True)
    if json_path:
        write_json(json_path, out)
    return out
