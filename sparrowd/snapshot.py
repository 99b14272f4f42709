"""Taking a version's snapshot: the model's tensors gathered, as served, and compared with the kept copies.

The publisher's source side, as vLLM's ``WeightSource`` is apart from its
transport: here a tensor is gathered (an FSDP2 DTensor whole, one tensor at a
time), cast to the dtype the engine serves and viewed as integer bits
(``served``); a kept copy is the last published one, fingerprinted
(``keep``); and ``Changes`` compares a version's served tensors with the kept
copies, tensor by tensor in name order, yielding each changed tensor's
positions and both sides' values on the host as soon as they are found, so
that encoding runs beside the compares. What it moved (kept copies, host
mirrors) it records, to be put back (``undo``) if the version is not
published. Encoding, handing off to the daemon and committing live in
``sparrowd.publisher``.

Imports numpy and the codec; torch only through ``torch_module`` (an extra);
nothing from ``sparrowd.daemon``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from .codec.bits import RawTensor, dtype_info
from .codec.chunk import Ranked, join_ranks, rank_and_fingerprint, ranked_part, ranking
from .codec.extract import diff_fingerprint, fingerprint
from .codec.history import History
from .errors import InputError

__all__ = ["TORCH_DTYPES", "Kept", "Change", "Changes", "torch_module", "host", "follower", "state", "gathered",
           "gather_all", "served", "keep", "extract", "undo"]

TORCH_DTYPES = {  # torch dtype name -> (safetensors name, same-width integer dtype name)
    "bfloat16": ("BF16", "int16"),
    "float16": ("F16", "int16"),
    "float32": ("F32", "int32"),
    "float64": ("F64", "int64"),
    "int8": ("I8", "int8"),
    "uint8": ("U8", "uint8"),
    "int16": ("I16", "int16"),
    "int32": ("I32", "int32"),
    "int64": ("I64", "int64"),
    "bool": ("BOOL", "uint8"),
}



@dataclass
class Kept:
    """A tensor as served: its kept copy (the last published) or a version's own."""

    dtype: str  # safetensors name
    shape: tuple[int, ...]
    bits: Any  # torch tensor, integer view, on the tensor's device
    fp: bytes  # fingerprint of its bytes
    mirror: np.ndarray | None = None  # host copy, for tensors compared by torch (fingerprinted here)


def torch_module():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is an extra
        raise InputError("sparrowd.Publisher needs torch: pip install 'sparrowd[torch]'") from None
    return torch



def extract(torch, old, new):
    """The changes of one flat tensor compared by torch, on their way to the host: None when it is
    unchanged, else (positions and new values on the device; positions, old and new values as numpy
    arrays on the host; a wait for those host arrays).

    Only the count of changes waits for the device (``nonzero``); the gathered values and the
    positions then go to page-locked host memory asynchronously, followed by an event, so the
    caller goes on to the next tensor while they travel, and whoever reads the host arrays waits
    for that event first. (Copies to pageable memory each waited for the device, three a tensor,
    and ran at a fraction of the link's speed.)"""
    idx = torch.nonzero(new != old).reshape(-1)
    c = idx.numel()
    if c == 0:
        return None
    new_vals = new[idx]
    if not new.is_cuda:  # on the host already: numpy views, nothing to copy or wait for
        return idx, new_vals, idx.numpy(), host(old[idx]), host(new_vals), no_wait
    width = new.element_size()
    aligned = (c * width + 7) // 8 * 8
    pinned = torch.empty(c * 8 + 2 * aligned, dtype=torch.uint8, pin_memory=True)
    h_idx = pinned[: c * 8].view(torch.int64)
    h_old = pinned[c * 8: c * 8 + c * width].view(new.dtype)
    h_new = pinned[c * 8 + aligned: c * 8 + aligned + c * width].view(new.dtype)
    for dst, src in ((h_idx, idx), (h_old, old[idx]), (h_new, new_vals)):
        dst.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(new.device))
    return idx, new_vals, h_idx.numpy(), host(h_old), host(h_new), event.synchronize


def no_wait() -> None:
    pass


def move_mirror(mirror: np.ndarray, idx: np.ndarray, nv: np.ndarray, ov: np.ndarray, dtype: str | None,
                hist_pos: np.ndarray | None = None):
    """A torch compare's host mirror brought to the new version: its fingerprint, and for ulp2
    (``dtype`` given, a float) its ranks and its change history's classes (``hist_pos``), all in one
    read of the mirror."""
    mirror[idx] = nv
    if dtype is None or not idx.size or not dtype_info(dtype).is_float:
        return fingerprint(mirror), None
    ranked, fp = rank_and_fingerprint(mirror, dtype, idx, ov, hist_pos)
    return fp, ranked


