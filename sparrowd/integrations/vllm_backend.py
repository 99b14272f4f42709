"""The ``sparrowd`` weight-transfer backend for vLLM: both of its sides.

Worker side (``SparrowWeightTransferEngine``), inside each vLLM worker of a
server started with ``--weight-transfer-config '{"backend": "sparrowd"}'``:

    POST /init_weight_transfer_engine  {"init_info": {"socket": PATH, "token_file": PATH}}
    POST /pause?mode=keep
    POST /start_weight_update
    POST /update_weights               {"update_info": {"version": N}}
    POST /finish_weight_update         {"weight_version": "N"}
    POST /resume

``init`` attaches the worker to its node's daemon through the engine socket
and learns where each checkpoint tensor lives among the runtime parameters
(``VllmPatcher``, shared with the worker extension). ``update_weights`` applies
every version up to N that the daemon holds, in order, as one transaction,
O(changed elements): the daemon decoded them ahead into sealed memfds, so
what the pause covers is the scatter. A version the daemon does not have
within the timeout (``init_info["timeout"]``, or ``update_info["timeout"]``)
raises and leaves the weights on the last complete version; so does any
error in between. The daemon hears what was applied once all of it was.

Trainer side (``SparrowTrainerWeightTransferEngine``), in the training
process, through vLLM's own trainer-side API::

    engine = WeightTransferTrainerFactory.trainer_init(
        SparrowTrainerInitInfo(rank=0, token_file="swarm.token"),
        client=[HTTPVLLMWeightSyncClient(url) for url in servers], source=ModuleSource(model))
    ...
    engine.send_weights()        # after each optimizer step

``send_weights`` publishes the step through ``sparrowd.Publisher`` (the swarm
carries it to every rollout node), waits until every node with an engine
attached holds it, then drives each server: pause (``keep``), start, update
to that version, finish with ``weight_version`` = the version's number,
prefix cache reset, resume.
"""

from __future__ import annotations

import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ..client import http_call
from ..errors import SparrowError
from .vllm import VllmPatcher, worker_rank
from .vllm_plugin import register_engines

if TYPE_CHECKING:
    from ..publisher import Publisher

__all__ = [
    "SparrowInitInfo",
    "SparrowUpdateInfo",
    "SparrowWeightTransferEngine",
    "SparrowTrainerInitInfo",
    "SparrowTrainerWeightTransferEngine",
    "move_server",
    "DEFAULT_SOCKET",
    "DEFAULT_TOKEN_FILE",
]

log = logging.getLogger("vllm.sparrowd")  # a child of vLLM's logger: it shows in the server's log

DEFAULT_SOCKET = "/run/sparrowd/engine.sock"  # where `sparrowd install` puts it
DEFAULT_TOKEN_FILE = "/etc/sparrowd/swarm.token"
DEFAULT_TIMEOUT = 60.0


def _number(name: str, value, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name} must be a number of seconds >= {minimum:g}, not {value!r}")
    return float(value)


