"""Running the engine test roles (tests/engine/vllm_roles.py) with the engine environment's Python."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = Path(os.environ.get("SPARROWD_ENGINE_PYTHON", ROOT / ".venv-engine" / "bin" / "python"))
VLLM_ENV = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
            "TOKENIZERS_PARALLELISM": "false"}
# The suite's single-worker `vllm serve` runs its worker in the engine core (vLLM's `uni` executor, its
# default for one GPU) rather than in a process of its own, as vLLM's CPU platform would: one vLLM
# import fewer a server, about 15 CPU-seconds. Tensor-parallel servers keep a process per worker.
ONE_WORKER_IN_CORE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def engine_python() -> str:
    if not ENGINE_PYTHON.exists():
        pytest.fail(f"{ENGINE_PYTHON} is missing: make the engine environment as the README's test command does")
    return str(ENGINE_PYTHON)


def role(*args, timeout: float = 300, env: dict | None = None) -> str:
    r = subprocess.run([engine_python(), "-m", "tests.engine.vllm_roles", *map(str, args)], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert r.returncode == 0, f"{args[0]} failed:\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}"
    return r.stdout


def same_params(a: Path, b: Path) -> None:
    x, y = np.load(a), np.load(b)
    assert sorted(x.files) == sorted(y.files)
    for k in x.files:
        assert np.array_equal(x[k], y[k]), (a.name, k)
