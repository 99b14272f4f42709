"""One rank of an FSDP2 trainer (gloo, CPU) publishing through ``sparrowd.Publisher``.

Run by tests/daemon/test_publisher.py as two processes. Every rank calls
``publish``; rank 0 talks to the daemon and saves the bf16 bits it should have
published for each version, for the test to compare with what the daemon holds.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from sparrowd import Publisher


def main(daemon: str, token_file: str, out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 32))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pub = Publisher(daemon=daemon, token_file=token_file)

    def save(version: int) -> None:
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}  # a collective: every rank
        if rank == 0:
            np.savez(out / f"v{version}.npz", **{k: v.detach().to(torch.bfloat16).view(torch.int16).numpy()
                                                 for k, v in full.items()})

    stats = pub.start(model, version=0)
    assert (stats is None) == (rank != 0), stats
    save(0)
    for version in (1, 2):
        loss = model(torch.randn(8, 64)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        stats = pub.publish(model, version=version)
        assert (stats is None) == (rank != 0), stats
        if rank == 0:
            assert stats.tensors == 4 and stats.elements_changed > 0, stats
        save(version)
    pub.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
    # Under load, gloo's worker threads sometimes abort the interpreter's teardown ("terminate
    # called without an active exception") after all the work is done and checked: skip it.
    sys.stdout.flush()
    os._exit(0)
