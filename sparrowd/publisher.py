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

What lives here: ``Publisher``, whose ``publish`` takes the version's
snapshot (``sparrowd.snapshot``: gather, compare, extract) and runs the
publish transaction on it (``_encode_patch``: encode and hand off each chunk;
``_commit``: the manifest, then the kept copies move on, or everything moved
is put back; ``_anchor_if_due``), and ``PublishStats``. The chain's rules
(version order, anchor cadence) come from ``sparrowd.publishing``, shared with
publishing a checkpoint folder; the daemon is reached through
``sparrowd.client``. Nothing here imports ``sparrowd.daemon``.

Needs torch; the rest of sparrowd does not.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import blake3

from .client import check_start, http_call, published_state, read_token, tracker_status, wait_arrival
from .codec.bits import RawTensor
from .codec.chunk import ULP, ULP2
from .codec.history import History
from .codec.patch import DEFAULT_CHUNK_SIZE, PatchEncoder, auto_chunk_size
from .codec.workers import cpu_threads
from .current import model_files
from .errors import InputError, SparrowError, StaleEnginesError
from .publishing import DEFAULT_ANCHOR_EVERY, anchor_due, check_anchor, check_follows
from .snapshot import (
    TORCH_DTYPES,
    Change,
    Changes,
    Kept,
    follower,
    gather_all,
    host,
    keep,
    served,
    state,
    torch_module,
    undo,
)
from .swarm.chain import Key

