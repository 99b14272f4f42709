"""Helpers shared by tests: checkpoints written by the safetensors library itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def sparrowd(*args: str, **kw) -> subprocess.CompletedProcess:
    """Run the installed command as a user would."""
    return subprocess.run([sys.executable, "-m", "sparrowd.cli.main", *map(str, args)],
                          capture_output=True, text=True, **kw)


BENCH = Path(__file__).resolve().parent.parent / "bench"  # the harnesses that are not installed


def bench_script(name: str, *args: str, **kw) -> subprocess.CompletedProcess:
    """Run ``python bench/NAME.py ARGS`` as a user would, from the checkout."""
    return subprocess.run([sys.executable, str(BENCH / f"{name}.py"), *map(str, args)],
                          capture_output=True, text=True, **kw)


def bench_module(name: str):
    """``bench/NAME.py`` as a module, for the tests of its pure parts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": (torch.randn(512, 64, generator=g) * 0.02).to(torch.bfloat16),
        "model.layers.0.mlp.weight": (torch.randn(256, 64, generator=g) * 0.02).to(torch.bfloat16),
        "model.layers.0.norm.weight": torch.ones(64, dtype=torch.bfloat16),
        "model.layers.1.mlp.weight": (torch.randn(256, 64, generator=g) * 0.02).to(torch.bfloat16),
        "lm_head.weight": (torch.randn(512, 64, generator=g) * 0.02).to(torch.float32),
        "step": torch.tensor(3, dtype=torch.int64),
    }


def step(state: dict[str, torch.Tensor], seed: int, frac: float = 0.01) -> dict[str, torch.Tensor]:
    """An RL-like step: about ``frac`` of elements nudged, a NaN and a -0.0 for good measure."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        v = v.clone()
        if v.is_floating_point():
            mask = torch.rand(v.shape, generator=g) < frac
            v[mask] = (v.float()[mask] * 1.01 + 1e-4).to(v.dtype)
        out[k] = v
    out["model.layers.0.norm.weight"][0] = float("nan")
    out["model.layers.0.norm.weight"][1] = -0.0
    return out


def save_folder(state: dict[str, torch.Tensor], path: Path, shards: int = 2) -> Path:
    """A Hugging Face style sharded folder with an index, plus a config.json."""
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {}
    for i, f in enumerate(files):
        part = {n: state[n] for n in names[i::shards]}
        save_file(part, str(path / f), metadata={"format": "pt"})
        weight_map.update({n: f for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text('{"model_type": "toy"}\n')
    return path


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if sorted(a) != sorted(b):
        return False
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not torch.equal(x.reshape(-1).contiguous().view(torch.uint8), y.reshape(-1).contiguous().view(torch.uint8)):
            return False
    return True
