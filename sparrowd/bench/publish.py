"""``sparrowd bench publish``: the Publisher on a synthetic bf16 model, against a bare compare.

A trainer daemon runs on loopback; a model of ``size_mib`` MiB of bf16 in
64 MiB tensors has about 1% of its elements moved by one ulp per step. For
each step it times ``Publisher.publish`` (compare on the device, gather,
fingerprint, encode, hand every chunk to the daemon, manifest) beside a pass
that only compares the same tensors with the same library (torch), and the
time until the daemon has taken the first chunk. The base goes first, whole,
as anchor 0; its time is reported too.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

TENSOR_MIB = 64


def run(*, size_mib: int = 1024, steps: int = 3, density: float = 0.01, json_path: str | None = None) -> int:
    import numpy as np
    import torch

    from ..publisher import Publisher

    from .trainer import trainer_daemon

    rows = []
    with trainer_daemon("sparrowd-bench-publish-", "--retain", "2") as trainer:
        g = torch.Generator().manual_seed(0)
        n = TENSOR_MIB * (1 << 20) // 2
        model = {f"layers.{i}.weight": (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
                 for i in range(max(1, size_mib // TENSOR_MIB))}
        total = sum(t.numel() for t in model.values())
        print(f"sparrowd bench publish: {total * 2 / (1 << 30):.2f} GiB of bf16 in {len(model)} tensors, "
              f"{100 * density:.1f}% of elements moved by one ulp per step, torch {torch.__version__} "
              f"({torch.get_num_threads()} threads), {os.cpu_count()} CPUs")
        pub = Publisher(daemon=trainer.url, token_file=trainer.token_file, anchor_every=0)
        a = pub.start(model, version=0)  # the base, published whole as anchor 0
        print(f"   anchor 0 (the base, whole): {a.total_seconds:.2f} s, {a.patch_bytes / (1 << 20):.0f} MiB in "
              f"{a.chunks} chunks (encode {a.encode_seconds:.2f} s, hand-off {a.handoff_seconds:.2f} s)", flush=True)
        for step in range(1, steps + 1):
            before = {k: v.clone() for k, v in model.items()}
            for v in model.values():
                idx = torch.randint(0, n, (int(n * density),), generator=g)
                v.view(torch.int16)[idx] += 1
            t0 = time.perf_counter()
            changed = sum(int(torch.count_nonzero(model[k].view(torch.int16) != before[k].view(torch.int16)))
                          for k in model)
            t_torch = time.perf_counter() - t0
            t0 = time.perf_counter()
            seen = sum(int(np.count_nonzero(model[k].view(torch.int16).numpy() != before[k].view(torch.int16).numpy()))
                       for k in model)
            t_compare = time.perf_counter() - t0
            assert seen == changed
            del before
            stats = pub.publish(model, version=step)
            if stats.elements_changed != changed:
                raise RuntimeError(f"the patch carries {stats.elements_changed} changes, the compare saw {changed}")
            row = {**stats.to_json(), "compare_only_seconds": t_compare, "torch_compare_seconds": t_torch,
                   "publish_over_compare": stats.total_seconds / t_compare}
            rows.append(row)
            print(f"   step {step}: publish {stats.total_seconds:.3f} s vs compare-only {t_compare:.3f} s with numpy "
                  f"({row['publish_over_compare']:.2f}x; torch's compare: {t_torch:.3f} s); first chunk at the daemon after "
                  f"{stats.first_chunk_seconds:.3f} s; {stats.patch_bytes / (1 << 20):.1f} MiB in {stats.chunks} "
                  f"chunks; compare {stats.compare_seconds:.3f} s, to host {stats.to_host_seconds:.3f} s, "
                  f"encode {stats.encode_seconds:.3f} s, hand-off {stats.handoff_seconds:.3f} s", flush=True)
        pub.close()
    worst = max(r["publish_over_compare"] for r in rows)
    print(f"\n   publish / compare-only (worst step) {worst:.2f}  <= 1.5  {'PASS' if worst <= 1.5 else 'MISS'}")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2))
    return 0