__all__ = ["Publisher", "PublishStats"]

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
        torch = torch_module()
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
        if self.dtype is None or not isinstance(self.dtype, torch.dtype) or dtype not in TORCH_DTYPES:
            raise InputError(f"served dtype {dtype!r} is not one of {', '.join(TORCH_DTYPES)}")
        self._last: dict[str, Kept] = {}
        self.version: int | None = None
        self.anchor_version: int | None = None
        self._pending: _Pending | None = None
        # ulp2: the change history the rollout nodes hold at self.version, which the next patch is
        # coded against (codec.history); it starts afresh at every anchor, which new boxes start from.
        self._history: History | Future[History] = History()
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

    # ------------------------------------------------------------ the snapshot (sparrowd.snapshot)

    def _by_torch(self, bits) -> bool:
        return self.compare == "torch" or bits.device.type != "cpu"

    def _keep(self, t) -> Kept:
        return keep(t, self.dtype, self._by_torch)

    def _snapshot(self, model) -> dict[str, Kept]:
        """The model's tensors as served, gathered in name order (the order every rank gathers in),
        checked against the kept copies: a patch carries no new, removed or reshaped tensor."""
        sd = state(model)
        if set(sd) != set(self._last):
            raise InputError("the model's tensors differ from the base's (new or removed tensors need an anchor: "
                             "publish_anchor)")
        taken = {}
        for name in sorted(sd):
            old, new = self._last[name], served(sd[name], self.dtype, own=False)
            if (old.dtype, old.shape) != (new.dtype, new.shape):
                raise InputError(f"tensor {name!r} changed dtype or shape (that needs an anchor: publish_anchor)")
            taken[name] = new
        return taken

    # ------------------------------------------------------------ the API

    def start(self, model, version: int = 0, *, anchor: bool = True) -> PublishStats | None:
        """Take ``model`` as version ``version``, the base the rollout nodes start from.

        A daemon with nothing published yet gets it as anchor ``version`` (``anchor=False``:
        the nodes already hold the base; nothing is sent). A daemon whose chain ends at
        ``version`` (the trainer restarted from that version's checkpoint) goes on from it.
        Any other daemon state is an error: a patch on a base the nodes do not hold would be
        refused by every engine."""
        if follower():
            gather_all(model)
            return None
        self.wait_anchor()
        chain = self._daemon_state()
        check_start(chain, version)
        latest = chain["latest"]
        kept = {name: self._keep(t) for name, t in sorted(state(model).items())}  # the order ranks gather in
        self._last, self.version, self._pending = kept, version, None
        self._history = History()  # what the nodes hold of the last patches is not known here: start afresh
        self.anchor_version = chain["anchor"]
        self._unrecorded = latest is None  # the daemon knows nothing of this base until something is published
        if latest is None and anchor:
            return self._publish_anchor(version)
        return None

    def publish_anchor(self, model, version: int) -> PublishStats | None:
        """Publish ``model`` whole as anchor ``version``: the latest version (a snapshot of it;
        the model must be exactly what was published) or a newer one, which may add, remove or
        reshape tensors. Later patches build on it."""
        if follower():
            gather_all(model)
            return None
        self._check_started()
        self.wait_anchor()
        self._sync()
        assert self.version is not None  # _check_started raised otherwise; nothing sets it back to None
        check_anchor(version, self.version)
        kept = {}
        for name, t in sorted(state(model).items()):  # the order every rank gathers in
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
        if follower():
            gather_all(model)
            return None
        self._check_started()
        t_wait = time.perf_counter()
        self.wait_anchor()  # it reads the kept copies this version moves
        t_wait = time.perf_counter() - t_wait
        self._sync()
        assert self.version is not None  # _check_started raised otherwise; nothing sets it back to None
        check_follows(version, self.version)
        t_start = time.perf_counter()
        stats = PublishStats(version=version, base_version=self.version, anchor_wait_seconds=t_wait)
        changes, body, history = self._encode_patch(version, self._snapshot(model), stats, t_start)
        self._commit(version, body, changes, history)
        self._last_patch_bytes = stats.patch_bytes
        stats.total_seconds = time.perf_counter() - t_start
        self._anchor_if_due(version, stats)
        if self.max_lag is not None:
            t0 = time.perf_counter()
            self.bound_lag(version)
            stats.lag_wait_seconds = time.perf_counter() - t0
        return stats

    def _encode_patch(self, version: int, taken: dict[str, Kept], stats: PublishStats, t_start: float):
        """The transaction's first half: each change of ``taken`` encoded on the publish thread as
        its compare finds it, each chunk handed to the daemon as soon as it is closed. Returns the
        changes, the manifest's bytes and the change history the next patch is coded against; on
        any error every kept copy and mirror moved is put back before it is raised."""
        ulp2 = self.values == ULP2
        prior = self._history_now() if ulp2 else None  # the change history this patch is coded against
        enc = PatchEncoder(version=version, base_version=self.version, values=self.values,
                           chunk_size=self._patch_chunk_size(), history=prior, pool=self._segments)
        stream = _Stream(self, Key(version), stats, t_start)

        def encode(c: Change) -> None:
            t0 = time.perf_counter()
            if c.mirrored is not None:  # compared by torch: the host mirror was moved (and ranked) on a thread
                c.update[3], c.ranked = c.mirrored.result()
            # The values were gathered already; the encoder only needs the layout of both sides.
            chunks = enc.add_extract(c.name, c.layout, c.layout, c.idx, c.kept.fp, c.update[3], c.ov, c.nv, c.ranked)
            stats.encode_seconds += time.perf_counter() - t0
            stream.send(chunks)

        changes = Changes(self._last, taken, self._compare, self._by_torch, prior, stats)
        sent: list[Future] = []
        try:
            for c in changes:
                sent.append(self._pool.submit(encode, c))
            for f in sent:
                f.result()  # errors from the worker (daemon down, refused) surface here
            manifest, rest = enc.finish()
            stream.send(rest)
            # The history the next patch is coded against, merged while the daemon signs this one: on
            # the publish thread (idle now), its tensors side by side on the segment threads.
            history = self._pool.submit(enc.next_history, self._segments) if ulp2 else enc.next_history()
        except BaseException:
            changes.rollback(sent)
            raise
        return changes, manifest.to_bytes(), history

    def _commit(self, version: int, body: bytes, changes: Changes, history: History | Future) -> None:
        """The transaction's second half: the manifest to the daemon, then the kept copies move on.
        No reply (an error, or an interrupt mid-request): taken or not, the next call asks the daemon,
        and adopts this version if it is there (or puts the kept copies back if it is not)."""
        try:
            self._post("/v1/publish/manifest", body)
        except BaseException:
            self._pending = _Pending(version, blake3.blake3(body).hexdigest(), changes.updates, changes.moved, history)
            raise
        self._advance(version, changes.updates, history)

    def _anchor_if_due(self, version: int, stats: PublishStats) -> None:
        """Every ``anchor_every`` versions, an anchor of this version follows the patch (in the
        background with ``background_anchors``)."""
        if not anchor_due(version, self.anchor_version, self.anchor_every):
            return
        stats.anchor_started = True
        if self.background_anchors:
            self._anchor = self._anchoring.submit(self._publish_anchor, version)
        else:
            a = self._publish_anchor(version)
            stats.anchor_seconds, stats.anchor_bytes = a.total_seconds, a.patch_bytes

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
        chain = self._daemon_state()
        self._rollouts = _number(chain.get("rollouts"), int)
        self._uplink = _number(chain.get("uplink"), (int, float))
        self._round_trip = _number(chain.get("round_trip"), (int, float))
        latest = chain["latest"]
        if latest == self.version or (latest is None and self._unrecorded):
            if self._pending is not None:  # the daemon never took it: the mirrors go back too
                undo(self._pending.moved)
            self._pending = None
            return
        p = self._pending
        if p is not None and latest == p.version and chain["manifest"] == p.manifest:
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

    def _publish_anchor(self, version: int, tensors: dict[str, Kept] | None = None) -> PublishStats:
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
            on_host = t.mirror if t.mirror is not None else host(t.bits)  # no device copy when mirrored
            stats.to_host_seconds += time.perf_counter() - t0
            t0 = time.perf_counter()
            chunks = enc.add(name, None, RawTensor(t.dtype, t.shape, on_host))
            stats.encode_seconds += time.perf_counter() - t0
            sending.append(self._pool.submit(stream.send, chunks))
            while len(sending) > 4:
                sending.pop(0).result()
            stats.tensors += 1
            stats.elements += on_host.size
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

    def _post(self, path: str, data) -> dict:
        return http_call(f"{self.daemon}{path}", self._token, method="POST", data=bytes(data), timeout=self.timeout)
