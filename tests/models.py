"""A real small model for the trainer- and engine-side tests, and the bits an engine serves."""

from __future__ import annotations

import numpy as np
import torch

from sparrowd.codec.bits import RawTensor


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 64)
        self.block = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 256)

    def forward(self, x):
        return self.head(self.norm(self.block(self.embed(x))))


def served_bits(model) -> dict[str, RawTensor]:
    """The bf16 bit patterns the engine would serve (floats cast, as the Publisher does)."""
    out = {}
    for k, v in model.state_dict().items():
        assert v.is_floating_point()
        a = v.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy()
        out[k] = RawTensor("BF16", tuple(v.shape), a.reshape(-1).view("<u2").copy())
    return out


def train(model, opt, steps: int = 1) -> None:
    """Real AdamW steps on random next-token batches."""
    for _ in range(steps):
        x = torch.randint(0, 256, (8, 16))
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), torch.roll(x, -1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def trained_setup(seed: int) -> tuple[TinyLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyLM()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def bf16_model(bits: dict[str, RawTensor]) -> TinyLM:
    """A bf16 TinyLM holding the given bits (what an engine loads from the checkpoint)."""
    m = TinyLM().to(torch.bfloat16)
    with torch.no_grad():
        for k, t in m.state_dict().items():
            t.view(torch.int16).view(-1).copy_(torch.from_numpy(bits[k].bits.view(np.int16)))
    return m


def assert_serves(model, bits: dict[str, RawTensor]) -> None:
    for k, t in model.state_dict().items():
        assert np.array_equal(t.view(torch.int16).reshape(-1).numpy().view("<u2"), bits[k].bits), k
