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
  engine socket, no network at all: the "single datacenter" reference;
* ``churn`` (``--churn``, after the others): ``swarm`` while boxes come and
  go. After a third of the steps, a box kept current by follow mode is
  killed (daemon and server) and an empty box joins: a cold start from the
  swarm, ``vllm serve DATA/current``, then follow mode. The trainer side does
  nothing about either. The JSON gives each server's version per step.

The loop: a tiny Qwen3 (random init) samples completions on real ``vllm
serve`` processes (CPU) in regions other than the trainer's; the reward is a
rule over the generated token ids (the share of ids below ``TARGET``); a
GRPO-style update (group-normalised advantages, policy gradient on the
sampled tokens) steps AdamW on fp32 master weights; the bf16 cast is what
the servers get. One-step off-policy by default: generation of batch k runs
on version k-2 while version k-1 travels, as SparrowRL does; ``on_policy``
makes generation k wait for version k-1.

Every strategy is bit-exact, so all must give identical rewards and
identical server weights (vLLM's ``/weight_checker`` checksums) at every
step, and the box that joined mid-run must end with the steady servers'
weights and greedy outputs; the benchmark checks all of it and fails loudly
otherwise.

The WAN is the swarm benchmark's (``sparrowd.bench.wan``): regions on their
own loopback blocks, proxies adding round-trip time and shaping each ordered
pair of regions; the trainer's uplink is its daemon's upload limit (``full``:
the file server's, at the same rate).
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint import atomic_file
from ..sizes import format_bytes, parse_size
from . import needs_vllm, write_json
from .handover import STRATEGIES, Strategy, address, save_bf16, wait

if TYPE_CHECKING:
    from .vllm_server import VllmServer

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
    join_pace: float = 0.0  # ``churn``: while the empty box boots, a step lasts at least this long (s)
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
    paced: float = 0.0  # waited out at the end so that the step lasted ``join_pace``
    wire: float | None = None  # publish to every rollout box holding the version (overlaps the next steps)
    tokens: int = 0
    reward: float = 0.0
    wan_bytes: int = 0
    versions: dict = field(default_factory=dict)  # server -> the version it ran as the step generated


@dataclass
class StrategyResult:
    name: str
    steps: list[StepRecord] = field(default_factory=list)
    checksums: dict = field(default_factory=dict)  # version -> the servers' weight checksums
    seconds: float = 0.0
    after: dict | None = None  # what the strategy reports beyond the steps (``churn``)

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
                          for k in ("generate", "train", "publish", "wait", "pause", "paced")},
                "wire_seconds": [s.wire for s in self.steps],
                "versions": {name: [s.versions.get(name) for s in self.steps]
                             for name in dict.fromkeys(k for s in self.steps for k in s.versions)},
                **({"churn": self.after} if self.after else {})}


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


# ---------------------------------------------------------------------------- the run


class _World:
    def __init__(self, cfg: RLConfig, root: Path):
        self.cfg, self.root = cfg, root
        self.token_file = root / "swarm.token"
        with atomic_file(self.token_file, private=True) as tmp:
            tmp.write_text(secrets.token_hex(24) + "\n")
        self.token = self.token_file.read_text().strip()
        self.servers: list[VllmServer] = []
        self.base: Path  # the base checkpoint's folder, set once the model is saved
        self.spare: VllmServer | None = None  # ``churn``'s box that leaves

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
    """The step's samples: prompt k goes to server k mod servers, each sample seeded by (step, k, g).

    Each server takes its requests one at a time (the servers run side by side): vLLM's sampling
    on CPU is not batch-invariant (a request's numerics depend on the batch it lands in), and
    requests sent together land in batches that depend on their timing, so concurrent requests
    made runs, and strategies, differ now and then. One at a time, every run computes the same."""
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

    def serve(i):
        return {job: one(job) for job in jobs if job[0] % len(w.servers) == i}

    with ThreadPoolExecutor(len(w.servers)) as pool:
        done = {job: sample for part in pool.map(serve, range(len(w.servers))) for job, sample in part.items()}
    return [done[job] for job in jobs]


