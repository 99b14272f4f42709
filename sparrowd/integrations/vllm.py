"""vLLM worker extension: apply sparrowd patches to a running engine's weights, in place.

    llm = LLM(model_dir, worker_extension_cls="sparrowd.integrations.vllm.SparrowWorkerExtension")
    llm.collective_rpc("sparrow_connect", args=("/var/lib/sparrowd/engine.sock",),
                       kwargs={"token_file": "swarm.token", "version": 0})
    version = update(llm)            # sparrow_update on every worker, then the prefix cache reset

How checkpoint coordinates become vLLM's runtime parameters is learned once,
at connect, from the model's own ``load_weights``, so fused ``qkv_proj`` and
``gate_up_proj``, tensor-parallel shards and padded vocabularies need no
table written by hand: for each checkpoint tensor the extension loads probe
tensors whose elements spell their own flat index (base 2**14, each digit a
finite bf16 bit pattern copied exactly), with every parameter's ``weight_loader`` wrapped to save the
parameter first and fill it with a sentinel; where the digits land is the
placement, kept as runs of (checkpoint start, parameter start, length).
Then every parameter is put back as it was. A loader that does anything but
place elements (scales, transposes into other values) is detected and
refused rather than learned wrong.

An update applies every ready version in order, each as a transaction
(``PatchApplier``: overwritten values are kept and restored on any error);
the cost is O(changed elements) gathers and scatters on the parameters'
device. Weights changed, so cached prefixes are stale: ``update(llm)``
resets vLLM's prefix cache after the workers apply (callers using
``collective_rpc("sparrow_update")`` directly must call
``llm.reset_prefix_cache()`` themselves).

On vLLM's CPU backend linear weights are repacked after loading (oneDNN or
sgl kernels keep a private packed copy and the parameters are emptied), so
writes into parameters would change nothing. Importing this module, which
vLLM does when it builds a worker with this extension, before the model
loads, keeps those layers on plain ``F.linear`` over their parameters: in
place writes take effect, at the price of the packed kernels' speed on the
CPU. GPU backends use the parameters as they are; nothing changes there.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint import open_checkpoint
from ..errors import BaseMismatchError, SparrowError
from .engine import EngineClient, sync
from .torch import TORCH_DTYPES, PatchApplier, Placement, flat_bits
from .vllm_plugin import keep_plain_cpu_weights

__all__ = ["SparrowWorkerExtension", "VllmPatcher", "RunPlacement", "learn_placements", "update", "worker_rank"]

# Probes are bit patterns, copied exactly by a loader that only places elements. A digit d of the
# flat index (base 2**14) is the pattern DIGIT0 + d: a normal, finite bf16/f16 value whatever d is,
# so no cast or flush to zero can touch it. A first pass of MARK alone tells the elements a loader
# places from those it fills itself (vocab padding); parameters are filled with SENTINEL first.
DIGIT_BITS = 14
DIGIT0, MARK, SENTINEL = 0x0400, 0x3C01, 0x7BFF


keep_plain_cpu_weights()  # the extension's module is imported before vLLM builds the model


class RunPlacement(Placement):
    """A checkpoint tensor's elements spread over runtime parameters as runs."""

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], parts: list):
        self.name, self.dtype, self.shape = name, dtype, tuple(shape)
        self.numel = math.prod(self.shape)
        self._parts = parts  # (param name, flat bits, src starts, dst starts, lengths)

    @property
    def runs(self) -> int:
        return sum(len(p[2]) for p in self._parts)

    def parts(self, indices: np.ndarray | None, count: int):
        if indices is None:
            if count != self.numel:
                raise BaseMismatchError(f"tensor {self.name!r}: {count} values for {self.numel} elements")
            indices = np.arange(self.numel, dtype=np.int64)
        out: list[tuple[Any, np.ndarray, slice | np.ndarray]] = []  # (param bits, where, which of the values)
        for _, bits, src, dst, lens in self._parts:
            if src.size == 1:  # one run (the usual case): a slice of the sorted positions, shifted
                a, b = np.searchsorted(indices, [src[0], src[0] + lens[0]])
                if b > a:
                    out.append((bits, indices[a:b] + (dst[0] - src[0]), slice(a, b)))
                continue
            r = np.searchsorted(src, indices, side="right") - 1
            ok = r >= 0
            rr = np.where(ok, r, 0)
            ok &= indices < src[rr] + lens[rr]
            sel = np.flatnonzero(ok)
            if sel.size:
                out.append((bits, dst[rr[sel]] + (indices[sel] - src[rr[sel]]), sel))
        return out

    def check(self, e) -> None:
        if e.dtype != self.dtype or tuple(e.shape) != self.shape:
            raise BaseMismatchError(f"tensor {e.name!r}: the engine loaded it as {self.dtype}{list(self.shape)}, "
                                    f"the patch writes {e.dtype}{list(e.shape)}; reload the model")

    def fingerprint(self) -> bytes | None:
        return None  # the runtime layout is not the checkpoint's


