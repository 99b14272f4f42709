"""``sparrowd bench serve``: what an update costs the requests of a live ``vllm serve`` (named for
the latency it measures: ``serve`` in ``daemon/swarm/`` and ``bench/sim/`` is a peer serving chunks).

Runs where vLLM is installed (the engine environment). A Qwen3 of about
``size_mib`` MiB of bf16 (random init, ``save_pretrained``) is version 0. A
trainer daemon and a rollout daemon in follow mode (``--follow-vllm``) run on
loopback next to a real ``vllm serve`` with the sparrowd backend; client
threads send greedy requests the whole time.

1. Baseline: requests for ``baseline_s`` seconds, no update.
2. Updates: ``steps`` versions, each moving ``density`` of the elements by one
   ulp, published ``gap_s`` apart; the daemon moves the server to each.

Requests whose tokens carry more than one weight version (vLLM's spans)
straddled an update. Their latency (p50, p99) is printed beside that of the
baseline requests, from the same run. The pause each update took (the
follower's pause-to-resume, from the daemon's log) is printed beside vLLM's
own reload of the whole checkpoint in the same server (``reload_weights``
through ``/collective_rpc``, under the same pause), and the server's
weights are checked against that reload: identical checksums.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from . import needs_vllm, write_json

__all__ = ["run"]


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else float("nan")


def _pauses(log: Path) -> list[float]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and e.get("msg") == "moved the vLLM server":
            out.append(float(e["paused_seconds"]))
    return out


def run(*, size_mib: int = 256, steps: int = 4, density: float = 0.01, clients: int = 4, max_tokens: int = 48,
        baseline_s: float = 20.0, gap_s: float = 6.0, json_path: str | None = None) -> int:
    try:
        import torch
        from transformers import Qwen3ForCausalLM
    except ImportError as e:
        return needs_vllm("serve", e.name)

    from ..localswarm import LocalSwarm, free_port
    from ..publisher import Publisher
    from .apply import _config
    from .vllm_server import VllmServer, generate

    with LocalSwarm(prefix="sparrowd-bench-serve-", log_level="info") as swarm:
        root = swarm.root
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(_config(size_mib)).to(torch.bfloat16)
        model.save_pretrained(root / "ckpt0")
        state = model.state_dict()
        total = sum(t.numel() for t in state.values())
        swarm.trainer(region="bench")
        server = VllmServer(sys.executable, root / "ckpt0", free_port(), log_path=root / "server.log")
        node = swarm.rollout("r1", "bench", "--follow-vllm", server.url, "--log-format", "json")
        swarm.wait_joined(2)
        pub = Publisher(daemon=swarm.url, token_file=swarm.token_file, anchor_every=0)
        pub.start(state, version=0, anchor=False)
        server.start()
        try:
            server.wait_ready()
            print(f"sparrowd bench serve: Qwen3 of {total * 2 / (1 << 20):.0f} MiB bf16 ({total / 1e6:.0f}M "
                  f"parameters), vllm serve (CPU, {os.cpu_count()} CPUs), {clients} clients sending greedy "
                  f"requests of {max_tokens} tokens, {100 * density:.1f}% of elements moved per version", flush=True)
            deadline = time.monotonic() + 60
            while not any(n["node_id"] == "r1" and n["engine_version"] == 0 for n in swarm.status()["nodes"]):
                if time.monotonic() > deadline:
                    raise RuntimeError("the follower did not attach the server")
                time.sleep(0.2)

            done = threading.Event()
            results: list[dict] = []
            errors: list[str] = []

            def client(k: int) -> None:
                i = 0
                while not done.is_set():
                    prompt = [(31 * k + 7 * i + j) % 1000 + 1 for j in range(16)]
                    t0 = time.monotonic()
                    try:
                        r = generate(server.url, prompt, max_tokens=max_tokens, logprobs=0)
                    except Exception as e:  # noqa: BLE001 - counted and reported
                        errors.append(str(e))
                        continue
                    results.append({"start": t0, "seconds": time.monotonic() - t0,
                                    "versions": sorted({s["version"] for s in r["versions"]})})
                    i += 1

            threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
            for t in threads:
                t.start()
            time.sleep(baseline_s)
            updates_from = time.monotonic()
            g = torch.Generator().manual_seed(1)
            for step in range(1, steps + 1):
                for t in state.values():
                    bits = t.view(torch.int16).view(-1)
                    idx = torch.randint(0, bits.numel(), (max(1, int(bits.numel() * density)),), generator=g)
                    bits[idx] += 1
                pub.publish(state, version=step)
                time.sleep(gap_s)
            deadline = time.monotonic() + 60
            while server.weight_version() != str(steps):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not reach version {steps}")
                time.sleep(0.2)
            time.sleep(2.0)
            done.set()
            for t in threads:
                t.join(120)

            # vLLM's own way: reload the whole checkpoint of the last version, under the same pause.
            model.save_pretrained(root / f"ckpt{steps}")
            before = server.post("weight_checker", {"action": "checksum"})["checksums"]
            reloads = []
            for _ in range(2):
                t0 = time.monotonic()
                server.post("pause?mode=keep")
                try:
                    server.post("collective_rpc", {"method": "reload_weights",
                                                   "kwargs": {"weights_path": str(root / f"ckpt{steps}")}})
                finally:
                    server.post("resume")
                reloads.append(time.monotonic() - t0)
            after = server.post("weight_checker", {"action": "checksum"})["checksums"]
            if before != after:
                raise RuntimeError("the updated server's weights differ from vLLM's reload of the checkpoint")
            pauses = _pauses(root / f"{node.name}.log")
        finally:
            server.stop()
        pub.close()

    base = [r["seconds"] for r in results if r["start"] < updates_from and len(r["versions"]) == 1]
    straddle = [r["seconds"] for r in results if len(r["versions"]) > 1]
    if errors:
        print(f"   {len(errors)} requests FAILED, e.g. {errors[0]}")
    figures = {
        "model_mib": total * 2 / (1 << 20), "clients": clients, "max_tokens": max_tokens,
        "requests": len(results), "failed": len(errors),
        "baseline": {"n": len(base), "p50": _percentile(base, 0.5), "p99": _percentile(base, 0.99)},
        "straddling": {"n": len(straddle), "p50": _percentile(straddle, 0.5), "p99": _percentile(straddle, 0.99)},
        "update_pause_seconds": pauses, "reload_pause_seconds": reloads,
    }
    b, s = figures["baseline"], figures["straddling"]
    print(f"   requests with no update (baseline): {b['n']}, p50 {b['p50']:.3f} s, p99 {b['p99']:.3f} s")
    print(f"   requests that straddle an update:   {s['n']}, p50 {s['p50']:.3f} s, p99 {s['p99']:.3f} s "
          f"(added: p50 {s['p50'] - b['p50']:+.3f} s, p99 {s['p99'] - b['p99']:+.3f} s)")
    if pauses:
        print(f"   pause per update (pause to resume): {min(pauses):.3f}-{max(pauses):.3f} s, median "
              f"{statistics.median(pauses):.3f} s over {len(pauses)} updates")
    print(f"   vLLM reloading the whole checkpoint under the same pause: {min(reloads):.3f}-{max(reloads):.3f} s"
          + (f" ({min(reloads) / statistics.median(pauses):.1f}x the update's median pause)" if pauses else "")
          + "; weights identical to the updated server's")
    if json_path:
        write_json(json_path, figures)
    return 1 if errors else 0
