"""``Picker.pick()``: the joint (prefill, decode) choice for one request, reserved at once.

Synchronous and vectorised: gather candidate features from the pool, one prefix-index lookup
for all candidates, one cost matrix (``scorers.cost``), one argmin. The pick charges its predicted
work to the pool before returning, so a burst between two scrapes spreads out instead of herding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvindex.base import PrefixIndex
from router.config import PoolConfig
from router.pool import Endpoint, Pool, Reservation
from router.request import NoCapacity, RouteRequest, Shed
from scorers.base import Candidates, EngineModel, RequestCtx
from scorers.cost import CostParams, PairCosts, Weights, pair_costs
from scorers.link import LinkTable

log = logging.getLogger(__name__)

# Relative jitter that only breaks exact ties (an idle pool) without reordering real differences.
_TIE_JITTER = 1e-9


@dataclass(slots=True)
class RouteDecision:
    """Where one request goes, why, and the reservation to release when it ends."""

    decode: Endpoint
    prefill: Endpoint | None
    reservation: Reservation
    reason: str
    breakdown: dict[str, float]
    prefill_fallbacks: list[Endpoint] = field(default_factory=list)
    decode_fallbacks: list[Endpoint] = field(default_factory=list)

    @property
    def kind(self) -> str:
        if self.prefill is not None:
            return "pd-pair"
        return "single" if self.decode.role == "prefill-decode" else "local-prefill"


class Picker:
    def __init__(
        self,
        config: PoolConfig,
        pool: Pool,
        index: PrefixIndex,
        seed: int | None = None,
        precise: PrefixIndex | None = None,
    ) -> None:
        """``index``: approximate (our own picks, text blocks); ``precise``: fed by KV events."""
        self.config = config
        self.pool = pool
        self.index = index
        self.precise = precise
        self.block_tokens = config.limits.block_tokens
        self._rng = np.random.default_rng(seed)
        self._links_version = -1
        self._params: CostParams | None = None
        # How work that may follow a pick is run: at once by default; the App sets its event
        # loop's ``call_soon`` so it runs right after the pick returns, off its latency.
        self.defer: Callable[..., object] = _call_now

    def _cost_params(self) -> CostParams:
        # Rebuilt only when discovery adds a link label.
        if self._params is None or self._links_version != len(self.pool.links):
            cfg = self.config
            links = cfg.links
            table = LinkTable.build(
                self.pool.links,
                same=links.same.cost(),
                default=links.default.cost(),
                pairs={p.between: p.cost() for p in links.pairs},
            )
            engine = cfg.engine
            self._params = CostParams(
                ttft_slo_s=cfg.slo.ttft_ms / 1000.0,
                tpot_slo_s=cfg.slo.tpot_ms / 1000.0,
                max_wait_skew_s=cfg.picker.max_wait_skew_ms / 1000.0,
                kv_soft_threshold=cfg.picker.kv_soft_threshold,
                allow_local_prefill=cfg.picker.allow_local_prefill,
                local_prefill_interference=cfg.picker.local_prefill_interference,
                weights=Weights(**cfg.weights.model_dump()),
                model=EngineModel(
                    prefill_tokens_per_s=engine.prefill_tokens_per_s,
                    decode_step_base_s=engine.decode_step_base_ms / 1000.0,
                    pd_leg_overhead_s=engine.pd_leg_overhead_ms / 1000.0,
                    decode_s_per_seq=engine.decode_ms_per_seq / 1000.0,
                    decode_s_per_kv_token=engine.decode_ms_per_1k_kv_tokens / 1e6,
                    kv_bytes_per_token=engine.kv_bytes_per_token,
                ),
                links=table,
            )
            self._links_version = len(self.pool.links)
        return self._params

    def candidates(self, slots: np.ndarray, cached_blocks: np.ndarray) -> Candidates:
        pool = self.pool
        return Candidates(
            slots=slots,
            running=pool.running[slots],
            waiting=pool.waiting[slots],
            kv_usage=pool.kv_usage[slots],
            kv_capacity_tokens=pool.kv_capacity_tokens[slots],
            queued_prefill_tokens=pool.queued_prefill_tokens[slots],
            reserved_kv_tokens=pool.reserved_kv_tokens[slots],
            inflight_requests=pool.inflight_requests[slots],
            link_index=pool.link_index[slots],
            decodes=pool.can_decode[slots],
            cached_blocks=cached_blocks,
        )

    def gather(self, request: RouteRequest, now: float | None) -> Candidates:
        """Every endpoint that may take this request (inside its subset hint), with its cached prefix."""
        pool = self.pool
        slots = pool.candidate_slots(now)
        if request.subset is not None:
            slots = np.intersect1d(slots, pool.slots_of(request.subset), assume_unique=True)
        cached = self.index.match(request.block_keys, slots)
        if self.precise is not None and request.precise_keys is not None:
            # Engines whose event stream is complete answer from what they reported; the others
            # (no events, or a purge being rebuilt) from where we sent earlier prompts.
            covered = pool.kv_covered[slots]
            if covered.any():
                cached = np.where(covered, self.precise.match(request.precise_keys, slots), cached)
        return self.candidates(slots, cached)

    def pick(self, request: RouteRequest, now: float | None = None) -> RouteDecision:
        """Choose and reserve; raises ``NoCapacity`` or ``Shed``. Never awaits."""
        pool = self.pool
        cand = self.gather(request, now)
        slots = cand.slots
        is_decode = pool.can_decode[slots]
        if not is_decode.any():
            raise NoCapacity("no admitted endpoint with fresh metrics can decode", retry_after_s=1.0)
        params = self._cost_params()
        ctx = RequestCtx(
            prompt_tokens=request.prompt_tokens,
            max_tokens=request.max_tokens,
            block_tokens=self.block_tokens,
            typical_prompt_tokens=pool.typical_prompt_tokens,
        )
        costs = pair_costs(cand, pool.can_prefill[slots], is_decode, ctx, params)
        # Jitter per row and per column (not per cell: cheap at any size) breaks exact ties only.
        rows, cols = costs.cost.shape
        jitter = self._rng.random(rows + cols) * _TIE_JITTER
        noisy = costs.cost * (1.0 + jitter[:rows, None] + jitter[None, rows:])
        row, col = divmod(int(np.argmin(noisy)), cols)
        if not np.isfinite(noisy[row, col]):
            raise NoCapacity("no decode endpoint has the KV capacity for this request", retry_after_s=1.0)
        ttft = float(costs.ttft_s[row, col])
        if request.priority < 0 and ttft > self.config.picker.shed_ttft_factor * params.ttft_slo_s:
            raise Shed(
                f"pool saturated: predicted TTFT {ttft:.2f}s for a sheddable request", retry_after_s=1.0
            )
        return self._decide(request, cand.slots, costs, noisy, row, col)

    def _decide(
        self,
        request: RouteRequest,
        slots: np.ndarray,
        costs: PairCosts,
        noisy: np.ndarray,
        row: int,
        col: int,
    ) -> RouteDecision:
        by_slot = self.pool.by_slot
        d_pos = int(costs.decode[col])
        p_pos = int(costs.prefill_of[row, col])
        d_slot = int(slots[d_pos])
        p_slot = None if p_pos < 0 else int(slots[p_pos])
        breakdown = costs.breakdown(row, col, request.prompt_tokens)
        reservation = self.pool.reserve(
            decode_slot=d_slot,
            prefill_slot=p_slot,
            prefill_tokens=breakdown["uncached_tokens"],
            kv_tokens=float(costs.kv_need[d_pos]),
        )
        self.pool.observe_prompt(request.prompt_tokens)
        # Optimistic: the prompt's blocks will be on P, and on D once transferred. Recording is
        # the dearest step of a pick, so an event loop runs it right after the pick returns.
        for slot in (d_slot,) if p_slot is None else (p_slot, d_slot):
            self.defer(self.index.record, slot, request.block_keys)
            # Events confirm (or evict) these later; until then a burst of one new prefix still
            # finds where the first of it went.
            if self.precise is not None and request.precise_keys is not None:
                self.defer(self.precise.record, slot, request.precise_keys)

        n = self.config.picker.fallbacks
        column_best = noisy.min(axis=0)
        decode_fallbacks = [
            by_slot[int(slots[costs.decode[c]])]
            for c in np.argsort(column_best, kind="stable")[: n + 1]
            if c != col and np.isfinite(column_best[c])
        ][:n]
        prefill_fallbacks = (
            [] if p_slot is None else [by_slot[int(slots[p])] for p in costs.prefill_order(col, p_pos)[:n]]
        )
        decode_ep = by_slot[d_slot]
        prefill_ep = None if p_slot is None else by_slot[p_slot]
        assert decode_ep is not None
        decision = RouteDecision(
            decode=decode_ep,
            prefill=prefill_ep,
            reservation=reservation,
            reason=_reason(decode_ep, prefill_ep, breakdown, request.prompt_tokens),
            breakdown=breakdown,
            prefill_fallbacks=prefill_fallbacks,  # type: ignore[arg-type]
            decode_fallbacks=decode_fallbacks,  # type: ignore[arg-type]
        )
        if log.isEnabledFor(logging.DEBUG):
            log.debug("pick %s: %s %s", request.request_id, decision.reason, breakdown)
        return decision

    def retarget(
        self, decision: RouteDecision, *, prefill: Endpoint | None = None, decode: Endpoint | None = None
    ) -> None:
        """Move a decision (and its reservation) to a fallback endpoint after a failure."""
        old = decision.reservation
        prefill_open = old.prefill_open
        old.release()
        decision.prefill = prefill or decision.prefill
        decision.decode = decode or decision.decode
        decision.reservation = self.pool.reserve(
            decode_slot=decision.decode.slot,
            prefill_slot=None if decision.prefill is None else decision.prefill.slot,
            prefill_tokens=old.prefill_tokens,
            kv_tokens=old.kv_tokens,
        )
        if not prefill_open:
            decision.reservation.finish_prefill()


def _call_now(fn: Callable[..., object], *args: object) -> None:
    fn(*args)


def _reason(decode: Endpoint, prefill: Endpoint | None, b: dict[str, float], prompt_tokens: int) -> str:
    cached = f"{b['cached_tokens']:.0f}/{prompt_tokens} prompt tokens cached"
    ttft = f"predicted TTFT {b['ttft_s'] * 1000:.1f} ms, TPOT {b['tpot_s'] * 1000:.1f} ms"
    if prefill is not None:
        return (
            f"pair {prefill.id} -> {decode.id}: {cached} on the prefill pod, "
            f"transfer {b['transfer_s'] * 1000:.1f} ms; {ttft}"
        )
    if decode.role == "prefill-decode":
        return f"single pod {decode.id}: {cached}; {ttft}"
    return f"no prefill leg on {decode.id}: {cached}, cheaper than any pair; {ttft}"
