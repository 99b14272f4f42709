"""Real patch files for swarm tests (a chain of versions of a synthetic bf16 model), and how tests
publish them and check what nodes hold."""

from __future__ import annotations

from pathlib import Path

import blake3
import numpy as np

from sparrowd.codec.bits import RawTensor
from sparrowd.codec.patch import encode_patch
from sparrowd.codec.patchfile import parse_patch, patch_parts
from tests.daemon.harness import status
from tests.helpers import sparrowd


def write_chain(out: Path, versions: int, *, mib: int = 8, chunk_kib: int = 8, seed: int = 0) -> list[Path]:
    """``v1.sprw`` .. ``vN.sprw``, each moving 1% of the elements of the previous version."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n = mib * (1 << 20) // 2 // 4
    cur = {f"layers.{i}.weight": rng.integers(0, 1 << 16, n, dtype=np.uint16) for i in range(4)}
    paths = []
    for v in range(1, versions + 1):
        new = {}
        for k, a in cur.items():
            b = a.copy()
            b[rng.choice(n, n // 100, replace=False)] ^= np.uint16(1 << int(rng.integers(0, 16)))
            new[k] = b
        m, chunks = encode_patch({k: RawTensor("BF16", (n,), a) for k, a in cur.items()},
                                 {k: RawTensor("BF16", (n,), a) for k, a in new.items()},
                                 version=v, base_version=v - 1, chunk_size=chunk_kib << 10)
        path = out / f"v{v}.sprw"
        with open(path, "wb") as f:
            for part in patch_parts(m, [c.data for c in chunks]):
                f.write(part)
        paths.append(path)
        cur = new
    return paths


def publish(cluster, path) -> None:
    r = sparrowd("publish", path, "--daemon", cluster.tracker, "--token-file", cluster.token_file)
    assert r.returncode == 0, r.stderr


def manifests(paths):
    out = {}
    for p in paths:
        view = parse_patch(p.read_bytes())
        out[view.manifest.version] = view.manifest
    return out


def held(cluster) -> dict[str, list[int]]:
    return {n["node_id"]: n["versions"] for n in status(cluster.tracker, cluster.token)["nodes"]}


def check_store(daemon, manifest) -> None:
    """Every chunk on the node's disk is complete and hash-valid."""
    d = daemon.data_dir / "versions" / str(manifest.version) / "chunks"
    for i, entry in enumerate(manifest.chunks):
        data = (d / f"{i}.chunk").read_bytes()
        assert len(data) == entry.size and blake3.blake3(data).digest() == entry.hash, (daemon.name, i)
