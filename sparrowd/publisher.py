"""``sparrowd.Publisher``: publish each optimizer step from the training loop.

    from sparrowd import Publisher
    pub = Publisher(daemon="http://127.0.0.1:7070", token_file="swarm.token")
    pub.start(model, version=0)             # the base every rollout node starts from (anchor 0)
    stats = pub.publish(model, version=step)

``publish`` keeps the last published copy of each tensor, in the dtype the
engine serves (bf16 by default; fp32 master weights are cast first, as the
engine will see them), on the tensor's own device. It compares bit patterns
there (on the CPU, one fused C pass compares, gathers the changes,
fingerprints the new tensor and brings the kept copy up to date while each
block is in cache), moves only the changed indices and values to the host (fingerprints
of device tensors come from a host mirror kept up to date O(changed); with
``compare="torch"`` CPU tensors take that path too), and encodes
tensor by tensor in a worker thread while the next tensor is compared
(``threads`` compare threads and as many segment-encoding threads; by default
the CPU count, at most 8); each chunk goes to the local daemon as soon as it is encoded, so the swarm starts
moving while extraction is still running. Nothing of a version counts as
published until the daemon has taken its manifest: if the daemon is down or
refuses, ``publish`` raises, puts every kept copy back, and the next call diffs
against the last version that was published, so a version's base is always
the last published one.
Every call first asks the daemon where its chain ends: a version the daemon
took although its reply was lost is adopted (its manifest's hash matches);
any other disagreement is an error, never a patch on the wrong base. A
restarted daemon reloads its chain from disk, so the loop simply goes on.

Anchors: ``start`` publishes the base as anchor ``version`` when the daemon
has nothing yet, and every ``anchor_every`` versions ``publish`` follows the
patch with an anchor of the same version, encoded from the kept copies (no
second pass over the model). That anchor is published in the background
(``background_anchors``, the default): ``publish`` returns after the patch,
and the next call (or ``close``, or ``wait_anchor``) first waits for the
anchor, raising its error if it failed, since it reads the kept copies the
next version moves (a 4 GiB model's anchor took 11-12 s on a GPU box: an
8B model's would take some 45 s, a training step's time). ``publish_anchor`` does it on demand, and is the
way to publish a change a patch cannot carry (tensors added, removed,
reshaped). A late rollout node catches up from the newest anchor. Given
``model_files`` (the model's Hugging Face folder), every anchor also carries
its non-tensor files (config, tokenizer, generation config, chat template),
read when the anchor is published, so a box with nothing gets a loadable
model folder through the swarm (``DATA/current``).

FSDP2 / DTensor parameters are gathered one tensor at a time
(``full_tensor()``, a collective): every rank calls ``publish``, rank 0
compares and talks to the daemon, the other ranks only join the gathers and
get ``None``. Gathering is what the engine needs anyway (it loads whole
tensors by their Hugging Face names) and keeps the chain one patch per
version whatever the trainer's sharding; the cost is one tensor's worth of
memory on rank 0 at a time and the gather's traffic on the trainer's
own fast interconnect.

Needs torch; the rest of sparrowd does not.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import blake3
import numpy as np

from .client import check_start, http_call, published_state, read_token, tracker_status, wait_arrival
from .codec.bits import RawTensor, dtype_info
from .codec.chunk import ULP, ULP2, join_ranks, rank_and_fingerprint, ranked_part, ranking
from .codec.extract import diff_fingerprint, fingerprint
from .codec.history import History
from .codec.patch import DEFAULT_CHUNK_SIZE, PatchEncoder, auto_chunk_size
from .codec.workers import cpu_threads
from .current import model_files
from .errors import InputError, SparrowError, StaleEnginesError
from .publishing import DEFAULT_ANCHOR_EVERY, anchor_due, check_anchor, check_follows
from .swarm.chain import Key

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
    base_version: int | None  # None for an anchor
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
    anchor_seconds: float = 0.0  # an anchor published after the patch (every anchor_every versions)
    anchor_bytes: int = 0  # (both 0 for an anchor in the background: Publisher.wait_anchor has them)
    anchor_started: bool = False  # an anchor of this version followed the patch (in the background or not)
    anchor_wait_seconds: float = 0.0  # waiting, before the patch, for the last background anchor
    lag_wait_seconds: float = 0.0  # waiting, after the patch, for engines within max_lag (bounded staleness)
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
    mirror: np.ndarray | None = None  # host copy, for tensors compared by torch (fingerprinted here)


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is an extra
        raise InputError("sparrowd.Publisher needs torch: pip install 'sparrowd[torch]'") from None
    return torch


class _Stream:
    """Chunks handed to the daemon in order as they are encoded, timed into the stats."""

    def __init__(self, pub: "Publisher", key: Key, stats: PublishStats, t_start: float):
        self.pub, self.key, self.stats, self.t_start = pub, key, stats, t_start
        self.next = 0

    def send(self, chunks) -> None:
        for c in chunks:
            t0 = time.perf_counter()
            self.pub._post(f"/v1/publish/{self.key.tag}/chunk/{self.next}", c.data)
            self.next += 1
            self.stats.handoff_seconds += time.perf_counter() - t0
            self.stats.patch_bytes += c.size
            self.stats.chunks += 1
            if self.stats.first_chunk_seconds is None:
                self.stats.first_chunk_seconds = time.perf_counter() - self.t_start


def _extract(torch, old, new):
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
        return idx, new_vals, idx.numpy(), Publisher._host(old[idx]), Publisher._host(new_vals), _no_wait
    width = new.element_size()
    aligned = (c * width + 7) // 8 * 8
    host = torch.empty(c * 8 + 2 * aligned, dtype=torch.uint8, pin_memory=True)
    h_idx = host[: c * 8].view(torch.int64)
    h_old = host[c * 8: c * 8 + c * width].view(new.dtype)
    h_new = host[c * 8 + aligned: c * 8 + aligned + c * width].view(new.dtype)
    for dst, src in ((h_idx, idx), (h_old, old[idx]), (h_new, new_vals)):
        dst.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(new.device))
    return idx, new_vals, h_idx.numpy(), Publisher._host(h_old), Publisher._host(h_new), event.synchronize


def _no_wait() -> None:
    pass


def _move_mirror(mirror: np.ndarray, idx: np.ndarray, nv: np.ndarray, ov: np.ndarray, dtype: str | None,
                 hist_pos: np.ndarray | None = None):
    """A torch compare's host mirror brought to the new version: its fingerprint, and for ulp2
    (``dtype`` given, a float) its ranks and its change history's classes (``hist_pos``), all in one
    read of the mirror."""
    mirror[idx] = nv
    if dtype is None or not idx.size or not dtype_info(dtype).is_float:
        return fingerprint(mirror), None
    ranked, fp = rank_and_fingerprint(mirror, dtype, idx, ov, hist_pos)
    return fp, ranked


def _compare_and_rank(kept: np.ndarray, new: np.ndarray, dtype: str | None, hist_pos: np.ndarray | None = None):
    """The CPU compare (the fused pass, which also brings the kept copy up to date), and for ulp2
    (``dtype`` given, a float) the changes' exponent-class ranks in the same pass, each block of the
    kept copy scanned before its update, while it is in cache: the class scan of the base is the
    costliest part of an ulp2 patch. ``hist_pos``: the tensor's change-history positions, classed
    in the same pass."""
    classes = ranking(kept, dtype, hist_pos) if dtype is not None and dtype_info(dtype).is_float else None
    idx, ov, nv, old_fp, new_fp = diff_fingerprint(kept, new, hash_old=False, update_old=True, classes=classes)
    part = ranked_part(classes)
    return idx, ov, nv, old_fp, new_fp, None if part is None else join_ranks([part], idx, ov, classes.hist_cls)


def _number(value, kinds):
    """A number from the daemon's JSON, positive and of ``kinds``; None for anything else (an older
    daemon, a null, a bool)."""
    return value if isinstance(value, kinds) and not isinstance(value, bool) and value > 0 else None


@dataclass
class _Pending:
    """A version whose manifest was sent but whose reply never came: the daemon may hold it."""

    version: int
    manifest: str  # BLAKE3 of the manifest's bytes, hex
    updates: list
    moved: list  # kept copies and host mirrors already moved to this version: undone if the daemon did not take it
    history: History | Future  # ulp2: the change history once this version is applied (or its merge under way)


class Publisher:
    def __init__(self, daemon: str = "http://127.0.0.1:7070", token_file: str | Path | None = None, *,
                 values: str = ULP, dtype: str = "bfloat16", chunk_size: int | None = None,
                 anchor_every: int = DEFAULT_ANCHOR_EVERY, compare: str = "auto", timeout: float = 60.0,
                 model_files: str | Path | None = None, threads: int | None = None,
                 background_anchors: bool = True, max_lag: int | None = None, lag_timeout: float = 600.0):
        """``max_lag``: bounded staleness. ``publish(v)`` returns only once every live engine holds at
        least version v - max_lag (the tracker's wait), else raises ``StaleEnginesError`` after
        ``lag_timeout`` seconds, naming the engines that lag and by how much. None: no bound."""
        torch = _torch()
        if threads is None:  # the compares are memory-bound: a few threads reach a socket's bandwidth
            threads = cpu_threads(at_least=2)
        if threads < 1:
            raise InputError("threads must be at least 1")
        if token_file is None:
            raise InputError("Publisher needs token_file, the swarm token's file")
        if anchor_every < 0:
            raise InputError("anchor_every must be 0 (no periodic anchors) or more")
        if max_lag is not None and (isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0):
            raise InputError("max_lag must be a version count, 0 or more (None: no bound)")
        if not lag_timeout > 0:
            raise InputError("lag_timeout must be more than 0 seconds")
        self.max_lag, self.lag_timeout = max_lag, float(lag_timeout)
        if compare not in ("auto", "torch"):
            raise InputError("compare must be 'auto' (the fused C pass on the CPU, torch on devices) or 'torch'")
        self.compare = compare
        self.daemon = daemon.rstrip("/")
        self._token, _ = read_token(Path(token_file))
        self.values, self.chunk_size, self.timeout = values, chunk_size, timeout
        self._last_patch_bytes: int | None = None  # the size of the last patch published (chunk sizing)
        self._rollouts: int | None = None  # the swarm's size as the daemon last told it (chunk sizing),
        self._uplink: float | None = None  # its upload limit (None: unlimited or unknown),
        self._round_trip: float | None = None  # and the round trip between regions its rollouts measured
        self.anchor_every = anchor_every
        self.model_files = Path(model_files) if model_files is not None else None
        if self.model_files is not None and not self.model_files.is_dir():
            raise InputError(f"model_files {self.model_files}: not a folder (give the model's Hugging Face folder)")
        self.dtype = getattr(torch, dtype, None)
        if self.dtype is None or not isinstance(self.dtype, torch.dtype) or dtype not in _TORCH_DTYPES:
            raise InputError(f"served dtype {dtype!r} is not one of {', '.join(_TORCH_DTYPES)}")
        self._last: dict[str, _Tensor] = {}
        self.version: int | None = None
        self.anchor_version: int | None = None
        self._pending: _Pending | None = None
        # ulp2: the change history the rollout nodes hold at self.version, which the next patch is
        # coded against (codec.history); it starts afresh at every anchor, which new boxes start from.
        self._history = History()
        self._unrecorded = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sparrowd-publish")
        self.threads = threads
        self.background_anchors = background_anchors
        self.last_anchor: PublishStats | None = None  # the figures of the last anchor published
        self._anchor: Future | None = None  # an anchor being published in the background
        self._anchoring = ThreadPoolExecutor(1, thread_name_prefix="sparrowd-anchor")
        self._compare = ThreadPoolExecutor(threads, thread_name_prefix="sparrowd-compare")
        # Segments are encoded (for ulp2: ranks offset, history merged) and chunks closed on threads of
        # their own, so that the encoder's thread only cuts; compares queued ahead do not hold them up
        self._segments = ThreadPoolExecutor(threads, thread_name_prefix="sparrowd-segments")

    # ------------------------------------------------------------ inputs

    @staticmethod
    def _follower() -> bool:
        """Under torch.distributed, ranks other than 0 only join the gathers."""
        torch = _torch()
        dist = torch.distributed
        return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0

    def _state(self, model) -> dict:
        torch = _torch()
        sd = model.state_dict() if isinstance(model, torch.nn.Module) else model
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise InputError("publish takes an nn.Module or a state dict of tensors")
        return sd

    @staticmethod
    def _gathered(t):
        """A DTensor (FSDP2) gathered whole, one tensor at a time; any other tensor as it is."""
        full = getattr(t, "full_tensor", None)
        return full() if full is not None and type(t).__name__ == "DTensor" else t

    def _served(self, t, *, own: bool) -> _Tensor:
        """The tensor as the engine serves it: floats cast to the served dtype, as integer bits.
        ``own``: the result must not share memory with the model (it is kept as the last
        published copy, and the optimizer updates the model in place)."""
        torch = _torch()
        t = self._gathered(t.detach())
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

    def _by_torch(self, bits) -> bool:
        return self.compare == "torch" or bits.device.type != "cpu"

    def _keep(self, t) -> _Tensor:
        """A kept copy of ``t`` as served, fingerprinted; tensors compared by torch also get a host
        mirror (one copy now, then O(changed) per version), so no later version copies them whole."""
        s = self._served(t, own=True)
        if self._by_torch(s.bits):
            s.mirror = self._host(s.bits).copy()
            s.fp = fingerprint(s.mirror)
        else:
            s.fp = fingerprint(self._host(s.bits))
        return s

    @staticmethod
    def _host(bits) -> np.ndarray:
        a = bits.cpu().numpy()
        return a.view(f"<u{a.dtype.itemsize}")

    # ------------------------------------------------------------ the API

    def start(self, model, version: int = 0, *, anchor: bool = True) -> PublishStats | None:
        """Take ``model`` as version ``version``, the base the rollout nodes start from.

        A daemon with nothing published yet gets it as anchor ``version`` (``anchor=False``:
        the nodes already hold the base; nothing is sent). A daemon whose chain ends at
        ``version`` (the trainer restarted from that version's checkpoint) goes on from it.
        Any other daemon state is an error: a patch on a base the nodes do not hold would be
        refused by every engine."""
        if self._follower():
            self._gather_all(model)
            return None
        self.wait_anchor()
        state = self._daemon_state()
        check_start(state, version)
        latest = state["latest"]
        kept = {name: self._keep(t) for name, t in sorted(self._state(model).items())}  # the order ranks gather in
        self._last, self.version, self._pending = kept, version, None
        self._history = History()  # what the nodes hold of the last patches is not known here: start afresh
        self.anchor_version = state["anchor"]
        self._unrecorded = latest is None  # the daemon knows nothing of this base until something is published
        if latest is None and anchor:
            return self._publish_anchor(version)
        return None

    def publish_anchor(self, model, version: int) -> PublishStats | None:
        """Publish ``model`` whole as anchor ``version``: the latest version (a snapshot of it;
        the model must be exactly what was published) or a newer one, which may add, remove or
        reshape tensors. Later patches build on it."""
        if self._follower():
            self._gather_all(model)
            return None
        self._check_started()
        self.wait_anchor()
        self._sync()
        check_anchor(version, self.version)
        kept = {}
        for name, t in sorted(self._state(model).items()):  # the order every rank gathers in
            s = self._keep(t)
            if version == self.version and (name not in self._last or s.fp != self._last[name].fp):
                raise InputError(f"tensor {name!r} is not what version {version} published: publish the model "
                                 f"as a new version")
            kept[name] = s
        if version == self.version and set(kept) != set(self._last):
            raise InputError(f"the model's tensors are not those version {version} published")
        stats = self._publish_anchor(version, kept)
        self._last, self.version = kept, version
        return stats

    def publish(self, model, version: int) -> PublishStats | None:
        """Publish ``model`` as ``version``, a patch on the last version published (module
        docstring); returns its figures (None on follower ranks)."""
        torch = _torch()
        if self._follower():
            self._gather_all(model)
            return None
        self._check_started()
        t_wait = time.perf_counter()
        self.wait_anchor()  # it reads the kept copies this version moves
        t_wait = time.perf_counter() - t_wait
        self._sync()
        check_follows(version, self.version)
        t_start = time.perf_counter()
        stats = PublishStats(version=version, base_version=self.version, anchor_wait_seconds=t_wait)
        ulp2 = self.values == ULP2
        prior = self._history_now() if ulp2 else None  # the change history this patch is coded against
        enc = PatchEncoder(version=version, base_version=self.version, values=self.values,
                           chunk_size=self._patch_chunk_size(), history=prior, pool=self._segments)

        def hist_pos(name: str) -> np.ndarray | None:
            t = prior.get(name) if prior is not None else None
            return None if t is None else t.positions

        stream = _Stream(self, Key(version), stats, t_start)
        sent: list[Future] = []
        mirrors: list[Future] = []  # torch compares: host mirrors moved, fingerprinted (and ranked)
        arrivals: list = []  # torch compares: waits for each tensor's changes to reach the host

        # (host array, positions, old values): kept copies and host mirrors already moved to this
        # version, put back if the version is not published.
        moved: list = []

        def encode(name, kept: _Tensor, layout: RawTensor, idx, ov, nv, update: list, ranked=None,
                   mirrored: Future | None = None) -> None:
            t0 = time.perf_counter()
            if mirrored is not None:  # compared by torch: the host mirror was moved (and ranked) on a thread
                update[3], ranked = mirrored.result()
            # The values were gathered already; the encoder only needs the layout of both sides.
            chunks = enc.add_extract(name, layout, layout, idx, kept.fp, update[3], ov, nv, ranked)
            stats.encode_seconds += time.perf_counter() - t0
            stream.send(chunks)

        state = self._state(model)
        if set(state) != set(self._last):
            raise InputError("the model's tensors differ from the base's (new or removed tensors need an anchor: "
                             "publish_anchor)")
        updates = []  # (kept tensor, changed indices, new values or None if in place already, new fingerprint)
        names = sorted(state)
        served = {}
        for name in names:
            old, new = self._last[name], self._served(state[name], own=False)
            if (old.dtype, old.shape) != (new.dtype, new.shape):
                raise InputError(f"tensor {name!r} changed dtype or shape (that needs an anchor: publish_anchor)")
            served[name] = new
        # On the CPU the fused C pass compares, gathers, fingerprints and brings the kept copy up to
        # date in one read; tensors go to the compare threads (the pass releases the GIL) and come back in
        # name order.
        cpu = {name: self._compare.submit(self._timed, _compare_and_rank, self._host(self._last[name].bits),
                                          self._host(new.bits), new.dtype if ulp2 else None, hist_pos(name))
               for name, new in served.items() if not self._by_torch(new.bits)}
        try:
            for name in names:
                old, new = self._last[name], served[name]
                stats.tensors += 1
                stats.elements += new.bits.numel()
                ranked = mirrored = None
                if name in cpu:
                    seconds, (idx_h, ov, nv, _, new_fp, ranked) = cpu.pop(name).result()
                    stats.compare_seconds += seconds
                    if idx_h.size == 0:
                        continue  # the kept copy stays as it is
                    moved.append((self._host(old.bits), idx_h, ov))
                    host_new = self._host(new.bits)
                    update = [old, idx_h, None, new_fp]
                else:
                    t0 = time.perf_counter()
                    found = _extract(torch, old.bits, new.bits)
                    stats.compare_seconds += time.perf_counter() - t0
                    if found is None:
                        continue
                    idx, new_vals, idx_h, ov, nv, arrived = found
                    arrivals.append(arrived)
                    host_new = old.mirror
                    update = [old, idx, new_vals, None]
                    # The mirror moves on a compare thread, taking its new fingerprint (and for ulp2 its
                    # class ranks) there, beside the other tensors'; recorded first, so it can be put back.
                    moved.append((old.mirror, idx_h, ov))
                    mirrored = self._compare.submit(self._arrived, stats, arrived, _move_mirror, old.mirror, idx_h, nv,
                                                    ov, new.dtype if ulp2 else None, hist_pos(name))
                    mirrors.append(mirrored)
                updates.append(update)
                stats.tensors_changed += 1
                stats.elements_changed += int(idx_h.size)
                layout = RawTensor(new.dtype, new.shape, host_new)
                sent.append(self._pool.submit(encode, name, old, layout, idx_h, ov, nv, update, ranked, mirrored))
            for f in sent:
                f.result()  # errors from the worker (daemon down, refused) surface here
            manifest, rest = enc.finish()
            stream.send(rest)
            body = manifest.to_bytes()
            # The history the next patch is coded against, merged while the daemon signs this one: on
            # the publish thread (idle now), its tensors side by side on the segment threads.
            history = self._pool.submit(enc.next_history, self._segments) if ulp2 else enc.next_history()
        except BaseException:
            for f in [*sent, *cpu.values(), *mirrors]:
                f.cancel()  # what has not started never will
            for f in [*sent, *mirrors]:
                if not f.cancelled():
                    f.exception()  # wait for the one running: it may still move a mirror
            for arrived in arrivals:
                arrived()  # the old values the mirrors are put back with have reached the host
            for name, f in cpu.items():  # a compare that ran has moved its kept copy
                if not f.cancelled() and f.exception() is None:
                    _, (idx_h, ov, *_rest) = f.result()
                    moved.append((self._host(self._last[name].bits), idx_h, ov))
            self._undo(moved)
            raise
        try:
            self._post("/v1/publish/manifest", body)
        except BaseException:  # an error, or an interrupt mid-request
            # Taken or not? The next call asks the daemon, and adopts this version if it is there
            # (or puts the kept copies back if it is not).
            self._pending = _Pending(version, blake3.blake3(body).hexdigest(), updates, moved, history)
            raise
        self._advance(version, updates, history)
        self._last_patch_bytes = stats.patch_bytes
        stats.total_seconds = time.perf_counter() - t_start
        if anchor_due(version, self.anchor_version, self.anchor_every):
            stats.anchor_started = True
            if self.background_anchors:
                self._anchor = self._anchoring.submit(self._publish_anchor, version)
            else:
                a = self._publish_anchor(version)
                stats.anchor_seconds, stats.anchor_bytes = a.total_seconds, a.patch_bytes
        if self.max_lag is not None:
            t0 = time.perf_counter()
            self.bound_lag(version)
            stats.lag_wait_seconds = time.perf_counter() - t0
        return stats

    def bound_lag(self, version: int) -> None:
        """Until every live engine holds version ``version - max_lag`` or later (``max_lag``);
        ``StaleEnginesError`` naming the engines behind, and by how much, after ``lag_timeout``."""
        floor = version - (self.max_lag or 0)
        if floor < 0:
            return
        try:
            self.wait(floor, applied=True, engines=True, timeout=self.lag_timeout)
        except SparrowError:
            nodes = self.status().get("nodes", [])
            behind = sorted((n["node_id"], n.get("engine_version")) for n in nodes
                            if n.get("role") != "trainer" and n.get("engine_version") is not None
                            and n["engine_version"] < floor)
            if not behind:
                raise
            raise StaleEnginesError(
                f"version {version} published, but engines lag more than max_lag {self.max_lag} after "
                f"{self.lag_timeout:g} s: " + ", ".join(f"{node} at {v} ({version - v} behind)" for node, v in behind),
                lagging={node: version - v for node, v in behind}) from None

    def wait_anchor(self) -> PublishStats | None:
        """Wait for an anchor being published in the background; returns its figures (None when
        none was under way). Its failure is raised here, once, as a SparrowError; the next patch
        then starts another (the anchor it was is not recorded)."""
        f, self._anchor = self._anchor, None
        if f is None:
            return None
        try:
            a = f.result()
        except SparrowError as e:
            raise SparrowError(f"the anchor published in the background failed: {e}") from e
        self.last_anchor = a
        return a

    def _patch_chunk_size(self) -> int:
        """``chunk_size`` if given; else sized for the patch (``auto_chunk_size``), which is expected to
        be about as large as the last one, or, for the first, 1% of the elements at 11 bits each (an
        RL step in ``ulp``), and for the swarm, the trainer's uplink and the round trip between regions
        as the daemon said before this version."""
        if self.chunk_size:
            return self.chunk_size
        expected = self._last_patch_bytes
        if expected is None:
            expected = sum(t.bits.numel() for t in self._last.values()) // 100 * 11 // 8
        return auto_chunk_size(expected, self._rollouts, send_rate=self._uplink, round_trip=self._round_trip)

    def close(self) -> None:
        """Wait for an anchor under way (its failure is raised), then stop the threads."""
        try:
            self.wait_anchor()
        finally:
            for pool in (self._anchoring, self._pool, self._compare, self._segments):
                pool.shutdown(wait=True)

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        except SparrowError:
            if exc[0] is None:
                raise  # else the error in flight says more than a background anchor's failure

    # ------------------------------------------------------------ inside

    def _check_started(self) -> None:
        if self.version is None:
            raise InputError("call Publisher.start(model, version=0) with the base first")

    def _gather_all(self, model) -> None:
        """A follower rank's part: the same gathers as rank 0, in the same (name) order."""
        state = self._state(model)
        for name in sorted(state):
            self._gathered(state[name].detach())

    @staticmethod
    def _undo(moved: list) -> None:
        for host, idx, old_values in reversed(moved):
            host[idx] = old_values

    def _history_now(self) -> History:
        """The change history the rollout nodes hold at ``self.version`` (its merge may still be under way)."""
        if isinstance(self._history, Future):
            self._history = self._history.result()
        return self._history

    def _advance(self, version: int, updates, history: History | Future) -> None:
        """Published: bring the kept copies up to this version, O(changed elements), no full copy."""
        for kept, idx, values, new_fp in updates:
            if values is not None:  # None: the CPU compare moved the kept copy in place already
                kept.bits[idx] = values
            kept.fp = new_fp
        self.version, self._pending, self._unrecorded = version, None, False
        self._history = history

    def _sync(self) -> None:
        """Agree with the daemon on where the chain ends before building on it."""
        state = self._daemon_state()
        self._rollouts = _number(state.get("rollouts"), int)
        self._uplink = _number(state.get("uplink"), (int, float))
        self._round_trip = _number(state.get("round_trip"), (int, float))
        latest = state["latest"]
        if latest == self.version or (latest is None and self._unrecorded):
            if self._pending is not None:  # the daemon never took it: the mirrors go back too
                self._undo(self._pending.moved)
            self._pending = None
            return
        p = self._pending
        if p is not None and latest == p.version and state["manifest"] == p.manifest:
            self._advance(p.version, p.updates, p.history)  # the daemon took it; only the reply was lost
            return
        raise InputError(f"the trainer's daemon has version {latest} as its latest, this publisher has "
                         f"{self.version}: the chain was changed by someone else, or the daemon lost its data dir; "
                         f"start again from the daemon's latest version")

    def wait(self, version: int | None = None, *, applied: bool = False, engines: bool = False,
             nodes: list[str] | None = None, fraction: float | None = None, timeout: float = 60.0) -> dict:
        """Block until ``version`` (default: the last published) is held by every live rollout node
        (``engines``: every one with an engine attached), or with ``applied`` applied by every engine;
        ``nodes`` names the ones that count, ``fraction`` settles for that share. Returns as soon as the
        tracker hears it (nodes report at once); SparrowError naming the missing nodes after ``timeout``."""
        v = self.version if version is None else version
        if v is None:
            raise InputError("give the version to wait for (nothing was published from here yet)")
        return wait_arrival(self.daemon, self._token, v, applied=applied, engines=engines, nodes=nodes,
                            fraction=fraction, timeout=timeout)

    def status(self) -> dict:
        """The swarm's status snapshot from the trainer's daemon, which hosts the tracker
        (docs/STATUS.md): every node, the versions it holds and its engine's version."""
        return tracker_status(self.daemon, self._token, timeout=self.timeout)

    def _daemon_state(self) -> dict:
        return published_state(self.daemon, self._token, timeout=self.timeout)

    def _publish_anchor(self, version: int, tensors: dict[str, _Tensor] | None = None) -> PublishStats:
        """``tensors`` (the kept copies by default) whole, as anchor ``version``. The change history
        starts afresh: a new box starts from the anchor, and must decode what follows."""
        self._history = History()
        tensors = self._last if tensors is None else tensors
        t_start = time.perf_counter()
        stats = PublishStats(version=version, base_version=None)
        # Whole tensors: compressing is the work, so as many chunks close at once as there are threads.
        enc = PatchEncoder(version=version, base_version=None, values=self.values,
                           chunk_size=self.chunk_size or DEFAULT_CHUNK_SIZE, pool=self._segments, lag=self.threads)
        stream = _Stream(self, Key(version, True), stats, t_start)
        # Two stages: this thread cuts (the pool encodes), the worker hands chunks off in order; a
        # few tensors' chunks at most wait between them.
        sending: list[Future] = []
        for name in sorted(tensors):
            t = tensors[name]
            t0 = time.perf_counter()
            host = t.mirror if t.mirror is not None else self._host(t.bits)  # no device copy when mirrored
            stats.to_host_seconds += time.perf_counter() - t0
            t0 = time.perf_counter()
            chunks = enc.add(name, None, RawTensor(t.dtype, t.shape, host))
            stats.encode_seconds += time.perf_counter() - t0
            sending.append(self._pool.submit(stream.send, chunks))
            while len(sending) > 4:
                sending.pop(0).result()
            stats.tensors += 1
            stats.elements += host.size
        stats.tensors_changed, stats.elements_changed = stats.tensors, stats.elements
        # The folder's config and tokenizer as they are now, so a box with nothing gets a loadable model.
        for name, data in (model_files(self.model_files) if self.model_files is not None else {}).items():
            sending.append(self._pool.submit(stream.send, enc.add_file(name, data)))
        manifest, rest = enc.finish()
        sending.append(self._pool.submit(stream.send, rest))
        for f in sending:
            f.result()
        self._post("/v1/publish/manifest", manifest.to_bytes())
        self.anchor_version, self._unrecorded = version, False
        stats.total_seconds = time.perf_counter() - t_start
        self.last_anchor = stats
        return stats

    @staticmethod
    def _arrived(stats: PublishStats, arrived, fn, *args):
        """``fn(*args)`` once a torch compare's changes have reached the host; the wait is counted
        as time to the host (on a worker, beside the others)."""
        t0 = time.perf_counter()
        arrived()
        stats.to_host_seconds += time.perf_counter() - t0
        return fn(*args)

    @staticmethod
    def _timed(fn, *args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        return time.perf_counter() - t0, out

    def _post(self, path: str, data) -> dict:
        return http_call(f"{self.daemon}{path}", self._token, method="POST", data=bytes(data), timeout=self.timeout)