def _decode_probe(name: str, numel: int, ds: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """From one parameter's read-backs (MARK pass, then digits): the checkpoint index of each
    placed element (``src``) and where it sits (``dst``), both int64."""
    placed = ds[0] == MARK
    dst = np.arange(placed.size, dtype=np.int64) if placed.all() else np.flatnonzero(placed)
    wide = np.int32 if numel < 2**31 else np.int64
    src: np.ndarray = np.zeros(dst.size, dtype=wide)
    for k, d in enumerate(ds[1:]):
        g: np.ndarray = (d if dst.size == d.size else d[dst]).astype(wide) - DIGIT0
        if g.size and (int(g.min()) < 0 or int(g.max()) >= 1 << DIGIT_BITS):
            raise SparrowError(f"vLLM's loader transforms the values of {name}; cannot patch it in place")
        src |= g << (DIGIT_BITS * k)
    src = src.astype(np.int64)
    if src.size and int(src.max()) >= numel:
        raise SparrowError(f"vLLM's loader does not place {name} element for element; cannot patch it")
    if src.size > 1 and not np.all(src[1:] > src[:-1]):  # not in order: check no element landed twice
        hit = np.zeros(numel, dtype=bool)
        hit[src] = True
        if int(np.count_nonzero(hit)) != src.size:
            raise SparrowError(f"vLLM's loader does not place {name} element for element; cannot patch it")
    return src, dst


def _runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs where both sides advance by one: (src starts, dst starts, lengths)."""
    n = src.size
    if n and src[-1] - src[0] == n - 1 and dst[-1] - dst[0] == n - 1 and np.all(src[1:] > src[:-1]) \
            and np.all(dst[1:] > dst[:-1]):
        return src[:1].copy(), dst[:1].copy(), np.array([n], dtype=np.int64)  # one contiguous block
    if n > 1 and np.all(src[1:] > src[:-1]):
        s, d = src, dst  # placed in order, the usual case: no sort
    else:
        order = np.argsort(src, kind="stable")
        s, d = src[order], dst[order]
    brk = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate([[0], brk]).astype(np.int64)
    ends = np.concatenate([brk, [s.size]]).astype(np.int64)
    return s[starts], d[starts], ends - starts


def learn_placements(model: Any, specs: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, RunPlacement]:
    """Where each checkpoint tensor (name -> (dtype, shape)) lands in ``model``'s parameters,
    found through ``model.load_weights`` itself; the parameters are left as they were. Only
    16-bit float checkpoints (bf16, f16) are probed; other tensors are refused."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    # A vLLM model (a torch Module with vLLM's load_weights); its parameters carry vLLM's weight_loader.
    params: dict[str, Any] = dict(model.named_parameters())
    name_of = {id(p): n for n, p in params.items()}
    saved: dict[int, torch.Tensor] = {}
    filled: set[int] = set()

    def spy_on(original):
        def spy(param, loaded, *args, **kwargs):
            key = id(param)
            if key not in filled:
                if key not in saved:
                    saved[key] = param.data.clone()
                param.data.fill_(float(sentinel[0]))
                filled.add(key)
            return original(param, loaded, *args, **kwargs)
        return spy

    originals = {n: p.__dict__.get("weight_loader", p.__dict__.get("_weight_loader")) for n, p in params.items()}
    for n, p in params.items():
        p.weight_loader = spy_on(getattr(p, "weight_loader", None) or default_weight_loader)
    out: dict[str, RunPlacement] = {}
    sentinel = [0.0]
    try:
        for name, (dtype, shape) in specs.items():
            if dtype not in ("BF16", "F16"):
                raise SparrowError(f"checkpoint tensor {name} is {dtype}: "
                                   "only bf16 and f16 models are patched in place")
            tdt = TORCH_DTYPES[dtype][0]
            sentinel[0] = torch.tensor(SENTINEL, dtype=torch.int16).view(tdt).item()
            numel = math.prod(shape)
            digits = max(1, math.ceil(math.log2(max(numel, 2)) / DIGIT_BITS))
            index = torch.arange(numel, dtype=torch.int32 if numel < 2**31 else torch.int64)
            found: dict[int, list[np.ndarray]] = {}
            for k in range(-1, digits):
                filled.clear()
                if k < 0:
                    probe = torch.full(shape, MARK, dtype=torch.int16).view(tdt)
                else:
                    d = ((index >> (DIGIT_BITS * k)) & ((1 << DIGIT_BITS) - 1)) + DIGIT0
                    probe = d.to(torch.int16).view(tdt).reshape(shape)
                model.load_weights([(name, probe)])
                for key in filled:
                    data = params[name_of[key]].data.detach().reshape(-1)
                    # Read back in the checkpoint's dtype (exact for a value that came from it) as bits.
                    found.setdefault(key, []).append(data.to(tdt).view(torch.int16).cpu().numpy().copy())
            parts = []
            for key, ds in found.items():
                if len(ds) != digits + 1:
                    raise SparrowError(f"vLLM loads {name} inconsistently; cannot patch this model in place")
                pname = name_of[key]
                src, dst = _decode_probe(name, numel, ds)
                parts.append((pname, flat_bits(pname, params[pname].data), *_runs(src, dst)))
            out[name] = RunPlacement(name, dtype, shape, parts)
            for key, data in saved.items():
                params[name_of[key]].data.copy_(data)
            saved.clear()
    finally:
        for key, data in saved.items():
            params[name_of[key]].data.copy_(data)
        for n, p in params.items():
            if originals[n] is None:
                p.__dict__.pop("weight_loader", None)
            else:
                p.weight_loader = originals[n]
    return out


class VllmPatcher:
    """The one core both vLLM integrations share (the worker extension and the ``sparrowd``
    weight-transfer backend): a worker's model, where each checkpoint tensor lives in it, and
    the engine socket of the node's daemon."""

    def __init__(self, model: torch.nn.Module, folder: str | os.PathLike):
        with open_checkpoint(Path(folder)) as ckpt:
            specs = {n: (t.dtype, tuple(t.shape)) for n, t in ckpt.items()}
        self.placements = learn_placements(model, specs)
        self.folder = str(folder)
        self.applier: PatchApplier | None = None
        self.client: EngineClient | None = None

    @property
    def learned(self) -> dict:
        return {"tensors": len(self.placements), "runs": sum(p.runs for p in self.placements.values()),
                "unused": sorted(n for n, p in self.placements.items() if not p.runs)}

    @property
    def version(self) -> int | None:
        return None if self.applier is None else self.applier.version

    def connect(self, socket_path: str, *, token_file: str | None = None, version: int | None = None, engine: str,
                rank: int = 0) -> None:
        """Attach to the daemon's engine socket, the weights being ``version``. When first attached
        without one: the version of the sparrowd model folder the weights were loaded from
        (``DATA/current``), else 0. Attaching again without a version keeps the one the weights
        hold (the daemon restarted); with one, the caller says what the weights now are (it
        reloaded them whole)."""
        if self.applier is None:
            if version is None:
                from .vllm_plugin import loaded_version

                version = loaded_version(self.folder) or 0
            self.applier = PatchApplier(placements=self.placements, version=version, verify=False)
        elif version is not None:
            self.applier.version = version
        self.close()
        # The folder the weights were loaded from, when local: the daemon can start its current folder
        # from it (ulp2 patches decode against that base), with no anchor and no --base.
        model = str(self.folder) if self.folder and os.path.isdir(str(self.folder)) else None
        self._attach: dict[str, Any] = dict(path=socket_path, token_file=token_file, rank=rank, engine=engine,
                                            model=model)
        self.client = EngineClient(**self._attach, version=self.applier.version)

    def update(self, target: int | None = None, *, wait: float = 0.0, exact: bool = False) -> int:
        """``sync`` through the socket: every ready version up to ``target``, as one transaction.
        A connection that broke (the daemon restarted) is made again first."""
        if self.client is None or self.applier is None:
            raise SparrowError("not attached to a sparrowd daemon: connect first")
        if self.client.broken:
            self.client.close()
            self.client = EngineClient(**self._attach, version=self.applier.version)
        return sync(self.client, self.applier, target, wait=wait, exact=exact)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


def worker_rank() -> int:
    """This worker's rank among the engine's workers (0 outside a distributed group)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank_in_group)
    except (ImportError, AssertionError, AttributeError):
        return 0


class SparrowWorkerExtension:
    """Mixed into each vLLM worker (``worker_extension_cls``); called with ``collective_rpc``."""

    model_runner: Any  # the vLLM worker's, which this class is mixed into
    _sparrow: VllmPatcher  # set by sparrow_connect, which vLLM calls first

    def sparrow_connect(self, socket_path: str, token_file: str | None = None, version: int = 0,
                        engine: str | None = None) -> dict:
        """Attach to the local daemon's engine socket, holding ``version`` (the weights the engine
        loaded); learns the checkpoint-to-runtime placement once. Returns what it learned."""
        patcher = VllmPatcher(self.model_runner.model, self.model_runner.model_config.model)
        patcher.connect(socket_path, token_file=token_file, version=version, rank=int(getattr(self, "rank", 0) or 0),
                        engine=engine or f"vllm-{os.uname().nodename}-{os.getpid()}")
        self._sparrow = patcher
        return patcher.learned

    def sparrow_update(self, target_version: int | None = None) -> int:
        """Apply every ready version up to ``target_version`` (all when None), as one transaction;
        returns the version now held. On an error the engine keeps serving the version it had,
        unchanged."""
        return self._sparrow.update(target_version)

    def sparrow_version(self) -> int:
        version = self._sparrow.version
        assert version is not None  # sparrow_connect attached the patcher, which made its applier
        return version

    def sparrow_stats(self) -> dict | None:
        """The last apply's figures (``ApplyStats``: scatter seconds, elements, ...)."""
        applier = self._sparrow.applier
        assert applier is not None  # sparrow_connect attached the patcher, which made its applier
        last = applier.last
        return None if last is None else dict(last.__dict__)


def update(llm, target_version: int | None = None) -> int:
    """``sparrow_update`` on every worker, then vLLM's prefix cache reset (cached prefixes were
    computed with the old weights)."""
    versions = set(llm.collective_rpc("sparrow_update", args=(target_version,)))
    llm.reset_prefix_cache()
    if len(versions) != 1:
        raise SparrowError(f"workers disagree on the version they hold: {sorted(versions)}")
    return versions.pop()
