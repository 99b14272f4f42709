"""``sparrowd demo``: a whole swarm on this machine, a model really trained, every node bit-exact.

A trainer daemon and several rollout daemons in two or more regions run on
loopback as real processes. A small transformer is trained with AdamW for a
few steps; ``Publisher`` publishes each step; each rollout node has an
"engine" (a bf16 copy of the model in this process, fed through the node's
engine socket by ``PatchApplier``). The demo shows each version reaching every
node and checks that every engine's weights equal the trainer's, bit for bit.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, cast

from .errors import SparrowError

if TYPE_CHECKING:
    from .publisher import PublishStats

__all__ = ["run"]

VOCAB = 4096


def _model():
    import torch

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, 256)
            self.blocks = torch.nn.Sequential(*(torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0,
                                                                                 batch_first=True) for _ in range(2)))
            self.norm = torch.nn.LayerNorm(256)
            self.head = torch.nn.Linear(256, VOCAB)

        def forward(self, x):
            return self.head(self.norm(self.blocks(self.embed(x))))

    return TinyLM()


def _bits(model) -> dict:
    import torch

    return {k: v.detach().to(torch.bfloat16).view(torch.int16).clone() for k, v in model.state_dict().items()}


def run(*, nodes: int = 4, regions: int = 2, steps: int = 5, keep: bool = False) -> int:
    try:
        import torch
    except ImportError:
        raise SparrowError("the demo trains a model: pip install 'sparrowd[torch]' (torch==2.13.0 on CPU boxes)")
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from .integrations.engine import EngineClient, sync
    from .integrations.torch import PatchApplier
    from .localswarm import LocalSwarm
    from .publisher import Publisher

    if nodes < 1 or regions < 1 or steps < 1:
        raise SparrowError("--nodes, --regions and --steps must be at least 1")
    names = [f"region-{chr(ord('a') + i)}" for i in range(regions)]
    console = Console()
    t_start = time.monotonic()
    with LocalSwarm(prefix="sparrowd-demo-", keep=keep) as swarm:
        swarm.trainer("--lease-ttl", "3", region=names[0])  # short leases: status catches up within a second
        rollouts = [swarm.rollout(f"node-{i + 1}", names[i % regions]) for i in range(nodes)]
        swarm.wait_joined(nodes + 1)
        console.print(f"[bold]sparrowd demo[/]: a trainer and {nodes} rollout daemons in {regions} regions on "
                      f"loopback ({swarm.root})")

        torch.manual_seed(0)
        model = _model()
        # At this learning rate about 1% of the bf16 elements move per step, as in RL post-training.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        base = _bits(model)
        engines = {}
        for d in rollouts:
            m = _model().to(torch.bfloat16)
            with torch.no_grad():
                for k, t in m.state_dict().items():
                    t.view(torch.int16).copy_(base[k])
            engines[d.name] = (m, PatchApplier(m, version=0),
                               EngineClient(d.engine_socket, token_file=swarm.token_file, engine=f"demo-{d.name}"))
        pub = Publisher(daemon=swarm.url, token_file=swarm.token_file, anchor_every=0)
        pub.start(model, version=0, anchor=False)
        total = sum(t.numel() for t in base.values())
        console.print(f"model: {total / 1e6:.2f}M parameters, served in bf16; training {steps} AdamW steps")

        def table(version: int, seen: dict) -> Table:
            t = Table(title=f"version {version}", title_justify="left", expand=False)
            for col in ("node", "region", "engine", "arrived"):
                t.add_column(col)
            for d in rollouts:
                s = seen.get(d.name)
                t.add_row(d.name, d.region, str(engines[d.name][1].version),
                          "-" if s is None else f"{s:.2f} s")
            return t

        for step in range(1, steps + 1):
            x = torch.randint(0, VOCAB, (16, 32))
            loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), torch.roll(x, -1, 1).reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            stats = cast("PublishStats", pub.publish(model, version=step))  # (one rank: never None)
            t0 = time.monotonic()
            seen: dict[str, float] = {}
            with Live(table(step, seen), console=console, refresh_per_second=8, transient=True) as live:
                deadline = t0 + 60
                while len(seen) < len(rollouts):
                    for d in rollouts:
                        if d.name not in seen and sync(engines[d.name][2], engines[d.name][1], step) >= step:
                            seen[d.name] = time.monotonic() - t0
                    live.update(table(step, seen))
                    if time.monotonic() > deadline:
                        raise SparrowError(f"version {step} did not reach every node in 60 s; logs in {swarm.root}")
                    time.sleep(0.05)
            want = _bits(model)
            for name, (m, _, _) in engines.items():
                got = {k: v.view(torch.int16) for k, v in m.state_dict().items()}
                bad = [k for k in want if not torch.equal(got[k], want[k])]
                if bad:
                    raise SparrowError(f"{name}: {len(bad)} tensors differ from the trainer's after version {step}")
            console.print(f"version {step}: loss {loss.item():.3f}, {stats.elements_changed:,} of {stats.elements:,} "
                          f"elements changed ({100 * stats.density:.2f}%), patch {stats.patch_bytes / 1024:.0f} KiB "
                          f"(full bf16 {2 * total / 1024:.0f} KiB); every node bit-exact after "
                          f"{max(seen.values()):.2f} s")
        for _, _, client in engines.values():
            client.close()
        pub.close()
        time.sleep(1.2)  # one lease renewal: every node's byte counters reach the tracker
        snap = swarm.status()
        wan = sum(n.get("bytes_down_wan", 0) for n in snap["nodes"])
        console.print(f"[green]done[/]: {steps} versions on {nodes} nodes, every engine equal to the trainer bit for "
                      f"bit; {wan / 1024:.0f} KiB crossed regions; {time.monotonic() - t_start:.0f} s in all")
        if keep:
            console.print(f"kept {swarm.root} (daemon logs and data dirs)")
    return 0
