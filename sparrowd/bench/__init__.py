"""Benchmarks behind ``sparrowd bench``: each prints what it measured beside a baseline taken in
the same run, and can write its figures as JSON (``--json FILE``).

What lives here is what a user runs to size a deployment on their own machines, links and
checkpoints (codec, swarm, sim, publish, apply, tracker, coldstart), with the parts they share
(``wan``, the WAN emulator; ``trainer``; ``handover``, the ways weights reach servers;
``vllm_server``), and rl and serve, which drive vLLM through those shared parts. Harnesses that only
reproduce the project's figures are scripts in the checkout's ``bench/`` (soak, project, minilm), not
installed; they import this package, never the reverse.

It may import anything of sparrowd but the command (``sparrowd.cli``); torch and vLLM only inside the
functions that need them. ``sim/`` is the simulator: it imports nothing of ``sparrowd.daemon``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint import atomic_file


def write_json(path: str | Path, doc) -> None:
    """Write a benchmark's figures whole or not at all (a temporary file, then a rename)."""
    with atomic_file(Path(path)) as tmp:
        tmp.write_text(json.dumps(doc, indent=2) + "\n")


def write_lines(path: str | Path, records) -> None:
    """Records as JSON Lines (one object a line), whole or not at all."""
    with atomic_file(Path(path)) as tmp:
        tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))


def cross_region_over(cross_bytes: float, regions: int, nodes: int, patch: int) -> float | None:
    """Bytes that crossed regions over (R - 1) x patch, R the regions that hold a rollout (the
    benchmarks deal rollouts round the regions, the trainer's first); None where that is one."""
    occupied = min(regions, nodes)
    return None if occupied < 2 else cross_bytes / ((occupied - 1) * patch)


def ratio_text(value: float | None) -> str:
    """A ratio as the benchmarks print it, ``n/a`` where there is none."""
    return "n/a" if value is None else f"{value:.2f}x"


def relaying(cut_through: bool, push: tuple[int, int], burst: float) -> str:
    """How the relays move chunks, as the swarm benchmarks' headers say it."""
    return (("cut-through" if cut_through else "store-and-forward")
            + (f", pushing to {push[0]} local and {push[1]} cross-region peers" if any(push) else ", pull only")
            + (f"; limits burst {burst:g} s" if burst else ""))


def needs_vllm(bench: str, missing: str | None, instead: str = "") -> int:
    """Say, in one line on stderr, that ``bench`` needs vLLM and transformers and where they are
    (the engine environment; ``instead``: what runs without them); the exit status, 2."""
    import sys

    print(f"sparrowd bench {bench} needs vLLM and transformers ({missing} is missing): run it with the engine "
          f"environment, e.g. .venv-engine/bin/sparrowd bench {bench} from the repository{instead}", file=sys.stderr)
    return 2


def torch_device(torch, device: str):
    """``device`` as a torch device this torch can use; InputError (one line) otherwise."""
    from ..errors import InputError

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise InputError(f"device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {device!r}: this torch sees no CUDA device")
    return dev


def sync_device(torch, dev) -> None:
    """Wait for the device's queued work (a GPU's kernels run asynchronously), before reading a clock."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
