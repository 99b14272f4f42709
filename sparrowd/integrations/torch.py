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
``verify=False``). Sparse ULP values are turned into bit patterns where the
tensor lives (``ulp_add_device``, for 16- and 32-bit floats on a device; on the
host otherwise, from the gathered old values: two more transfers of the
changed elements).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ..codec.bits import ulp_add
from ..codec.extract import fingerprint, fp_equal
from ..codec.manifest import FULL, PATCH, Manifest
from ..decoded import Decoded, Write, decode_patch
from ..errors import BaseMismatchError, FormatError, InputError, IntegrityError

__all__ = ["PatchApplier", "ApplyStats", "Placement", "TORCH_DTYPES", "flat_bits", "ulp_add_device"]

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
    base_version: int | None
    tensors: int = 0
    elements: int = 0
    decode_seconds: float = 0.0
    verify_seconds: float = 0.0
    scatter_seconds: float = 0.0  # the weights are being written: what an engine pauses for
    total_seconds: float = 0.0


def _as_int(name: str, t: torch.Tensor) -> torch.dtype:
    for dt, as_int in TORCH_DTYPES.values():
        if dt == t.dtype:
            return as_int
    raise InputError(f"tensor {name!r}: dtype {t.dtype} cannot be patched")


def flat_bits(name: str, t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a flat integer view (no copy; it must be contiguous)."""
    if not t.is_contiguous():
        raise InputError(f"tensor {name!r}: PatchApplier writes in place and needs contiguous tensors")
    return t.view(_as_int(name, t)).view(-1)


def ulp_add_device(old: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``codec.bits.ulp_add`` in torch, on the tensors' device: new bit patterns (``old``'s integer
    dtype, 16 or 32 bits wide) from ``old`` and signed ulp distances ``d`` of the same width. The
    sign-magnitude patterns are taken to a monotone key, moved, and taken back, in a wider signed
    type so that nothing overflows (the key wraps modulo 2**width, as numpy's does)."""
    w = old.element_size() * 8
    if w not in (16, 32) or old.dtype.is_floating_point or d.element_size() * 8 != w:
        raise InputError(f"ulp_add_device: {old.dtype} bits with {d.dtype} distances")
    m, h = (1 << w) - 1, 1 << (w - 1)
    u = old.to(torch.int32 if w == 16 else torch.int64) & m  # the unsigned pattern
    key = torch.where(u >= h, m - u, u + h)
    key = (key + d.to(key.dtype)) & m
    u = torch.where(key >= h, key - h, m - key)
    return torch.where(u >= h, u - (m + 1), u).to(old.dtype)


def _ulp_on_device(bits: torch.Tensor) -> bool:
    """Whether a write's ulp distances become bit patterns on the tensor's device (a GPU's) rather
    than on the host, where numpy does it from the gathered old values."""
    return bits.device.type != "cpu" and bits.element_size() in (2, 4)


def _host_view(bits: torch.Tensor) -> np.ndarray:
    a = bits.detach().cpu().numpy()  # a view on the CPU; a copy from a GPU
    return a.view(f"<u{a.dtype.itemsize}")


def _to_device(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A numpy array of bits (or positions) as a tensor on ``like``'s device, reinterpreted as
    its integer dtype when widths agree."""
    a = np.ascontiguousarray(a)
    if a.dtype.kind in "ui" and a.dtype.itemsize == like.element_size() and like.dtype != torch.int64:
        a = a.view(np.dtype(str(like.dtype).removeprefix("torch.")) if like.dtype != torch.uint8 else np.uint8)
    with warnings.catch_warnings():  # a read-only mapping (a decoded memfd) is only ever read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a).to(like.device)


class Placement:
    """Where a checkpoint tensor's elements live at runtime: by default one tensor of the same
    shape, element for element. Engines that fuse or shard tensors (vLLM) give their own."""

    def __init__(self, name: str, tensor: torch.Tensor):
        self.name, self.tensor = name, tensor
        self.bits = flat_bits(name, tensor)

    def parts(self, indices: np.ndarray | None, count: int):
        """``(runtime flat bits, positions there, which of the write's values)`` for each
        runtime tensor the elements land in; positions ``None`` mean every element in order."""
        if indices is None:
            if count != self.bits.numel():
                raise BaseMismatchError(f"tensor {self.name!r}: {count} values for {self.bits.numel()} elements")
            return [(self.bits, None, slice(None))]
        return [(self.bits, indices, slice(None))]

    def check(self, e) -> None:
        dt = TORCH_DTYPES.get(e.dtype, (None,))[0]
        if dt != self.tensor.dtype or tuple(self.tensor.shape) != tuple(e.shape):
            raise BaseMismatchError(f"tensor {e.name!r}: the weights hold {self.tensor.dtype}"
                                    f"{list(self.tensor.shape)}, the patch writes {e.dtype}{list(e.shape)}")

    def fingerprint(self) -> bytes | None:
        """XXH3 of the tensor in checkpoint order, when the runtime holds it so."""
        return fingerprint(_host_view(self.bits))


def _restore(undo: list) -> None:
    """Put back what a list of ``(bits, where, old values)`` records overwrote, newest first."""
    with torch.no_grad():
        for bits, where, old in reversed(undo):
            if where is None:
                bits.copy_(old)
            else:
                bits[where] = old


class PatchApplier:
    def __init__(self, target=None, *, version: int, verify: bool = True,
                 placements: Mapping[str, Placement] | None = None):
        if placements is None:
            if isinstance(target, torch.nn.Module):
                target = target.state_dict()  # detached tensors sharing the parameters' storage
            if not isinstance(target, Mapping) or not all(isinstance(t, torch.Tensor) for t in target.values()):
                raise InputError("PatchApplier takes an nn.Module or a state dict of tensors")
            placements = {name: Placement(name, t) for name, t in target.items()}
        self.placements: dict[str, Placement] = dict(placements)
        self.version = version
        self.verify = verify
        self.last: ApplyStats | None = None  # the last apply's figures
        self._txn: list | None = None  # undo records of the open transaction

    @contextmanager
    def transaction(self):
        """Several applies as one: an error inside the block puts back every write made in it
        and the version it started from, then propagates.

            with applier.transaction():
                for d in decoded_versions:
                    applier.apply_decoded(d)
        """
        if self._txn is not None:
            raise InputError("PatchApplier: a transaction is already open")
        self._txn, version, last = [], self.version, self.last
        try:
            yield self
        except BaseException:
            _restore(self._txn)
            self.version, self.last = version, last
            raise
        finally:
            self._txn = None

    def _check(self, d: Decoded) -> None:
        by = {e.name: e for e in d.tensors}
        for w in d.writes:
            e, idx, n = by.get(w.name), w.indices, w.values.size
            if idx is None:
                fits = e is not None and n == e.numel
            else:  # positions read from the daemon's decoded layout were checked to rise: their ends bound them
                fits = e is not None and idx.size == n and (
                    not n or (idx[0] >= 0 and idx[-1] < e.numel if d.ascending
                              else int(idx.min()) >= 0 and int(idx.max()) < e.numel))
            if not fits:
                raise FormatError(f"tensor {w.name!r}: the patch's positions and values do not fit it")
        if d.base_version is None and all(e.op == FULL for e in d.tensors):
            # An anchor: loaded in place only when it has exactly the tensors held now.
            if {e.name for e in d.tensors} != set(self.placements):
                raise BaseMismatchError(f"anchor {d.version} has other tensors than these weights; reload the "
                                        f"model from it")
            for e in d.tensors:
                self.placements[e.name].check(e)
            return
        if d.base_version != self.version:
            raise BaseMismatchError(f"version {d.version} applies to {d.base_version}, but these weights are "
                                    f"version {self.version}"
                                    + (" (an anchor: load it whole)" if d.base_version is None else ""))
        for e in d.tensors:
            p = self.placements.get(e.name)
            if e.op not in (PATCH, FULL) or p is None:
                raise BaseMismatchError(f"tensor {e.name!r}: version {d.version} {e.op}s it, which changes "
                                        f"the model's tensors; reload from an anchor")
            p.check(e)

    def apply(self, manifest: Manifest, chunks: Iterable[bytes]) -> ApplyStats:
        """Apply a patch as its manifest and chunks (each hash-checked)."""
        t0 = time.perf_counter()
        d = decode_patch(manifest, chunks)  # nothing is touched before every chunk checks out
        stats = self.apply_decoded(d)
        stats.decode_seconds = time.perf_counter() - t0 - stats.total_seconds
        stats.total_seconds = time.perf_counter() - t0
        return stats

    def apply_decoded(self, d: Decoded) -> ApplyStats:
        """Apply a decoded patch (``sparrowd.decoded``, e.g. mapped from the daemon's memfd), or
        load an anchor of the same tensors in place."""
        t_start = time.perf_counter()
        stats = ApplyStats(d.version, d.base_version)
        self._check(d)
        if self.verify and d.base_version is not None:
            for e in d.tensors:
                if e.op == PATCH and not fp_equal(self.placements[e.name].fingerprint(), e.base_fp):
                    raise BaseMismatchError(f"tensor {e.name!r}: the weights are not version {self.version} "
                                            f"as version {d.version} expects (fingerprint differs)")
        stats.verify_seconds = time.perf_counter() - t_start
        undo: list[tuple[torch.Tensor, object, torch.Tensor]] = []  # (bits, where, old values)
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                for w in d.writes:
                    self._scatter(w, undo)
            stats.scatter_seconds = time.perf_counter() - t0
            if self.verify:
                t1 = time.perf_counter()
                for e in d.tensors:
                    if not fp_equal(self.placements[e.name].fingerprint(), e.result_fp):
                        raise IntegrityError(f"tensor {e.name!r}: result fingerprint differs after applying "
                                             f"version {d.version}")
                stats.verify_seconds += time.perf_counter() - t1
        except BaseException:
            _restore(undo)
            raise
        if self._txn is not None:
            self._txn.extend(undo)
        stats.tensors = len(d.tensors)
        stats.elements = d.elements
        self.version = d.version
        stats.total_seconds = time.perf_counter() - t_start
        self.last = stats
        return stats

    def _scatter(self, w: Write, undo: list) -> None:
        for bits, where, which in self.placements[w.name].parts(w.indices, int(w.values.size)):
            values = w.values[which]
            if where is None:  # the whole tensor
                undo.append((bits, None, bits.clone()))
                bits.copy_(_to_device(values, bits))
                continue
            idx = _to_device(where, bits)
            old = bits.index_select(0, idx)  # several times faster than bits[idx] on the CPU
            undo.append((bits, idx, old))
            if not w.ulp:
                new = _to_device(values, bits)
            elif _ulp_on_device(bits):  # no round trip of the old values through the host
                new = ulp_add_device(old, _to_device(values, bits))
            else:
                new = _to_device(ulp_add(_host_view(old), values), bits)
            bits.index_put_((idx,), new)
