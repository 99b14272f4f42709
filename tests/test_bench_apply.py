"""``sparrowd bench apply --engine torch``: a PatchApplier over a Qwen3-shaped state dict takes
each step through a real trainer daemon's engine socket, and the figures are its own."""

import json
import math
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from sparrowd.bench.apply import qwen3_shapes, run  # noqa: E402
from sparrowd.errors import InputError  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_torch_engine_takes_every_step_and_reports_its_pause_beside_the_reloads(tmp_path, capsys):
    out = tmp_path / "apply.json"
    assert run(engine="torch", size_mib=64, steps=2, json_path=str(out)) == 0
    printed = capsys.readouterr().out
    figures = json.loads(out.read_text())
    assert figures["engine"] == "torch" and figures["device"] == "cpu"
    assert figures["model_bytes"] == 2 * sum(math.prod(s) for s in qwen3_shapes(64).values())
    assert [r["step"] for r in figures["steps"]] == [1, 2]
    for r in figures["steps"]:
        # the elements the step drew (a few twice) reached the engine; the weights were checked equal
        assert 0.98 * r["elements_changed"] < r["elements"] <= r["elements_changed"]
        assert 0 < r["scatter_seconds"] <= r["update_seconds"] and r["decoded_seconds"] > 0
    assert figures["reload_seconds"] > 0 and figures["reload_floor_seconds"] > 0
    assert printed.count("weights identical to the trainer's") == 2
    assert "the reload takes" in printed


def test_qwen3_shapes_follow_the_size_asked_for():
    for mib in (64, 512, 4096, 16384):
        shapes = qwen3_shapes(mib)
        total = sum(2 * math.prod(s) for s in shapes.values())
        assert "lm_head.weight" in shapes and "model.layers.1.mlp.down_proj.weight" in shapes
        assert 0.9 < total / (mib << 20) < 1.1, (mib, total)
    assert qwen3_shapes(16384)["model.embed_tokens.weight"] == (151936, 4096)  # Qwen3-8B's widths


def test_a_device_without_the_torch_engine_or_unknown_to_torch_is_refused():
    with pytest.raises(InputError, match="--engine torch"):
        run(engine="vllm", device="cuda", size_mib=64, steps=1)
    with pytest.raises(InputError, match="device 'nonsense'"):
        run(engine="torch", device="nonsense", size_mib=64, steps=1)
    r = subprocess.run([sys.executable, "-m", "sparrowd.cli.main", "bench", "apply", "--engine", "tensorrt"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice: 'tensorrt'" in r.stderr


@pytest.mark.parametrize("bench, also", [("apply", "--engine torch"), ("rl", ".venv-engine/bin/sparrowd bench rl"),
                                         ("serve", ".venv-engine/bin/sparrowd bench serve")])
def test_a_bench_that_needs_vllm_says_where_it_runs_in_one_line(bench, also):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("transformers") is not None:
        pytest.skip("this environment has vLLM: the benchmark would run")
    r = subprocess.run([sys.executable, "-m", "sparrowd.cli.main", "bench", bench], capture_output=True, text=True,
                       timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "needs vLLM and transformers" in lines[0] and also in lines[0]
