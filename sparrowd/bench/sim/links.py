"""The fluid link model: the uploads being sent (flows) share each node's uplink, WAN limit and
the links between regions, re-shared every step; token buckets where ``Config.burst`` is set.
"""

from __future__ import annotations

import numpy as np

from .model import Req
from .parts import SimParts

__all__ = ["Links"]


class Links(SimParts):
    """``Sim``'s fluid links: flows sharing uplinks, WAN limits and the links between regions."""

    def _flow_arrays(self) -> tuple[np.ndarray, ...]:
        return (self.f_src, self.f_pair, self.f_cross, self.f_left, self.f_size, self.f_serial, self.f_feed,
                self.f_last, self.f_ss, self.f_sn, self.f_fsize)

    def _add_flow(self, r: Req) -> None:
        i = len(self.flows)
        if i == len(self.f_src):
            (self.f_src, self.f_pair, self.f_cross, self.f_left, self.f_size, self.f_serial, self.f_feed,
             self.f_last, self.f_ss, self.f_sn, self.f_fsize) = (np.concatenate([a, np.zeros_like(a)])
                                                                  for a in self._flow_arrays())
        self.flows.append(r)
        self.f_src[i] = r.src.idx
        self.f_pair[i] = r.src.region * self.cfg.regions + r.dst.region
        self.f_cross[i] = r.src.region != r.dst.region
        self.f_left[i] = r.left
        self.f_size[i] = r.size
        self.f_serial[i] = r.serial
        self.f_feed[i] = r.feed.serial if r.feed is not None else -1
        self.f_last[i] = r.size - (r.size % self.block or self.block)
        stripe = r.stripe if r.feed is not None and r.feed.size != r.size else None  # fed by the whole chunk
        self.f_ss[i], self.f_sn[i] = stripe if stripe is not None else (0, 0)
        self.f_fsize[i] = r.feed.size if r.feed is not None else 0.0

    def _remove_flow(self, i: int) -> None:
        last = len(self.flows) - 1
        if i != last:
            self.flows[i] = self.flows[last]
            for a in self._flow_arrays():
                a[i] = a[last]
        self.flows.pop()

    def _serial(self) -> int:
        s = self.nreq
        self.nreq += 1
        if s == len(self.s_got):
            self.s_got = np.concatenate([self.s_got, np.zeros_like(self.s_got)])
            self.s_whole = np.concatenate([self.s_whole, np.zeros_like(self.s_whole)])
        return s

    def step_flows(self, dt: float) -> None:
        """Share the links for ``dt`` seconds; finished (or cancelled) flows end."""
        nf = len(self.flows)
        if not nf:
            self._refill(dt, 0.0, 0.0)
            return
        n = len(self.nodes)
        up, wan = self.up + self.tok_up / dt, self.wan + self.tok_wan / dt  # this step's, with the buckets
        src, cross, left, size = self.f_src[:nf], self.f_cross[:nf], self.f_left[:nf], self.f_size[:nf]
        # A stream served from a partial sends no further than the whole blocks its feed has delivered,
        # and its last block only once the chunk arrived whole there; as a rate for this step.
        feed = self.f_feed[:nf]
        fed = feed >= 0
        cap = None
        if fed.any():
            fi = feed[fed]
            ready = np.where(self.s_whole[fi], np.inf,
                             np.minimum(np.floor(self.s_got[fi] / self.block) * self.block, self.f_last[:nf][fed]))
            sn = self.f_sn[:nf][fed]
            if sn.any():  # a stripe of a chunk still arriving: its blocks within the checked prefix
                st = sn > 0
                fsize = self.f_fsize[:nf][fed][st]
                prefix = np.minimum(np.floor(self.s_got[fi[st]] / self.block) * self.block,
                                    fsize - (fsize % self.block + (fsize % self.block == 0) * self.block))
                count = np.maximum(0, np.ceil((prefix / self.block - self.f_ss[:nf][fed][st]) / sn[st]))
                ready[st] = np.where(self.s_whole[fi[st]], np.inf, count * self.block)
            cap = np.full(nf, np.inf)
            cap[fed] = np.maximum(ready - (size[fed] - left[fed]), 0) / dt
        n_src = np.bincount(src, minlength=n)
        rate = up[src] / n_src[src]
        used = None
        if cross.any():
            xs = src[cross]
            pairs = self.f_pair[:nf][cross]
            n_pair = np.bincount(pairs, minlength=self.cfg.regions ** 2)
            lim = np.minimum(rate[cross], self.cfg.link_rate / n_pair[pairs])
            if cap is not None:
                lim = np.minimum(lim, cap[cross])
            # The node's WAN limit shared among its streams across, what a stream held back by its feed
            # (or its link) leaves going to the others, as the daemon's token bucket does (water-filling).
            slow = np.zeros(len(xs), bool)
            for i in range(4):
                share = np.maximum(wan - np.bincount(xs[slow], weights=lim[slow], minlength=n), 0) / \
                    np.maximum(np.bincount(xs[~slow], minlength=n), 1)
                more = ~slow & (lim < share[xs])
                if i == 3 or not more.any():
                    break
                slow |= more
            xr = np.minimum(share[xs], lim)
            rate[cross] = xr
            used = np.bincount(xs, weights=xr, minlength=n)
        if used is not None or cap is not None:
            # What the node's cross-region uploads leave of its uplink goes to its uploads inside the region,
            # shared evenly but for streams held back by their feeds (water-filling, a few rounds).
            local = ~cross
            ls = src[local]
            room = up - used if used is not None else up
            lim = cap[local] if cap is not None else np.full(len(ls), np.inf)
            slow = np.zeros(len(ls), bool)
            for i in range(4):
                share = np.maximum(room - np.bincount(ls[slow], weights=lim[slow], minlength=n), 0) / \
                    np.maximum(np.bincount(ls[~slow], minlength=n), 1)
                more = ~slow & (lim < share[ls])
                if i == 3 or not more.any():
                    break
                slow |= more
            rate[local] = np.minimum(share[ls], lim)
        sent = np.minimum(left, rate * dt)
        if self.cfg.cut_through and self.cfg.relay_after_block:  # a partial's first block checked out
            b = self.block
            for i in np.nonzero((size - left < b) & (size - left + sent >= b) & (size > b))[0].tolist():
                r = self.flows[i]
                if r.stripe is not None and r.asm is r.dst.partial.get(r.chunk) and not r.cancelled:
                    self.push(r.dst, r.chunk)  # a receiver hands its stripe on from its first block
                elif r.dst.partial.get(r.chunk) is r and not r.cancelled:
                    self.tell(r.dst, r.chunk, have=False)  # its peers may fetch it from there now
                    if any(self.cfg.push):
                        self.push(r.dst, r.chunk)
        left -= sent
        self.s_got[self.f_serial[:nf]] = size - left
        for a in self.assemblies:
            self.s_got[a.serial] = self.assembled(a)
        if cap is not None:
            self.relayed += float(sent[fed].sum())
        by_node = np.bincount(src, weights=sent, minlength=n)
        self.sent += by_node
        self.cross_bytes += float(sent[cross].sum())
        self._refill(dt, by_node, np.bincount(src[cross], weights=sent[cross], minlength=n))
        done = left <= 1e-6
        if self.cancel_pending:
            self.cancel_pending = False
            done |= np.fromiter((r.cancelled for r in self.flows), bool, nf)
        ended = []
        for i in sorted(np.nonzero(done)[0].tolist(), reverse=True):
            r = self.flows[i]
            r.left = float(left[i])
            ended.append(r)
            self._remove_flow(i)
        for r in ended:
            r.ended = True
            x = r.src
            if r.stripe is None:  # (stripes take no upload slot)
                x.active[self.lane(x, r.dst)] -= 1
            if r.dst.id in x.known:
                x.known[r.dst.id].uploads -= 1
            if r.cancelled:
                self.wasted += r.size - r.left
                self.dropped(r)
            else:
                if r.dst.id in x.known:
                    x.known[r.dst.id].rate_to.add(self.now, r.size)
                self.at(self.now + self.owd(x, r.dst), self.arrives, r)
            self.start_uploads(x)

    def _refill(self, dt: float, sent, sent_across) -> None:
        """The token buckets after ``dt`` seconds in which each node sent ``sent`` bytes, ``sent_across``
        of them to other regions (``Config.burst``)."""
        if self.cfg.burst > 0:
            self.tok_up = np.clip(self.tok_up + np.where(np.isfinite(self.up), self.up * dt, 0.0) - sent, 0,
                                  self.burst_up)
            self.tok_wan = np.clip(self.tok_wan + np.where(np.isfinite(self.wan), self.wan * dt, 0.0) - sent_across,
                                   0, self.burst_wan)