def compare_and_rank(kept: np.ndarray, new: np.ndarray, dtype: str | None, hist_pos: np.ndarray | None = None):
    """The CPU compare (the fused pass, which also brings the kept copy up to date), and for ulp2
    (``dtype`` given, a float) the changes' exponent-class ranks in the same pass, each block of the
    kept copy scanned before its update, while it is in cache: the class scan of the base is the
    costliest part of an ulp2 patch. ``hist_pos``: the tensor's change-history positions, classed
    in the same pass."""
    classes = ranking(kept, dtype, hist_pos) if dtype is not None and dtype_info(dtype).is_float else None
    idx, ov, nv, old_fp, new_fp = diff_fingerprint(kept, new, hash_old=False, update_old=True, classes=classes)
    part = ranked_part(classes)
    if part is None:
        return idx, ov, nv, old_fp, new_fp, None
    assert classes is not None  # ranked_part gives a part only for a ranking
    return idx, ov, nv, old_fp, new_fp, join_ranks([part], idx, ov, classes.hist_cls)



def host(bits) -> np.ndarray:
    """A tensor's integer bits as a numpy array of unsigned integers, on the host."""
    a = bits.cpu().numpy()
    return a.view(f"<u{a.dtype.itemsize}")


def follower() -> bool:
    """Under torch.distributed, ranks other than 0 only join the gathers."""
    dist = torch_module().distributed
    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0


def state(model) -> dict:
    """The model's tensors by name (an nn.Module's state dict, or a state dict as given)."""
    torch = torch_module()
    sd = model.state_dict() if isinstance(model, torch.nn.Module) else model
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise InputError("publish takes an nn.Module or a state dict of tensors")
    return sd


def gathered(t):
    """A DTensor (FSDP2) gathered whole, one tensor at a time; any other tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None and type(t).__name__ == "DTensor" else t


def gather_all(model) -> None:
    """A follower rank's part: the same gathers as rank 0, in the same (name) order."""
    sd = state(model)
    for name in sorted(sd):
        gathered(sd[name].detach())