def _version(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a sparrowd version (an integer >= 0), not {value!r}")
    return value


# ---------------------------------------------------------------------------- worker side


@dataclass
class SparrowInitInfo(WeightTransferInitInfo):
    """What a worker attaches to its node's daemon with (``init_info`` of
    ``/init_weight_transfer_engine``)."""

    socket: str = field(default_factory=lambda: os.environ.get("SPARROWD_ENGINE_SOCKET", DEFAULT_SOCKET))
    token_file: str = field(default_factory=lambda: os.environ.get("SPARROWD_TOKEN_FILE", DEFAULT_TOKEN_FILE))
    version: int | None = None  # the sparrowd version of the weights the server holds (first init: 0)
    timeout: float = DEFAULT_TIMEOUT  # how long an update waits for a version the daemon does not hold yet
    engine: str | None = None  # the id the daemon knows this server by (default: vllm-HOST-INSTANCE)

    def __post_init__(self) -> None:
        for name in ("socket", "token_file"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"init_info {name!r} must be a path")
        if self.engine is not None and (not isinstance(self.engine, str) or not 0 < len(self.engine) <= 64):
            raise ValueError("init_info 'engine' must be a name of 1 to 64 characters")
        if self.version is not None:
            _version("init_info 'version'", self.version)
        self.timeout = _number("init_info 'timeout'", self.timeout)


@dataclass
class SparrowUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of ``/update_weights``: the version to be on afterwards."""

    version: int
    timeout: float | None = None  # overrides the init's timeout for this update

    def __post_init__(self) -> None:
        _version("update_info 'version'", self.version)
        if self.timeout is not None:
            self.timeout = _number("update_info 'timeout'", self.timeout)


class SparrowWeightTransferEngine(WeightTransferEngine[SparrowInitInfo, SparrowUpdateInfo]):
    """Applies sparrowd versions, in place, from the node's daemon."""

    init_info_cls = SparrowInitInfo
    update_info_cls = SparrowUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self._patcher: VllmPatcher | None = None
        self._timeout = DEFAULT_TIMEOUT

    @property
    def version(self) -> int | None:
        return None if self._patcher is None else self._patcher.version

    def init_transfer_engine(self, init_info: SparrowInitInfo) -> None:
        if self._patcher is None:
            self._patcher = VllmPatcher(self.model, self.model_config.model)
        engine = init_info.engine or f"vllm-{os.uname().nodename}-{self.vllm_config.instance_id}"[:64]
        self._patcher.connect(init_info.socket, token_file=init_info.token_file, version=init_info.version,
                              engine=engine, rank=worker_rank())
        self._timeout = init_info.timeout
        log.info("sparrowd: attached to %s as %s at version %d (%s)", init_info.socket, engine,
                 self._patcher.version, self._patcher.learned)

    def start_weight_update(self) -> None:
        self._attached()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # the scatters are queued on the device
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: SparrowUpdateInfo) -> None:
        patcher = self._attached()
        timeout = self._timeout if update_info.timeout is None else update_info.timeout
        before = patcher.version
        t0 = time.perf_counter()
        patcher.update(update_info.version, wait=timeout, exact=True)
        log.info("sparrowd: version %d -> %d in %.3f s", before, patcher.version, time.perf_counter() - t0)

    def finish_weight_update(self) -> None:
        """Nothing left to do: ``update_weights`` applied and acknowledged the whole version."""

    def shutdown(self) -> None:
        if self._patcher is not None:
            self._patcher.close()

    def _attached(self) -> VllmPatcher:
        if self._patcher is None or self._patcher.client is None:
            raise RuntimeError("sparrowd: not attached to a daemon; call /init_weight_transfer_engine first")
        return self._patcher


# ---------------------------------------------------------------------------- trainer side