def _run_strategy(w: _World, strategy: Strategy) -> StrategyResult:
    import torch

    cfg = w.cfg
    res = StrategyResult(strategy.name)
    model = _model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    strategy.start(model)
    wan0 = strategy.wan_bytes()
    try:
        t_run = time.monotonic()
        step = 0
        while step < cfg.steps or strategy.more(time.monotonic() - t_run):
            step += 1
            rec = StepRecord(step)
            t_step = time.monotonic()
            version = step - 1 if cfg.on_policy else max(0, step - 2)
            t0 = time.monotonic()
            rec.pause = strategy.ensure(version)
            rec.wait = time.monotonic() - t0
            if version > 0 and version not in res.checksums:
                res.checksums[version] = [s.post("weight_checker", {"action": "checksum"})["checksums"]
                                          for s in w.servers]
            rec.versions = strategy.versions()
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
            if (rest := strategy.pace() - (time.monotonic() - t_step)) > 0:
                time.sleep(rest)
                rec.paced = rest
            rec.seconds = time.monotonic() - t_step
            res.steps.append(rec)
            print(f"   {strategy.name:<5} step {step}: {rec.seconds:5.2f} s (generate {rec.generate:.2f} on version "
                  f"{version}, train {rec.train:.2f}, publish {rec.publish:.2f}, waited {rec.wait:.2f} for weights, "
                  f"paused {rec.pause:.2f}{f', paced {rec.paced:.2f}' if rec.paced else ''}), reward {rec.reward:.4f}",
                  flush=True)
        # The last versions' transfers finish, so every step's wire time and bytes are known.
        for v in range(1, step + 1):
            wait(lambda v=v: v in strategy.held, 600, f"version {v} to arrive")
        res.seconds = time.monotonic() - t_run
        wan = strategy.wan_bytes() - wan0
        for rec in res.steps:
            rec.wire = strategy.held[rec.step] - strategy.published[rec.step]
            rec.wan_bytes = wan // step
        res.after = strategy.finish(step)
    finally:
        strategy.stop()
    return res