def served(t, dtype, *, own: bool) -> Kept:
    """The tensor as the engine serves it: floats cast to ``dtype``, as integer bits. ``own``: the
    result must not share memory with the model (it is kept as the last published copy, and the
    optimizer updates the model in place)."""
    torch = torch_module()
    t = gathered(t.detach())
    if t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)  # a new tensor: owned already
    elif own:
        t = t.clone()
    name = str(t.dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise InputError(f"dtype {t.dtype} cannot be published")
    st, as_int = TORCH_DTYPES[name]
    bits = t.contiguous().view(getattr(torch, as_int)) if t.dtype != torch.bool else t.contiguous().to(torch.uint8)
    return Kept(st, tuple(t.shape), bits.reshape(-1), b"")


def keep(t, dtype, by_torch: Callable) -> Kept:
    """A kept copy of ``t`` as served, fingerprinted; tensors compared by torch also get a host
    mirror (one copy now, then O(changed) per version), so no later version copies them whole."""
    s = served(t, dtype, own=True)
    if by_torch(s.bits):
        s.mirror = host(s.bits).copy()
        s.fp = fingerprint(s.mirror)
    else:
        s.fp = fingerprint(host(s.bits))
    return s


def undo(moved: list) -> None:
    """Put back what ``moved`` records: (host array, positions, old values), newest first."""
    for h, idx, old_values in reversed(moved):
        h[idx] = old_values


def timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return time.perf_counter() - t0, out


def arrived_then(stats, arrived, fn, *args):
    """``fn(*args)`` once a torch compare's changes have reached the host; the wait is counted
    as time to the host (on a worker, beside the others)."""
    t0 = time.perf_counter()
    arrived()
    stats.to_host_seconds += time.perf_counter() - t0
    return fn(*args)


@dataclass
class Change:
    """One changed tensor: what its encoding needs, and ``update``, how its kept copy moves on commit:
    [kept copy, changed positions, new values (None: moved in place already), new fingerprint]."""

    name: str
    kept: Kept
    layout: RawTensor
    idx: np.ndarray  # positions on the host
    ov: np.ndarray
    nv: np.ndarray
    update: list
    ranked: Ranked | None = None
    mirrored: Future[Any] | None = None  # Future: a torch compare's host mirror moved, fingerprinted (and ranked)


class Changes:
    """A version's served tensors compared with the kept copies ``last``: iterating yields each
    changed tensor (a ``Change``) in name order. CPU tensors go to the ``pool`` first (the fused C
    pass compares, gathers, fingerprints and brings the kept copy up to date in one read, and
    releases the GIL); device tensors are compared by torch as they come. ``history``: the change
    history the patch is coded against (ulp2, whose changes are also ranked), else None."""

    def __init__(self, last: dict[str, Kept], served: dict[str, Kept], pool, by_torch: Callable,
                 history: History | None, stats):
        self.last, self.served, self.pool, self.history, self.stats = last, served, pool, history, stats
        self.ulp2 = history is not None
        self.updates: list = []  # every change's update, applied on commit
        self.moved: list = []  # (host array, positions, old values): moved already, put back on rollback
        self.mirrors: list = []  # torch compares: host mirrors moved, fingerprinted (and ranked)
        self.arrivals: list = []  # torch compares: waits for each tensor's changes to reach the host
        self.cpu = {name: pool.submit(timed, compare_and_rank, host(last[name].bits), host(new.bits),
                                      self._ranked_as(new), self.hist_pos(name))
                    for name, new in served.items() if not by_torch(new.bits)}

    def hist_pos(self, name: str) -> np.ndarray | None:
        t = self.history.get(name) if self.history is not None else None
        return None if t is None else t.positions

    def _ranked_as(self, t: Kept) -> str | None:
        return t.dtype if self.ulp2 else None

    def __iter__(self) -> Iterator[Change]:
        for name, new in self.served.items():
            old = self.last[name]
            self.stats.tensors += 1
            self.stats.elements += new.bits.numel()
            c = self._by_cpu(name, old, new) if name in self.cpu else self._by_torch(name, old, new)
            if c is None:
                continue  # the kept copy stays as it is
            self.updates.append(c.update)
            self.stats.tensors_changed += 1
            self.stats.elements_changed += int(c.idx.size)
            yield c

    def _by_cpu(self, name: str, old: Kept, new: Kept) -> Change | None:
        seconds, (idx_h, ov, nv, _, new_fp, ranked) = self.cpu.pop(name).result()
        self.stats.compare_seconds += seconds
        if idx_h.size == 0:
            return None
        self.moved.append((host(old.bits), idx_h, ov))
        layout = RawTensor(new.dtype, new.shape, host(new.bits))
        return Change(name, old, layout, idx_h, ov, nv, [old, idx_h, None, new_fp], ranked)

    def _by_torch(self, name: str, old: Kept, new: Kept) -> Change | None:
        t0 = time.perf_counter()
        found = extract(torch_module(), old.bits, new.bits)
        self.stats.compare_seconds += time.perf_counter() - t0
        if found is None:
            return None
        idx, new_vals, idx_h, ov, nv, arrived = found
        assert old.mirror is not None  # keep() gives every tensor compared by torch a host mirror
        self.arrivals.append(arrived)
        # The mirror moves on a compare thread, taking its new fingerprint (and for ulp2 its
        # class ranks) there, beside the other tensors'; recorded first, so it can be put back.
        self.moved.append((old.mirror, idx_h, ov))
        mirrored = self.pool.submit(arrived_then, self.stats, arrived, move_mirror, old.mirror, idx_h, nv, ov,
                                    self._ranked_as(new), self.hist_pos(name))
        self.mirrors.append(mirrored)
        layout = RawTensor(new.dtype, new.shape, old.mirror)
        return Change(name, old, layout, idx_h, ov, nv, [old, idx, new_vals, None], mirrored=mirrored)

    def rollback(self, sent: list) -> None:
        """The version is not published: stop what has not started, wait for what runs (``sent``:
        the encodings under way), and put back every kept copy and mirror moved."""
        for f in [*sent, *self.cpu.values(), *self.mirrors]:
            f.cancel()  # what has not started never will
        for f in [*sent, *self.mirrors]:
            if not f.cancelled():
                f.exception()  # wait for the one running: it may still move a mirror
        for arrived in self.arrivals:
            arrived()  # the old values the mirrors are put back with have reached the host
        for name, f in self.cpu.items():  # a compare that ran has moved its kept copy
            if not f.cancelled() and f.exception() is None:
                _, (idx_h, ov, *_rest) = f.result()
                self.moved.append((host(self.last[name].bits), idx_h, ov))
        undo(self.moved)
