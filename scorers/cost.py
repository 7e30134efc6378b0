"""The weighting: every scorer's term combined into one (1 + kp, kd) cost matrix, in SLO units.

Row 0 is "no prefill leg" (decode pod d computes the prompt itself); row 1 + i is the pair
(prefill i, decode d). For a pair::

    ttft = w_queue * wait(P) + prefill(uncached on P) + w_link * transfer(P -> D)

and for the local row::

    ttft = w_queue * wait(D) + prefill(uncached on D) + interference * prefill(D) * batch(D)

(a prefill on a decode pod stalls each of its running decodes for as long as it takes, and those
user-seconds count against this choice). Then::

    cost = ttft / ttft_slo + w_load * tpot(D) / tpot_slo + w_kv * kv_penalty(D)

A decode pod the request would not fit on, and a pair that names one pod twice, cost +inf.
Minimising this compares "skip the prefill leg" with every pair in one argmin, instead of fixed
thresholds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scorers import kv_headroom, link, load, prefix, queue
from scorers.base import Candidates, EngineModel, RequestCtx
from scorers.link import LinkTable


@dataclass(frozen=True, slots=True)
class Weights:
    prefix: float = 1.0
    queue: float = 1.0
    kv: float = 1.0
    link: float = 1.0
    load: float = 1.0


@dataclass(frozen=True, slots=True)
class CostParams:
    ttft_slo_s: float
    tpot_slo_s: float
    max_wait_skew_s: float
    kv_soft_threshold: float
    allow_local_prefill: bool
    local_prefill_interference: float
    weights: Weights
    model: EngineModel
    links: LinkTable


@dataclass(slots=True)
class PairCosts:
    cost: np.ndarray  # (1 + kp, kd), +inf where infeasible
    ttft_s: np.ndarray  # (1 + kp, kd)
    tpot_s: np.ndarray  # (kd,)
    wait_s: np.ndarray  # (1 + kp, 1): row 0 placeholder, see local_wait_s
    local_wait_s: np.ndarray  # (kd,)
    prefill_s: np.ndarray  # (1 + kp, 1)
    local_prefill_s: np.ndarray  # (kd,)
    interference_s: np.ndarray  # (kd,)
    transfer_s: np.ndarray  # (1 + kp, kd), row 0 zero
    kv_penalty: np.ndarray  # (kd,)
    cached_tokens: np.ndarray  # (1 + kp, kd): tokens credited to the prompt's computation
    uncached_tokens: np.ndarray  # (1 + kp, kd)

    def breakdown(self, row: int, col: int) -> dict[str, float]:
        """The terms behind one cell, for debug headers, logs and the demo's "why"."""
        local = row == 0
        return {
            "cost": float(self.cost[row, col]),
            "ttft_s": float(self.ttft_s[row, col]),
            "tpot_s": float(self.tpot_s[col]),
            "queue_wait_s": float(self.local_wait_s[col] if local else self.wait_s[row, 0]),
            "prefill_s": float(self.local_prefill_s[col] if local else self.prefill_s[row, 0]),
            "transfer_s": float(self.transfer_s[row, col]),
            "interference_s": float(self.interference_s[col]) if local else 0.0,
            "kv_penalty": float(self.kv_penalty[col]),
            "cached_tokens": float(self.cached_tokens[row, col]),
            "uncached_tokens": float(self.uncached_tokens[row, col]),
        }


def pair_costs(prefill: Candidates, decode: Candidates, ctx: RequestCtx, params: CostParams) -> PairCosts:
    w = params.weights
    model = params.model
    kd = len(decode)

    # Decode-side terms, shape (kd,).
    tpot = load.tpot_s(decode, ctx, model)
    kv_pen = kv_headroom.penalty(decode, ctx, params.kv_soft_threshold)
    blocked = ~kv_headroom.fits(decode, ctx)
    column = w.load * tpot / params.tpot_slo_s + w.kv * kv_pen
    column[blocked] = np.inf

    # Local prefill (row 0).
    local_wait = queue.wait_s(decode, ctx, model)
    local_trust = prefix.fairness_trust(local_wait, w.prefix, params.max_wait_skew_s)
    local_uncached = prefix.uncached_tokens(decode, ctx, local_trust)
    local_prefill = local_uncached / model.prefill_tokens_per_s
    interference = params.local_prefill_interference * local_prefill * load.batch_size(decode)
    local_ttft = w.queue * local_wait + local_prefill + interference
    if not params.allow_local_prefill and len(prefill):
        local_ttft = np.full(kd, np.inf)

    # Pairs (rows 1..kp).
    p_wait = queue.wait_s(prefill, ctx, model)
    p_trust = prefix.fairness_trust(p_wait, w.prefix, params.max_wait_skew_s)
    p_uncached = prefix.uncached_tokens(prefill, ctx, p_trust)
    p_prefill = p_uncached / model.prefill_tokens_per_s
    transfer = link.transfer_s(params.links, prefill, decode, ctx, model)
    pair_ttft = (w.queue * p_wait + p_prefill)[:, None] + w.link * transfer
    pair_ttft[prefill.slots[:, None] == decode.slots[None, :]] = np.inf

    ttft = np.vstack([local_ttft[None, :], pair_ttft])
    cost = ttft / params.ttft_slo_s + column[None, :]
    uncached = np.vstack([local_uncached[None, :], np.broadcast_to(p_uncached[:, None], pair_ttft.shape)])
    return PairCosts(
        cost=cost,
        ttft_s=ttft,
        tpot_s=tpot,
        wait_s=np.concatenate([[0.0], p_wait])[:, None],
        local_wait_s=local_wait,
        prefill_s=np.concatenate([[0.0], p_prefill])[:, None],
        local_prefill_s=local_prefill,
        interference_s=interference,
        transfer_s=np.vstack([np.zeros((1, kd)), transfer]),
        kv_penalty=kv_pen,
        cached_tokens=ctx.prompt_tokens - uncached,
        uncached_tokens=uncached,
    )
