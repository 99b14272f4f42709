"""The codec and the command must work where torch is not installed (relays, plain hosts)."""

import subprocess
import sys

SCRIPT = r"""
import sys
sys.modules["torch"] = None  # any import of torch now fails
import numpy as np
from pathlib import Path
from sparrowd.checkpoint import TensorSpec, write_safetensors
from sparrowd.cli.main import main

d = Path(sys.argv[1])
rng = np.random.default_rng(0)
a = rng.integers(0, 1 << 16, size=20000, dtype=np.uint16)
b = a.copy(); b[::97] ^= 1
write_safetensors(d / "a.safetensors", [TensorSpec("w", "BF16", (200, 100), a)])
write_safetensors(d / "b.safetensors", [TensorSpec("w", "BF16", (200, 100), b)])
assert main(["delta", "diff", str(d / "a.safetensors"), str(d / "b.safetensors"), "-o", str(d / "p.sprw"), "-q"]) == 0
assert main(["delta", "apply", str(d / "a.safetensors"), str(d / "p.sprw"), "-o", str(d / "c.safetensors"), "-q"]) == 0
assert (d / "c.safetensors").read_bytes() == (d / "b.safetensors").read_bytes()
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
print("ok")
"""


def test_round_trip_without_torch(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_the_vllm_entry_point_imports_nothing_heavy():
    # vLLM loads the entry point in every one of its processes, and `import sparrowd` happens
    # in relays and plain hosts: neither may pull in torch or vLLM until the backend is used.
    from importlib.metadata import entry_points

    [ep] = [e for e in entry_points(group="vllm.general_plugins") if e.name == "sparrowd"]
    assert ep.value == "sparrowd.integrations.vllm_plugin:register"
    script = ("import sys, sparrowd, sparrowd.integrations.vllm_plugin as p; "
              "assert callable(p.register); "
              "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