def run(cfg: RLConfig | None = None, *, json_path: str | None = None, plot_path: str | None = None,
        keep: bool = False) -> int:
    cfg = cfg or RLConfig()
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        import vllm  # noqa: F401
    except ImportError as e:
        return needs_vllm("rl", e.name)
    from ..localswarm import free_port
    from .vllm_server import VllmServer

    root = Path(tempfile.mkdtemp(prefix="sparrowd-bench-rl-"))
    w = _World(cfg, root)
    results: list[StrategyResult] = []
    try:
        model = _model(cfg)
        w.base = root / "base"
        save_bf16(model, w.base)
        model_bytes = sum(t.numel() for t in model.state_dict().values()) * 2
        ncpu = os.cpu_count() or 1
        print(f"sparrowd bench rl: starting {cfg.servers} vllm serve (CPU) on a tiny Qwen3 of {model_bytes / MB:.1f} "
              f"MiB bf16 (about half a minute)...", flush=True)
        for i in range(cfg.servers):
            host = address(w.region_of(i), 0, 50 + i)
            server = VllmServer(sys.executable, w.base, free_port(host), host=host, log_path=root / f"server{i}.log",
                                env={"VLLM_CPU_OMP_THREADS_BIND": str(i % ncpu)})
            w.servers.append(server.start())
        if "churn" in cfg.strategies:  # the box that leaves mid-run has its server up from the start
            i = cfg.servers
            host = address(w.region_of(i), 0, 50 + i)
            w.spare = VllmServer(sys.executable, w.base, free_port(host), host=host, log_path=root / "spare.log",
                                 env={"VLLM_CPU_OMP_THREADS_BIND": str(i % ncpu)}).start()
        for s in [*w.servers, *([w.spare] if w.spare else [])]:
            s.wait_ready(600)
        rate = parse_size(cfg.link_rate)
        print(f"   tiny Qwen3 of {model_bytes / MB:.1f} MiB bf16, {cfg.servers} vllm serve (CPU) in "
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
        for s in [*w.servers, *([w.spare] if w.spare else [])]:
            s.stop()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"   folders and logs kept in {root}")

    # Bit-exact: identical rewards and server weights at every step, whatever carried them.
    ref = results[0]
    problems = []
    for r in results[1:]:  # ``churn`` runs on until its joiner has followed: its first steps are compared
        if [s.reward for s in r.steps[:len(ref.steps)]] != [s.reward for s in ref.steps]:
            problems.append(f"{r.name}'s rewards differ from {ref.name}'s: {[s.reward for s in r.steps]} vs "
                            f"{[s.reward for s in ref.steps]}")
        if {v: r.checksums.get(v) for v in ref.checksums} != ref.checksums:
            problems.append(f"{r.name}'s server weights differ from {ref.name}'s at versions "
                            f"{sorted(v for v in ref.checksums if r.checksums.get(v) != ref.checksums[v])}")
    for r in results:
        for v, sums in r.checksums.items():
            if any(x != sums[0] for x in sums):
                problems.append(f"{r.name}: the servers disagree on version {v}'s weights")
        if r.after and not r.after["joiner_weights_equal"]:
            problems.append(f"{r.name}: the box that joined mid-run holds other weights than the steady servers at "
                            f"version {len(r.steps)}")
        if r.after and not r.after["joiner_generates_equal"]:
            problems.append(f"{r.name}: the box that joined mid-run generates other greedy tokens or logprobs than "
                            f"the steady servers at version {len(r.steps)}")

    summaries = {r.name: r.summary() for r in results}
    gen = sum(s["split"]["generate"] for s in summaries.values()) / len(summaries)
    full_copy = model_bytes / parse_size(cfg.trainer_rate)
    print(f"\n   a full copy to one box over the trainer's uplink: {full_copy:.1f} s = {full_copy / gen:.1f}x a "
          f"generation phase ({gen:.2f} s)")
    print(f"   {'strategy':<8}{'s/step':>8}{'tokens/s':>10}{'idle':>7}{'WAN/step':>11}  split per step (generate, "
          f"train, publish, wait, pause), wire")
    for name, summary in summaries.items():
        sp = summary["split"]
        wires = [x for x in summary["wire_seconds"] if x is not None]
        print(f"   {name:<8}{summary['seconds_per_step']:8.2f}{summary['tokens_per_second']:10.1f}"
              f"{100 * summary['rollout_idle_fraction']:6.0f}%{format_bytes(summary['wan_bytes_per_step']):>11}  "
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
        sw.update({k: out[k] for k in ("speedup_vs_full", "gap_to_ideal") if k in out})  # also on swarm's entry
        if "speedup_vs_full" in out or "gap_to_ideal" in out:
            print("\n   targets")
        if "speedup_vs_full" in out:
            ok = out["speedup_vs_full"] >= 3
            print(f"   swarm throughput / full broadcast {out['speedup_vs_full']:6.2f}x  >= 3     "
                  f"{'PASS' if ok else 'MISS'}  (SparrowRL: 2.4-9.5x)")
        if "gap_to_ideal" in out:
            ok = out["gap_to_ideal"] <= 0.10
            print(f"   swarm step time over ideal        {100 * out['gap_to_ideal']:5.1f}%  <= 10%   "
                  f"{'PASS' if ok else 'MISS'}  (SparrowRL: 8.91%)")
    for r in results:
        if r.after:
            _print_churn(r, summaries[r.name])
    if json_path:
        write_json(json_path, out)
    if plot_path:
        _plot(summaries, plot_path)
    if problems:
        print("\n   NOT BIT-EXACT:\n   " + "\n   ".join(problems), file=sys.stderr)
        return 1
    print(f"\n   rewards and server weights identical across {', '.join(summaries)} at every step")
    return 0


def _print_churn(r: StrategyResult, summary: dict) -> None:
    a = r.after
    assert a is not None  # printed only for a run that reports one (churn)
    print(f"\n   {r.name}: after step {a['churn_step']}'s publish a box was killed (daemon and server) and an "
          f"empty box joined; the trainer side did nothing")
    print(f"   the joiner's folder was ready on version {a['joiner_folder_version']} in "
          f"{a['joiner_folder_seconds']:.1f} s, its server answered {a['joiner_serving_seconds']:.1f} s after the "
          f"churn, and follow mode had it on the last version {a['joiner_caught_up_after_last_publish']:.1f} s "
          f"after that version's publish")
    print("   version each server ran, step by step (- not serving; the JSON has every step):")
    for name, versions in summary["versions"].items():
        cells = [f"{'-' if v is None else v:>3}" for v in versions]
        if len(cells) > 14:
            cells = [*cells[:4], "...", *cells[-8:]]
        print(f"     {name:<7}" + " ".join(cells))


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
