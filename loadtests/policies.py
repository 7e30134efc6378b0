"""Baseline pickers to compare pd-router's joint pair choice against (benchmarks only).

Each is a ``Picker`` subclass usable as ``App(config, picker_factory=...)``. They gather candidates
through ``Picker.candidates`` like the real picker, order the prefill and the decode pods each by
their own key (separately: that is what makes them baselines), then reserve through
``pool.reserve`` and record the optimistic KV-index entries exactly as ``Picker._decide`` does,
so the proxy's release and failover logic treat them like pd-router. Fallbacks follow each
baseline's own order.

* ``RoundRobinPicker`` — decode pods (and prefill pods) in turn.
* ``LeastLoadedPicker`` — fewest running+waiting on decode, fewest queued tokens on prefill.
* ``IndependentPicker`` — best prefill pod alone (queue wait + uncached prefill) and best decode
  pod alone (decode-side cost), no link term: what llm-d / SGLang routers do.

Baselines always pair when the pool has prefill-only pods; on a ``prefill-decode`` pool they pick
one pod. They ignore KV headroom except ``IndependentPicker`` (its decode-side cost filters it).
"""

from __future__ import annotations

import numpy as np

from kvindex.base import PrefixIndex
from router.config import PoolConfig
from router.picker import Picker, RouteDecision
from router.pool import Pool
from router.request import NoCapacity, RouteRequest
from scorers import prefix, queue
from scorers.base import Candidates, RequestCtx, fill_unknown
from scorers.cost import PairCosts, pair_costs

# Tie-break scale for least-loaded: far below one request or one token of difference.
_TIE = 1e-6


class _BaselinePicker(Picker):
    """Shared plumbing: candidates, then a subclass's separable preference, then reserve + decide."""

    def pick(self, request: RouteRequest, now: float | None = None) -> RouteDecision:
        pool = self.pool
        cand = self.gather(request, now)
        slots = cand.slots
        # Only dedicated prefill pods form pairs: a baseline never splits a request across two
        # prefill-decode pods (that is a pd-router-only move).
        is_prefill = pool.can_prefill[slots] & ~pool.can_decode[slots]
        is_decode = pool.can_decode[slots]
        prefill, decode = np.flatnonzero(is_prefill), np.flatnonzero(is_decode)
        if len(decode) == 0:
            raise NoCapacity("no admitted endpoint with fresh metrics can decode", retry_after_s=1.0)
        ctx = RequestCtx(
            prompt_tokens=request.prompt_tokens,
            max_tokens=request.max_tokens,
            block_tokens=self.block_tokens,
            typical_prompt_tokens=pool.typical_prompt_tokens,
        )
        # Keys are separable (a prefill pod's key does not depend on the decode pod and vice
        # versa): the two choices are independent, which is the point of every baseline here.
        costs = (
            pair_costs(cand, is_prefill, is_decode, ctx, self._cost_params()) if self.needs_costs else None
        )
        d_key = self._decode_key(cand, decode, ctx, costs)
        d_order = np.argsort(d_key, kind="stable")
        d_order = decode[d_order[np.isfinite(d_key[d_order])]]
        if d_order.size == 0:
            raise NoCapacity("no decode endpoint has the KV capacity for this request", retry_after_s=1.0)
        p_order = None
        if len(prefill):
            p_order = prefill[np.argsort(self._prefill_key(cand, prefill, ctx, costs), kind="stable")]
        self._advance()
        return self._commit(request, ctx, cand, p_order, d_order)

    def _commit(
        self,
        request: RouteRequest,
        ctx: RequestCtx,
        cand: Candidates,
        p_order: np.ndarray | None,
        d_order: np.ndarray,
    ) -> RouteDecision:
        """Reserve and record exactly as ``Picker._decide`` does, so the proxy's release logic works.

        Not ``_decide`` itself: it is tied to the shape of pd-router's cost matrix (which rows are
        which prefill pods), and a baseline has no such matrix. Orders are candidate positions.
        """
        by_slot = self.pool.by_slot
        cached = prefix.cached_tokens(cand, ctx)
        d = int(d_order[0])
        d_slot = int(cand.slots[d])
        n = self.config.picker.fallbacks
        decode_fallbacks = [by_slot[int(cand.slots[c])] for c in d_order[1 : n + 1]]
        # The pod that prefills computes only what it has not cached.
        p = d if p_order is None else int(p_order[0])
        p_slot = None if p_order is None else int(cand.slots[p])
        uncached = ctx.prompt_tokens - float(cached[p])
        prefill_fallbacks = (
            [] if p_order is None else [by_slot[int(cand.slots[r])] for r in p_order[1 : n + 1]]
        )
        reservation = self.pool.reserve(
            decode_slot=d_slot,
            prefill_slot=p_slot,
            prefill_tokens=uncached,
            kv_tokens=ctx.prompt_tokens + ctx.max_tokens - float(cached[d]),
        )
        self.pool.observe_prompt(request.prompt_tokens)
        # Optimistic, as the real picker: the blocks will be on P, and on D after the transfer.
        if p_slot is not None:
            self.defer(self.index.record, p_slot, request.block_keys)
        self.defer(self.index.record, d_slot, request.block_keys)
        decode_ep = by_slot[d_slot]
        prefill_ep = None if p_slot is None else by_slot[p_slot]
        assert decode_ep is not None
        where = decode_ep.id if prefill_ep is None else f"{prefill_ep.id} -> {decode_ep.id}"
        hit = request.prompt_tokens - uncached
        return RouteDecision(
            decode=decode_ep,
            prefill=prefill_ep,
            reservation=reservation,
            reason=f"{self.name} {where}: {hit:.0f}/{request.prompt_tokens} prompt tokens cached",
            breakdown={"cached_tokens": hit, "uncached_tokens": uncached},
            prefill_fallbacks=prefill_fallbacks,  # type: ignore[arg-type]
            decode_fallbacks=decode_fallbacks,  # type: ignore[arg-type]
        )

    name = "baseline"
    needs_costs = False  # only IndependentPicker reads pd-router's cost terms

    def _prefill_key(
        self, cand: Candidates, prefill: np.ndarray, ctx: RequestCtx, costs: PairCosts | None
    ) -> np.ndarray:
        """Lower is better, one value per position in ``prefill``."""
        raise NotImplementedError

    def _decode_key(
        self, cand: Candidates, decode: np.ndarray, ctx: RequestCtx, costs: PairCosts | None
    ) -> np.ndarray:
        """Lower is better, one value per position in ``decode``; +inf = not a candidate."""
        raise NotImplementedError

    def _advance(self) -> None:
        """Called once per successful pick (round-robin moves its pointers)."""


