"""``PatchApplier``: apply sparrowd patches to a torch module or state dict, in place.

    applier = PatchApplier(model, version=0)          # the weights as they are: version 0
    stats = applier.apply(manifest, chunks)            # now version manifest.version

Tensors are named in checkpoint coordinates (the names of the model's
safetensors, which are a Hugging Face model's ``state_dict`` names). Each
apply is a transaction:

1. the patch must build on the applier's version (strictly in order) and
   only change tensors that exist with its dtype and shape (adding,
   removing or reshaping tensors is a reload, from an anchor);
2. every chunk is hash-checked, decoded and checked against the manifest
   *before* a weight is touched;
3. with ``verify`` (the default) the touched tensors' fingerprints must be
   the patch's base fingerprints;
4. each scatter first keeps the values it overwrites (O(changed elements),
   on the tensor's device); the result fingerprints are checked; any error
   puts every kept value back, so the weights are the old version again,
   bit for bit, and the error is raised.

The work is O(changed elements) in writes: gathers and scatters of the
changed positions, never a full-shape temporary. ``verify`` reads each
touched tensor once more to fingerprint it (XXH3 over its bytes: a
zero-copy view on the CPU; on a GPU a copy to the host, so engines on GPUs
may rely on the daemon's chunk hashes and signature instead and pass
``verify=False``). Sparse ULP values are turned into bit patterns on the
host from the gathered old values: two transfers of the changed elements.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ..codec.bits import ulp_apply
from ..codec.chunk import DENSE, ULP, Segment
from ..codec.extract import fingerprint
from ..codec.manifest import FULL, PATCH, Manifest
from ..codec.patch import decode_checked
from ..errors import BaseMismatchError, InputError, IntegrityError

__all__ = ["PatchApplier", "ApplyStats", "TORCH_DTYPES"]

# safetensors dtype name -> torch dtype, and the same-width integer dtype its bits are read as
TORCH_DTYPES = {
    "BF16": (torch.bfloat16, torch.int16),
    "F16": (torch.float16, torch.int16),
    "F32": (torch.float32, torch.int32),
    "F64": (torch.float64, torch.int64),
    "I8": (torch.int8, torch.int8),
    "U8": (torch.uint8, torch.uint8),
    "I16": (torch.int16, torch.int16),
    "I32": (torch.int32, torch.int32),
    "I64": (torch.int64, torch.int64),
}


@dataclass
class ApplyStats:
    version: int
    base_version: int
    tensors: int = 0
    elements: int = 0
    decode_seconds: float = 0.0
    verify_seconds: float = 0.0
    scatter_seconds: float = 0.0  # the weights are being written: what an engine pauses for
    total_seconds: float = 0.0


def _bits(t: torch.Tensor, as_int: torch.dtype) -> torch.Tensor:
    """The tensor's bits as a flat integer view (no copy; it must be contiguous)."""
    if not t.is_contiguous():
        raise InputError("PatchApplier writes in place and needs contiguous tensors")
    return t.view(as_int).view(-1)


def _host_view(bits: torch.Tensor) -> np.ndarray:
    a = bits.detach().cpu().numpy()  # a view on the CPU; a copy from a GPU
    return a.view(f"<u{a.dtype.itemsize}")


class PatchApplier:
    def __init__(self, target, *, version: int, verify: bool = True):
        if isinstance(target, torch.nn.Module):
            target = target.state_dict()  # detached tensors sharing the parameters' storage
        if not isinstance(target, Mapping) or not all(isinstance(t, torch.Tensor) for t in target.values()):
            raise InputError("PatchApplier takes an nn.Module or a state dict of tensors")
        self.tensors: dict[str, torch.Tensor] = dict(target)
        self.version = version
        self.verify = verify

    def fingerprint(self, name: str) -> bytes:
        t = self.tensors[name]
        return fingerprint(_host_view(_bits(t, self._as_int(name, t))))

    @staticmethod
    def _as_int(name: str, t: torch.Tensor) -> torch.dtype:
        for dt, as_int in TORCH_DTYPES.values():
            if dt == t.dtype:
                return as_int
        raise InputError(f"tensor {name!r}: dtype {t.dtype} cannot be patched")

    def _check(self, manifest: Manifest) -> None:
        if manifest.base_version != self.version:
            raise BaseMismatchError(f"version {manifest.version} applies to {manifest.base_version}, but these "
                                    f"weights are version {self.version}"
                                    + (" (an anchor: load it whole)" if manifest.base_version is None else ""))
        for e in manifest.tensors:
            t = self.tensors.get(e.name)
            if e.op not in (PATCH, FULL) or t is None:
                raise BaseMismatchError(f"tensor {e.name!r}: version {manifest.version} {e.op}s it, which changes "
                                        f"the model's tensors; reload from an anchor")
            dt = TORCH_DTYPES.get(e.dtype, (None,))[0]
            if dt != t.dtype or tuple(t.shape) != tuple(e.shape):
                raise BaseMismatchError(f"tensor {e.name!r}: the weights hold {t.dtype}{list(t.shape)}, version "
                                        f"{manifest.version} writes {e.dtype}{list(e.shape)}")

    def apply(self, manifest: Manifest, chunks: Iterable[bytes]) -> ApplyStats:
        t_start = time.perf_counter()
        stats = ApplyStats(manifest.version, manifest.base_version)
        self._check(manifest)
        segments = decode_checked(manifest, chunks)  # nothing is touched before every chunk checks out
        stats.decode_seconds = time.perf_counter() - t_start
        t0 = time.perf_counter()
        if self.verify:
            for e in manifest.tensors:
                if e.op == PATCH and self.fingerprint(e.name) != e.base_fp:
                    raise BaseMismatchError(f"tensor {e.name!r}: the weights are not version {self.version} "
                                            f"as version {manifest.version} expects (fingerprint differs)")
        stats.verify_seconds = time.perf_counter() - t0
        undo: list[tuple[torch.Tensor, object, torch.Tensor]] = []  # (bits, where, old values)
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                for s in segments:
                    self._scatter(s, undo)
            stats.scatter_seconds = time.perf_counter() - t0
            if self.verify:
                t1 = time.perf_counter()
                for e in manifest.tensors:
                    if self.fingerprint(e.name) != e.result_fp:
                        raise IntegrityError(f"tensor {e.name!r}: result fingerprint differs after applying "
                                             f"version {manifest.version}")
                stats.verify_seconds += time.perf_counter() - t1
        except BaseException:
            with torch.no_grad():
                for bits, where, old in reversed(undo):
                    bits[where] = old
            raise
        stats.tensors = len(manifest.tensors)
        stats.elements = sum(s.count for s in segments)
        self.version = manifest.version
        stats.total_seconds = time.perf_counter() - t_start
        return stats

    def _scatter(self, s: Segment, undo: list) -> None:
        t = self.tensors[s.name]
        as_int = self._as_int(s.name, t)
        bits = _bits(t, as_int)
        np_int = np.dtype(str(as_int).removeprefix("torch.")) if as_int != torch.uint8 else np.dtype("u1")
        if s.kind == DENSE:
            where = slice(s.start, s.stop)
            undo.append((bits, where, bits[where].clone()))
            bits[where] = torch.from_numpy(np.ascontiguousarray(s.data).view(np_int)).to(bits.device)
            return
        idx = torch.from_numpy(s.indices).to(bits.device)
        old = bits[idx]
        undo.append((bits, idx, old))
        if s.values == ULP:
            new = ulp_apply(_host_view(old), s.data)
        else:
            new = s.data
        bits[idx] = torch.from_numpy(np.ascontiguousarray(new).view(np_int)).to(bits.device)