@dataclass
class SparrowTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``sparrowd`` backend (``rank`` is keyword-only, from vLLM)."""

    backend: ClassVar[str] = "sparrowd"

    daemon: str = "http://127.0.0.1:7070"  # the trainer's own daemon (it seeds and hosts the tracker)
    token_file: str | None = field(default_factory=lambda: os.environ.get("SPARROWD_TOKEN_FILE"))  # swarm token
    version: int = 0  # the version the servers' weights are now; send_weights publishes the next ones
    worker_init_info: dict = field(default_factory=dict)  # each server's init_info ({} : its defaults)
    hold_timeout: float = 600.0  # how long send_weights waits for the rollout nodes to hold a version
    update_timeout: float = 60.0  # update_info["timeout"]: a server waits this long for a held version
    publisher: dict = field(default_factory=dict)  # keyword arguments of sparrowd.Publisher
    # Publish the servers' weights as an anchor first. False: every rollout box holds that base
    # itself (its server loaded it from a local folder, which its daemon starts from).
    anchor: bool = True
    # Bounded staleness: publishing version v returns only once every live engine holds v - max_lag or
    # later (StaleEnginesError naming those behind after lag_timeout). None: no bound.
    max_lag: int | None = None
    lag_timeout: float = 600.0

    def __post_init__(self) -> None:
        _version("version", self.version)
        self.hold_timeout = _number("hold_timeout", self.hold_timeout)
        self.update_timeout = _number("update_timeout", self.update_timeout)
        if not isinstance(self.worker_init_info, dict) or not isinstance(self.publisher, dict):
            raise ValueError("worker_init_info and publisher must be dicts")


@dataclass
class SendStats:
    """What one ``send_weights`` spent, in seconds."""

    version: int
    publish: float = 0.0  # compare, encode, hand the chunks to the daemon
    hold: float = 0.0  # until every rollout node with an engine holds the version
    update: float = 0.0  # pause, apply, finish, resume on every server (in parallel)
    paused: list[float] = field(default_factory=list)  # per server, pause to resume
    verify: float = 0.0  # comparing every server's weight checksums (send_weights(verify=True))
    publish_stats: Any = None  # sparrowd.PublishStats


class SparrowTrainerWeightTransferEngine(TrainerWeightTransferEngine[SparrowTrainerInitInfo]):
    """Publishes each step through the swarm, then moves every server to it."""

    init_info_cls = SparrowTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.clients = list(client) if isinstance(client, (list, tuple)) else [client]
        self.info: SparrowTrainerInitInfo | None = None
        self.publisher: Publisher | None = None
        self.version: int | None = None
        self.last: SendStats | None = None

    def _trainer(self) -> tuple[SparrowTrainerInitInfo, Publisher]:
        assert self.info is not None and self.publisher is not None  # trainer_init sets both
        return self.info, self.publisher

    @classmethod
    def trainer_init(cls, init_info: SparrowTrainerInitInfo, *, client, source=None):
        from .. import Publisher

        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.info = init_info
        engine.publisher = publisher = Publisher(daemon=init_info.daemon, token_file=init_info.token_file,
                                                 max_lag=init_info.max_lag, lag_timeout=init_info.lag_timeout,
                                                 **init_info.publisher)
        if source is not None:  # the servers hold these weights: the base every later step is a patch on
            publisher.start(engine._weights(None), version=init_info.version, anchor=init_info.anchor)
            engine.version = init_info.version
        if engine.is_sender:
            engine._each(lambda c: c.init_weight_transfer_engine(dict(init_info.worker_init_info)))
            engine._each(lambda c: _Control(c).set_version(init_info.version))
        return engine

    def send_weights(self, model=None, version: int | None = None, *, verify: bool = False) -> SendStats | None:
        """Publish ``model`` (default: the source given at init) as ``version`` (default: the
        next), then move every server to it. Called on every trainer rank; only rank 0 drives
        the servers and gets the stats. ``verify``: then compare every server's weight checksums
        (``verify_servers``)."""
        stats = self.publish_weights(model, version)
        if stats is not None:
            self.update_servers(stats.version, stats)
            if verify:
                t0 = time.perf_counter()
                self.verify_servers()
                stats.verify = time.perf_counter() - t0
        return stats

    def verify_servers(self) -> None:
        """Every server's weights, by vLLM's per-tensor checksums (``/weight_checker`` over HTTP, the
        engine's ``compute_weight_checksums`` for a Ray actor), must be the same: a server that
        silently diverged fails loudly here, named, with its first tensor that differs."""
        if sum(len(c.handles) if hasattr(c, "handles") else 1 for c in self.clients) < 2:
            return  # one server agrees with itself
        servers = [s for c in self.clients for s in _checksums(c)]
        counts: dict[tuple, int] = {}
        for _, sums in servers:
            key = tuple(sorted(sums.items()))
            counts[key] = counts.get(key, 0) + 1
        if len(counts) == 1:
            return
        best = max(counts.values())
        usual = dict(next(k for k, n in counts.items() if n == best))
        odd = [(name, sums) for name, sums in servers if sums != usual]
        name, sums = odd[0]
        first = sorted(k for k in usual.keys() | sums.keys() if usual.get(k) != sums.get(k))[0]
        if list(counts.values()).count(best) > 1:  # no majority: every server is named
            raise SparrowError(f"servers disagree on their weights after version {self.version}, with no majority: "
                               f"{', '.join(n for n, _ in servers)} (tensor {first!r} first)")
        raise SparrowError(f"server {', '.join(n for n, _ in odd)} differs from the other "
                           f"{len(servers) - len(odd)} after version {self.version}: tensor {first!r} first")

    def publish_weights(self, model=None, version: int | None = None) -> SendStats | None:
        """The first half of ``send_weights``: publish the version; the swarm starts carrying it
        while the caller goes on (a one-step off-policy loop generates the next batch on the
        previous version meanwhile, then calls ``update_servers``)."""
        info, publisher = self._trainer()
        weights = self._weights(model)
        t0 = time.perf_counter()
        if self.version is None:  # no base was given: this version goes out whole, as an anchor
            version = info.version if version is None else version
            pub = publisher.start(weights, version=version)
        else:
            version = self.version + 1 if version is None else version
            pub = publisher.publish(weights, version=version)
        self.version = version
        if not self.is_sender:
            return None
        return SendStats(version, publish=time.perf_counter() - t0, publish_stats=pub)

    def update_servers(self, version: int, stats: SendStats | None = None) -> SendStats:
        """The second half: wait until the rollout nodes hold ``version``, then move every server
        to it (pause, update, finish, resume, all servers at once). Rank 0 only."""
        stats = stats or SendStats(version)
        t1 = time.perf_counter()
        self.wait_held(version)
        stats.hold = time.perf_counter() - t1
        t2 = time.perf_counter()
        stats.paused = self._each(lambda c: self._update(c, version))
        stats.update = time.perf_counter() - t2
        self.last = stats
        return stats

    def wait_held(self, version: int, timeout: float | None = None) -> None:
        """Until every live rollout node with an engine attached holds ``version`` (the tracker's
        view, which nodes update as versions complete)."""
        info, publisher = self._trainer()
        timeout = info.hold_timeout if timeout is None else timeout
        publisher.wait(version, engines=True, timeout=timeout)

    def _update(self, client, version: int) -> float:
        info, _ = self._trainer()
        return move_server(client, version, timeout=info.update_timeout)

    def _each(self, fn) -> list:
        if len(self.clients) == 1:
            return [fn(self.clients[0])]
        with ThreadPoolExecutor(max_workers=min(16, len(self.clients))) as pool:
            return list(pool.map(fn, self.clients))

    def _weights(self, model):
        if model is not None:
            return model
        if self.source is None:
            raise SparrowError("send_weights needs the model: pass it, or give trainer_init a source")
        if isinstance(self.source, ModuleSource):
            return self.source._module  # Publisher gathers FSDP tensors itself, one at a time
        return dict(iter(self.source))

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.close()


def _checksums(client) -> list[tuple[str, dict[str, str]]]:
    """Each server behind ``client``: (its name, its weights' checksums by tensor and rank)."""
    if hasattr(client, "base_url"):
        reply = http_call(f"{client.base_url.rstrip('/')}/weight_checker", None, method="POST",
                          body={"action": "checksum"}, timeout=getattr(client, "timeout", 300))
        return [(client.base_url, dict(reply["checksums"]))]
    if hasattr(client, "handles"):
        import ray

        out = []
        for i, h in enumerate(client.handles):
            if actor_supports(h, "compute_weight_checksums"):  # an AsyncLLM
                per_worker = ray.get(h.compute_weight_checksums.remote())
            elif actor_supports(h, "collective_rpc"):  # an LLM: its workers, through the engine
                per_worker = ray.get(h.collective_rpc.remote("compute_weight_checksums"))
            else:
                raise SparrowError(f"verify: actor {i} has neither compute_weight_checksums nor collective_rpc")
            merged: dict[str, str] = {}
            for sums in per_worker:
                merged.update(sums)
            out.append((f"actor {i}", merged))
        return out
    raise SparrowError(f"verify: cannot read the weights of a {type(client).__name__}")


def move_server(client, version: int, *, timeout: float = DEFAULT_TIMEOUT) -> float:
    """One server to ``version`` through vLLM's weight-sync client: start, pause (``keep``),
    update, finish with the version's number, prefix cache reset, and always resume once
    paused. Returns the seconds from pause to resume."""
    control = _Control(client)
    client.start_weight_update()
    t0 = time.perf_counter()
    control.pause()
    try:
        client.update_weights({"version": version, "timeout": timeout})
        client.finish_weight_update(str(version))
        control.reset_prefix_cache()
    finally:
        control.resume()
    return time.perf_counter() - t0


class _Control:
    """What vLLM's four-method client protocol leaves out: pausing and resuming the server, its
    prefix cache and its version label. Spoken over the RL HTTP routes for
    ``HTTPVLLMWeightSyncClient`` (``base_url``), to the actors for ``RayVLLMWeightSyncClient``
    (``handles``), or through the client's own ``pause``/``resume`` methods when it has them;
    anything else is driven without a pause.

    A Ray actor is asked what it has, not assumed to be an ``AsyncLLM``: an ``LLM`` actor has no
    pause (its ``generate`` is synchronous, and an actor runs one call at a time, so the update
    runs between two ``generate`` calls); an ``AsyncLLM`` actor is paused with ``keep`` and
    resumed."""

    def __init__(self, client):
        self.client = client

    def pause(self) -> None:
        self._do("pause", "pause?mode=keep", "pause_generation", kwargs={"mode": "keep"})

    def resume(self) -> None:
        self._do("resume", "resume", "resume_generation")

    def reset_prefix_cache(self) -> None:
        """Prefixes cached under the old weights are stale. The reset is refused while requests
        are running (kept across the pause); their cached prefixes then stay until they end."""
        self._do("reset_prefix_cache", "reset_prefix_cache", "reset_prefix_cache")

    def set_version(self, version: int) -> None:
        self._do("update_weight_version", "update_weight_version", "update_weight_version", args=(str(version),),
                 body={"new_version": str(version)})

    def _do(self, method: str, path: str, actor_method: str, *, args: tuple = (), kwargs: dict | None = None,
            body: dict | None = None) -> None:
        c = self.client
        if hasattr(c, "base_url"):
            http_call(f"{c.base_url.rstrip('/')}/{path}", None, method="POST", body=body,
                      timeout=getattr(c, "timeout", 300))
        elif hasattr(c, "handles"):
            import ray

            ray.get([getattr(h, actor_method).remote(*args, **(kwargs or {}))
                     for h in c.handles if actor_supports(h, actor_method)])
        elif callable(getattr(c, method, None)):
            getattr(c, method)()


def actor_supports(handle, method: str) -> bool:
    """Whether a Ray actor has ``method`` (``LLM`` actors have no ``pause_generation``)."""
    try:
        getattr(handle, method)
    except AttributeError:
        return False
    return True


register_engines()  # vLLM's trainer process loads no plugins; the init info's import registers the backend
