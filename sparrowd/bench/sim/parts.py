"""The state every part of the simulator shares: ``SimParts`` declares the run's tables (the clock and
the version, the nodes, the flows' parallel arrays, the per-request arrays, the tallies a version's
row is read from), which ``core.Sim`` sets up. Each part (``serve.Serving``, ``links.Links``,
``fetch.Fetching``, ``push.Pushing``) subclasses it, and ``Sim`` is made of them all.

What a part calls of another part, or of ``Sim``, is declared here too, for the type checker only
(``TYPE_CHECKING``): the part that defines it overrides the declaration, and mypy holds the two to one
signature. Nothing here runs.

Imports ``model`` and numpy; never a part (they import this).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .model import Config, Node, Req

__all__ = ["SimParts"]


class SimParts:
    """A run's shared state, as ``Sim.__init__`` sets it up; annotations only."""

    cfg: Config
    now: float  # the virtual clock (seconds)
    version: int  # the version being spread
    # The swarm: node 0 is the trainer; each region's heads, as the tracker names them (less those gone).
    nodes: list[Node]
    by_id: dict[str, Node]
    trainer: Node
    heads: dict[str, list[str]]
    # A version's chunks: how many, the largest's size, the block they are hashed in, each one's size.
    chunks: int
    chunk_size: int
    block: int
    sizes: list[int]
    dirty: set[Node]  # nodes to plan at this step
    pending: set[Node]  # live rollout nodes without the current version
    near_trainer: int  # the trainer's live peers in its own region
    near_wanting: int  # ...of them, those still short of the version
    shown_fetching: dict[int, tuple[float, set[int]]]  # by node: (when, what ``shows_fetching`` said)
    # Tallies over the run (a version's row takes the difference).
    cross_bytes: float
    wasted: float
    relayed: float
    cuts: int
    # Flows (uploads being sent) and their parallel arrays, swap-removed (``links``).
    flows: list[Req]
    f_src: np.ndarray
    f_pair: np.ndarray
    f_cross: np.ndarray
    f_left: np.ndarray
    f_size: np.ndarray
    f_serial: np.ndarray
    f_feed: np.ndarray
    f_last: np.ndarray
    f_ss: np.ndarray
    f_sn: np.ndarray
    f_fsize: np.ndarray
    assemblies: set[Req]  # partials of chunks arriving in stripes (``Req.parts``)
    # Per request, by ``Req.serial``: bytes its server sent, whether the partial it feeds is whole.
    nreq: int
    s_got: np.ndarray
    s_whole: np.ndarray
    cancel_pending: bool  # a flow was cancelled: the next step ends it
    # Per node: upload and WAN limits (bytes a second), their token buckets (size, tokens), bytes uploaded.
    up: np.ndarray
    wan: np.ndarray
    burst_up: np.ndarray
    burst_wan: np.ndarray
    tok_up: np.ndarray
    tok_wan: np.ndarray
    sent: np.ndarray

    if TYPE_CHECKING:
        # What one part calls of another (the defining part is named): declarations for the checker.

        # core (Sim)
        def at(self, t: float, fn: Callable[..., object], *args: object) -> None: ...
        def note(self, event: str, r: Req) -> None: ...
        def owd(self, a: Node, b: Node) -> float: ...

        # serve
        @staticmethod
        def lane(x: Node, y: Node) -> bool: ...
        def choked_for(self, x: Node, y: Node) -> bool: ...
        def shown(self, x: Node, y: Node) -> set[int]: ...
        def request_arrives(self, r: Req) -> None: ...
        def room(self, x: Node, feed: Req) -> int | None: ...
        def start_uploads(self, x: Node) -> None: ...

        # links
        def _add_flow(self, r: Req) -> None: ...
        def _serial(self) -> int: ...

        # fetch
        def dropped(self, r: Req) -> None: ...
        def ready(self, f: Req) -> float: ...
        def abort(self, f: Req) -> None: ...
        def release(self, r: Req) -> None: ...
        def withdraw(self, r: Req) -> None: ...
        def refused(self, r: Req) -> None: ...
        def failed(self, r: Req) -> None: ...
        def arrives(self, r: Req) -> None: ...
        def tell(self, y: Node, c: int, have: bool = ...) -> None: ...

        # push
        def push(self, y: Node, c: int) -> None: ...
        def assembled(self, a: Req) -> float: ...
        def stripes_stopped(self, a: Req) -> None: ...
