"""``sparrowd.Publisher``: publish each optimizer step from the training loop.

    from sparrowd import Publisher
    pub = Publisher(daemon="http://127.0.0.1:7070", token_file="swarm.token")
    pub.start(model, version=0)             # the base every rollout node starts from
    stats = pub.publish(model, version=step)

``publish`` keeps the last published copy of each tensor, in the dtype the
engine serves (bf16 by default; fp32 master weights are cast first, as the
engine will see them), on the tensor's own device. It compares bit patterns
there, moves only the changed indices and values to the host, and encodes
tensor by tensor in a worker thread while the next tensor is compared; each
chunk goes to the local daemon as soon as it is encoded, so the swarm starts
moving while extraction is still running. Nothing of a version counts as
published until the daemon has taken its manifest: if the daemon is down or
refuses, ``publish`` raises and the next call diffs against the last version
that was published, so a version's base is always the last published one.

Needs torch; the rest of sparrowd does not.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .codec.bits import RawTensor
from .codec.chunk import ULP
from .codec.extract import diff_fingerprint, fingerprint
from .codec.patch import DEFAULT_CHUNK_SIZE, PatchEncoder
from .daemon.calls import http_call
from .daemon.settings import read_token
from .errors import InputError

__all__ = ["Publisher", "PublishStats"]

_TORCH_DTYPES = {  # torch dtype name -> (safetensors name, same-width integer dtype name)
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
class PublishStats:
    version: int
    base_version: int
    tensors: int = 0
    tensors_changed: int = 0
    elements: int = 0
    elements_changed: int = 0
    patch_bytes: int = 0
    chunks: int = 0
    compare_seconds: float = 0.0
    to_host_seconds: float = 0.0
    encode_seconds: float = 0.0
    handoff_seconds: float = 0.0
    first_chunk_seconds: float | None = None  # from the start of publish to the first chunk taken by the daemon
    total_seconds: float = 0.0

    @property
    def density(self) -> float:
        return self.elements_changed / self.elements if self.elements else 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "density": self.density}


@dataclass
class _Tensor:
    dtype: str  # safetensors name
    shape: tuple[int, ...]
    bits: object  # torch tensor, integer view, on the tensor's device
    fp: bytes  # fingerprint of its bytes


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is an extra
        raise InputError("sparrowd.Publisher needs torch: pip install 'sparrowd[torch]'") from None
    return torch


class Publisher:
    def __init__(self, daemon: str = "http://127.0.0.1:7070", token_file: str | Path | None = None, *,
                 values: str = ULP, dtype: str = "bfloat16", chunk_size: int = DEFAULT_CHUNK_SIZE,
                 timeout: float = 60.0):
        torch = _torch()
        if token_file is None:
            raise InputError("Publisher needs token_file, the swarm token's file")
        self.daemon = daemon.rstrip("/")
        self._token, _ = read_token(Path(token_file))
        self.values, self.chunk_size, self.timeout = values, chunk_size, timeout
        self.dtype = getattr(torch, dtype, None)
        if self.dtype is None or not isinstance(self.dtype, torch.dtype) or dtype not in _TORCH_DTYPES:
            raise InputError(f"served dtype {dtype!r} is not one of {', '.join(_TORCH_DTYPES)}")
        self._last: dict[str, _Tensor] = {}
        self.version: int | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sparrowd-publish")
        self._compare = ThreadPoolExecutor(2, thread_name_prefix="sparrowd-compare")

    # ------------------------------------------------------------ inputs

    def _state(self, model) -> dict:
        torch = _torch()
        sd = model.state_dict() if isinstance(model, torch.nn.Module) else model
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise InputError("publish takes an nn.Module or a state dict of tensors")
        return sd

    def _served(self, t, *, own: bool) -> _Tensor:
        """The tensor as the engine serves it: floats cast to the served dtype, as integer bits.
        ``own``: the result must not share memory with the model (it is kept as the last
        published copy, and the optimizer updates the model in place)."""
        torch = _torch()
        t = t.detach()
        if t.is_floating_point() and t.dtype != self.dtype:
            t = t.to(self.dtype)  # a new tensor: owned already
        elif own:
            t = t.clone()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise InputError(f"dtype {t.dtype} cannot be published")
        st, as_int = _TORCH_DTYPES[name]
        bits = t.contiguous().view(getattr(torch, as_int)) if t.dtype != torch.bool else t.contiguous().to(torch.uint8)
        return _Tensor(st, tuple(t.shape), bits.reshape(-1), b"")

    @staticmethod
    def _host(bits) -> np.ndarray:
        a = bits.cpu().numpy()
        return a.view(f"<u{a.dtype.itemsize}")

    # ------------------------------------------------------------ the API

    def start(self, model, version: int = 0) -> None:
        """Take ``model`` as version ``version``, the base the rollout nodes already hold."""
        state = {}
        for name, t in self._state(model).items():
            s = self._served(t, own=True)
            s.fp = fingerprint(self._host(s.bits))
            state[name] = s
        self._last, self.version = state, version

    def publish(self, model, version: int) -> PublishStats:
        torch = _torch()
        if self.version is None:
            raise InputError("call Publisher.start(model, version=0) with the base first")
        if version <= self.version:
            raise InputError(f"version {version} does not follow the last published version {self.version}")
        t_start = time.perf_counter()
        stats = PublishStats(version=version, base_version=self.version)
        enc = PatchEncoder(version=version, base_version=self.version, values=self.values,
                           chunk_size=self.chunk_size)
        sent: list[Future] = []
        next_index = [0]

        def hand_off(chunks) -> None:
            for c in chunks:
                t0 = time.perf_counter()
                i = next_index[0]
                next_index[0] += 1
                self._post(f"/v1/publish/{version}/chunk/{i}", c.data)
                stats.handoff_seconds += time.perf_counter() - t0
                stats.patch_bytes += c.size
                stats.chunks += 1
                if stats.first_chunk_seconds is None:
                    stats.first_chunk_seconds = time.perf_counter() - t_start

        def encode(name, old_fp: bytes, layout: RawTensor, idx, ov, nv, new_fp) -> None:
            t0 = time.perf_counter()
            # The values were gathered on the device; the encoder only needs the layout of both sides.
            chunks = enc.add_extract(name, layout, layout, idx, old_fp, new_fp, ov, nv)
            stats.encode_seconds += time.perf_counter() - t0
            hand_off(chunks)

        state = self._state(model)
        if set(state) != set(self._last):
            raise InputError("the model's tensors differ from the base's (new or removed tensors need an anchor)")
        updates = []  # (kept tensor, changed indices, new values, new fingerprint), applied once published
        names = sorted(state)
        served = {}
        for name in names:
            old, new = self._last[name], self._served(state[name], own=False)
            if (old.dtype, old.shape) != (new.dtype, new.shape):
                raise InputError(f"tensor {name!r} changed dtype or shape (that needs an anchor)")
            served[name] = new
        # On the CPU the fused C pass compares, gathers and fingerprints in one read; tensors go to
        # two threads (the pass releases the GIL) and come back in name order.
        cpu = {name: self._compare.submit(self._timed, diff_fingerprint, self._host(self._last[name].bits),
                                          self._host(new.bits), hash_old=False)
               for name, new in served.items() if new.bits.device.type == "cpu"}
        for name in names:
            old, new = self._last[name], served[name]
            stats.tensors += 1
            stats.elements += new.bits.numel()
            t0 = time.perf_counter()
            if name in cpu:
                seconds, (idx_h, ov, nv, _, new_fp) = cpu.pop(name).result()
                host_new = self._host(new.bits)
                stats.compare_seconds += seconds
                if idx_h.size == 0:
                    continue  # the kept copy stays as it is
                updates.append((old, idx_h, nv, new_fp))
            else:
                idx = torch.nonzero(new.bits != old.bits).reshape(-1)
                torch.cuda.synchronize(new.bits.device)
                stats.compare_seconds += time.perf_counter() - t0
                if idx.numel() == 0:
                    continue
                t0 = time.perf_counter()
                new_vals = new.bits[idx]
                idx_h = idx.cpu().numpy().astype(np.int64, copy=False)
                ov, nv = self._host(old.bits[idx]), self._host(new_vals)
                host_new = self._host(new.bits)  # for the fingerprint: a copy from the GPU (see README)
                stats.to_host_seconds += time.perf_counter() - t0
                new_fp = fingerprint(host_new)
                updates.append((old, idx, new_vals, new_fp))
            stats.tensors_changed += 1
            stats.elements_changed += int(idx_h.size)
            layout = RawTensor(new.dtype, new.shape, host_new)
            sent.append(self._pool.submit(encode, name, old.fp, layout, idx_h, ov, nv, new_fp))
        for f in sent:
            f.result()  # errors from the worker (daemon down, refused) surface here
        manifest, rest = enc.finish()
        hand_off(rest)
        self._post("/v1/publish/manifest", manifest.to_bytes())
        # Published: bring the kept copies up to this version, O(changed elements), no full copy.
        for kept, idx, values, new_fp in updates:
            if isinstance(values, np.ndarray):
                self._host(kept.bits)[idx] = values  # a numpy view writing into the kept torch tensor
            else:
                kept.bits[idx] = values
            kept.fp = new_fp
        self.version = version
        stats.total_seconds = time.perf_counter() - t_start
        return stats

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._compare.shutdown(wait=True)

    @staticmethod
    def _timed(fn, *args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        return time.perf_counter() - t0, out

    # ------------------------------------------------------------ the daemon

    def _post(self, path: str, data) -> dict:
        return http_call(f"{self.daemon}{path}", self._token, method="POST", data=bytes(data), timeout=self.timeout)