class RoundRobinPicker(_BaselinePicker):
    """Decode pods in turn, and prefill pods in turn (a pair whenever prefill pods exist)."""

    name = "round-robin"

    def __init__(self, config: PoolConfig, pool: Pool, index: PrefixIndex, seed: int | None = None) -> None:
        super().__init__(config, pool, index, seed)
        self._next_decode = 0
        self._next_prefill = 0

    @staticmethod
    def _rank(n: int, start: int) -> np.ndarray:
        # Distance from the pointer: 0 for the pod whose turn it is, then the next ones (fallbacks).
        return ((np.arange(n) - start) % n).astype(np.float64)

    def _prefill_key(
        self, cand: Candidates, prefill: np.ndarray, ctx: RequestCtx, costs: PairCosts | None
    ) -> np.ndarray:
        return self._rank(len(prefill), self._next_prefill % len(prefill))

    def _decode_key(
        self, cand: Candidates, decode: np.ndarray, ctx: RequestCtx, costs: PairCosts | None
    ) -> np.ndarray:
        return self._rank(len(decode), self._next_decode % len(decode))

    def _advance(self) -> None:
        self._next_decode += 1
        self._next_prefill += 1


class LeastLoadedPicker(_BaselinePicker):
    """Fewest requests on decode (scraped running+waiting or our in-flight); fewest queued prefill tokens."""

    name = "least-loaded"

    def _prefill_key(
        self, cand: Candidates, prefill: np.ndarray, ctx: RequestCtx, costs: PairCosts | None
    ) -> np.ndarray:
        # The queue scorer's notion of queued tokens: ours, or scraped waiting × typical prompt.
        tokens = queue.queued_tokens(cand, ctx)[prefill]
        return tokens + _TIE * self._rng.random(len(prefill))

    def _decode_key(
        self, cand: Candidates, decode: np.ndarray, ctx: RequestCtx, costs: PairCosts | None
    ) -> np.ndarray:
        scraped = fill_unknown(cand.running, worst=0.0) + fill_unknown(cand.waiting, worst=0.0)
        requests = np.maximum(scraped, cand.inflight_requests)[decode]
        return requests + _TIE * self._rng.random(len(decode))


class IndependentPicker(_BaselinePicker):
    """Best prefill pod alone and best decode pod alone, with no link term (llm-d / SGLang style).

    Prefill: ``w_queue * queue_wait + uncached_prefill_time`` from pd-router's own cost terms
    (prefix locality and fairness cap included). Decode: pd-router's decode-side column (TPOT vs
    SLO plus KV penalty, +inf where the request would not fit). On a pool without prefill-only
    pods it picks one pod by local TTFT + decode column, i.e. pd-router's single-pod row.
    """

    name = "independent"
    needs_costs = True

    def _prefill_key(
        self, cand: Candidates, prefill: np.ndarray, ctx: RequestCtx, costs: PairCosts | None
    ) -> np.ndarray:
        assert costs is not None
        return costs.route_s[prefill]

    def _decode_key(
        self, cand: Candidates, decode: np.ndarray, ctx: RequestCtx, costs: PairCosts | None
    ) -> np.ndarray:
        assert costs is not None
        params = self._cost_params()
        w = params.weights
        column = w.load * costs.tpot_s[decode] / params.tpot_slo_s + w.kv * costs.kv_penalty[decode]
        # The KV filter makes every row of a column +inf where the request could never fit.
        column = np.where(np.isfinite(costs.cost).any(axis=0), column, np.inf)
        if costs.ttft_s.shape[0] == 1:
            # No prefill pods (a prefill-decode pool): the pod also prefills, so its TTFT counts.
            column = column + costs.ttft_s[0] / params.ttft_slo_s
        return column


POLICIES: dict[str, type[Picker]] = {
    "round-robin": RoundRobinPicker,
    "least-loaded": LeastLoadedPicker,
    "independent": IndependentPicker,
    "pd-router": Picker,
}
