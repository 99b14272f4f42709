"""``sparrowd bench publish``: the Publisher on a synthetic bf16 model, against bare passes.

A trainer daemon runs on loopback; a model of ``size_mib`` MiB of bf16 in
64 MiB tensors, on ``device``, has about 1% of its elements moved by one ulp
per step. For each step it times ``Publisher.publish`` (compare, gather,
fingerprint, encode, hand every chunk to the daemon, manifest) and the time
until the daemon has taken the first chunk. The base goes first, whole, as
anchor 0; its time is reported too.

Two targets, each against a baseline measured in the same run:

* the fused CPU path (``device="cpu"``, ``compare="auto"``): publish at most
  1.5x a numpy pass that only compares the same tensors;
* the torch path (a GPU, or ``compare="torch"`` on the CPU, which runs the
  same code): compare-and-extract (compare, nonzero, gather, to host, as
  ``publish`` spends it) at least half the device's copy bandwidth, both in
  bytes of the model per second; the copy is ``clone`` of every tensor on the
  device.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, cast

from . import sync_device, torch_device, write_json

if TYPE_CHECKING:
    from ..publisher import PublishStats

TENSOR_MIB = 64
CPU_TARGET = 1.5  # publish / bare compare, fused CPU path
DEVICE_TARGET = 0.5  # compare-and-extract bandwidth / copy bandwidth, torch path


def _copy_seconds(torch, model: dict, device) -> float:
    """Best of three clones of every tensor: the device's copy bandwidth for these tensors."""
    best = float("inf")
    for _ in range(3):
        sync_device(torch, device)
        t0 = time.perf_counter()
        copies = [t.clone() for t in model.values()]
        sync_device(torch, device)
        best = min(best, time.perf_counter() - t0)
        del copies
    return best


def run(*, size_mib: int = 1024, steps: int = 3, density: float = 0.01, device: str = "cpu",
        compare: str = "auto", values: str = "ulp", json_path: str | None = None) -> int:
    import numpy as np
    import torch

    from ..publisher import Publisher
    from .trainer import trainer_daemon

    dev = torch_device(torch, device)
    fused = dev.type == "cpu" and compare == "auto"
    rows = []
    with trainer_daemon("sparrowd-bench-publish-", "--retain", "2") as trainer:
        g = torch.Generator(device=dev).manual_seed(0)
        n = TENSOR_MIB * (1 << 20) // 2
        model = {f"layers.{i}.weight": (torch.randn(n, generator=g, device=dev) * 0.02).to(torch.bfloat16)
                 for i in range(max(1, size_mib // TENSOR_MIB))}
        total = sum(t.numel() for t in model.values())
        model_bytes = 2 * total
        where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{os.cpu_count()} CPUs"
        print(f"sparrowd bench publish: {model_bytes / (1 << 30):.2f} GiB of bf16 in {len(model)} tensors on "
              f"{dev} ({where}), {100 * density:.1f}% of elements moved by one ulp per step, torch "
              f"{torch.__version__} ({torch.get_num_threads()} threads), "
              f"{'fused C compare' if fused else 'torch compare'}, values {values}")
        t_copy = None if fused else _copy_seconds(torch, model, dev)
        if t_copy is not None:
            print(f"   device copy (clone of every tensor, best of 3): {t_copy:.3f} s, "
                  f"{model_bytes / t_copy / 1e9:.1f} GB/s")
        pub = Publisher(daemon=trainer.url, token_file=trainer.token_file, anchor_every=0, compare=compare,
                        values=values)
        # the base, published whole as anchor 0 (one rank: never None)
        a = cast("PublishStats", pub.start(model, version=0))
        print(f"   anchor 0 (the base, whole): {a.total_seconds:.2f} s, {a.patch_bytes / (1 << 20):.0f} MiB in "
              f"{a.chunks} chunks (encode {a.encode_seconds:.2f} s, hand-off {a.handoff_seconds:.2f} s)", flush=True)
        for step in range(1, steps + 1):
            before = {k: v.clone() for k, v in model.items()}
            for v in model.values():
                idx = torch.randint(0, n, (int(n * density),), generator=g, device=dev)
                v.view(torch.int16)[idx] += 1
            sync_device(torch, dev)
            t0 = time.perf_counter()
            changed = sum(int(torch.count_nonzero(model[k].view(torch.int16) != before[k].view(torch.int16)))
                          for k in model)
            t_torch = time.perf_counter() - t0
            row = {"torch_compare_seconds": t_torch}
            if fused:
                t0 = time.perf_counter()
                seen = sum(int(np.count_nonzero(model[k].view(torch.int16).numpy()
                                                != before[k].view(torch.int16).numpy())) for k in model)
                row["compare_only_seconds"] = time.perf_counter() - t0
                assert seen == changed
            del before
            stats = cast("PublishStats", pub.publish(model, version=step))  # (one rank: never None)
            if stats.elements_changed != changed:
                raise RuntimeError(f"the patch carries {stats.elements_changed} changes, the compare saw {changed}")
            row.update(stats.to_json())
            line = (f"   step {step}: publish {stats.total_seconds:.3f} s; first chunk at the daemon after "
                    f"{stats.first_chunk_seconds:.3f} s; {stats.patch_bytes / (1 << 20):.1f} MiB in {stats.chunks} "
                    f"chunks; compare {stats.compare_seconds:.3f} s (summed over its threads), to host "
                    f"{stats.to_host_seconds:.3f} s, encode {stats.encode_seconds:.3f} s, hand-off "
                    f"{stats.handoff_seconds:.3f} s")
            if fused:
                row["publish_over_compare"] = stats.total_seconds / row["compare_only_seconds"]
                line += (f"\n      vs compare-only {row['compare_only_seconds']:.3f} s with numpy "
                         f"({row['publish_over_compare']:.2f}x; torch's compare: {t_torch:.3f} s)")
            else:
                assert t_copy is not None  # (measured whenever the publish is not fused)
                extract = stats.compare_seconds + stats.to_host_seconds
                row["extract_gb_per_s"] = model_bytes / extract / 1e9
                row["copy_gb_per_s"] = model_bytes / t_copy / 1e9
                row["extract_over_copy"] = row["extract_gb_per_s"] / row["copy_gb_per_s"]
                line += (f"\n      compare-and-extract {extract:.3f} s = {row['extract_gb_per_s']:.1f} GB/s, "
                         f"{row['extract_over_copy']:.2f}x the copy's {row['copy_gb_per_s']:.1f} GB/s")
            rows.append(row)
            print(line, flush=True)
        pub.close()
    if fused:
        worst = max(r["publish_over_compare"] for r in rows)
        print(f"\n   publish / compare-only (worst step) {worst:.2f}  <= {CPU_TARGET}  "
              f"{'PASS' if worst <= CPU_TARGET else 'MISS'}")
    else:
        worst = min(r["extract_over_copy"] for r in rows)
        print(f"\n   compare-and-extract / copy bandwidth (worst step) {worst:.2f}  >= {DEVICE_TARGET}  "
              f"{'PASS' if worst >= DEVICE_TARGET else 'MISS'}")
    if json_path:
        write_json(json_path, {"device": str(dev), "compare": compare, "values": values, "copy_seconds": t_copy,
                               "model_bytes": model_bytes, "steps": rows})
    return 0
