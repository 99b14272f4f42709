#!/usr/bin/env python3
"""Write two bf16 model folders, v0 and v1, where v1 changes about 1% of elements.

Needs only numpy and sparrowd (no torch): weights are drawn as float32,
rounded to bf16 bit patterns, and v1 moves a random 1% of them by one ulp,
as an AdamW step at a small learning rate does. For the README quickstart.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from sparrowd.checkpoint import INDEX_NAME, TensorSpec, write_safetensors


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def layers(hidden: int, n_layers: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (hidden, hidden)),
            (p + "self_attn.v_proj.weight", (hidden, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.up_proj.weight", (4 * hidden, hidden)),
            (p + "mlp.down_proj.weight", (hidden, 4 * hidden)),
        ]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def write_folder(path: Path, tensors: dict[str, tuple[tuple[int, ...], np.ndarray]], shards: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        write_safetensors(path / fname, [TensorSpec(n, "BF16", tensors[n][0], tensors[n][1]) for n in part])
        weight_map.update({n: fname for n in part})
    total = sum(t[1].nbytes for t in tensors.values())
    index = {
        "metadata": {"total_size": total},
        "weight_map": {n: weight_map[n] for f in sorted(set(weight_map.values())) for n in names if weight_map[n] == f},
    }
    (path / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    (path / "config.json").write_text(
        json.dumps({"model_type": "sparrowd-synthetic", "hidden_size": tensors[names[0]][0][1]}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder to create; v0/ and v1/ go inside")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    v0, v1 = {}, {}
    for name, shape in layers(a.hidden, a.layers, a.vocab):
        n = int(np.prod(shape))
        w = np.ones(n, np.float32) if name.endswith("norm.weight") else rng.standard_normal(n, np.float32) * 0.02
        b0 = bf16_bits(w)
        b1 = b0.copy()
        pos = np.flatnonzero(rng.random(n) < a.density)
        step = np.where(rng.random(pos.size) < 0.5, 1, -1).astype(np.int32)
        b1[pos] = (b0[pos].astype(np.int32) + step).astype(np.uint16)  # one ulp in magnitude, either way
        v0[name], v1[name] = (shape, b0), (shape, b1)
    write_folder(a.out / "v0", v0, a.shards)
    write_folder(a.out / "v1", v1, a.shards)
    size = sum(b.nbytes for _, b in v0.values())
    print(f"wrote {a.out}/v0 and {a.out}/v1: {len(v0)} bf16 tensors, "
          f"{size / 2**20:.1f} MiB each, ~{100 * a.density:g}% changed")


if __name__ == "__main__":
    main()
