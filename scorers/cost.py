"""The weighting: every scorer's term combined into one cost matrix over (route, decode pod).

Row 0 is "no prefill leg" (decode pod d computes the prompt itself). The other rows are prefill
link classes: for a pair (P, D)::

    ttft = w_queue * wait(P) + prefill(uncached on P) + stall(P) + w_link * transfer(link(P) -> D) + step(D)

and for the local row::

    ttft = w_queue * wait(D) + prefill(uncached on D) + stall(D)

``stall(X) = interference * prefill(X) * batch(X)``: a prefill on a pod that also decodes (role
``prefill-decode``, or D itself) stalls each of its running decodes for as long as it takes, and
those user-seconds count against the choice; prefill-only pods have no decodes to stall. A pair's
first token comes from D's next step after the KV arrived, hence ``step(D)`` (the predicted TPOT).
Then::

    cost = ttft / ttft_slo + w_load * tpot(D) / tpot_slo + w_kv * kv_penalty(D)

The P×D matrix is reduced *exactly*: a pair's cost is ``a[P] + T[link(P), D] + c[D]``, so for each
decode pod the best prefill pod of a link class is the class's cheapest ``a[P]`` (or its runner-up
when the cheapest is that same pod). One row per class instead of one per pod keeps 512 endpoints
at a (1 + classes) × 256 matrix. A decode pod the request could never fit on, and a pair without a
distinct prefill pod, cost +inf. One argmin compares "skip the prefill leg" with every pair.
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
    cost: np.ndarray  # (1 + L, kd), +inf where infeasible
    ttft_s: np.ndarray  # (1 + L, kd)
    prefill_of: np.ndarray  # (1 + L, kd) index into the prefill candidates; -1 = none
    tpot_s: np.ndarray  # (kd,)
    kv_penalty: np.ndarray  # (kd,)
    kv_need: np.ndarray  # (kd,) new KV tokens the request allocates on each decode pod
    local_wait_s: np.ndarray  # (kd,)
    local_prefill_s: np.ndarray  # (kd,)
    local_uncached: np.ndarray  # (kd,)
    interference_s: np.ndarray  # (kd,)
    prefill_cost_s: np.ndarray  # (kp,) w_queue * wait + prefill + stall
    prefill_stall_s: np.ndarray  # (kp,)
    prefill_wait_s: np.ndarray  # (kp,)
    prefill_s: np.ndarray  # (kp,)
    prefill_uncached: np.ndarray  # (kp,)
    prefill_class: np.ndarray  # (kp,) row - 1 of each prefill candidate's link class
    transfer_s: np.ndarray  # (L, kd)
    link_weight: float

    def breakdown(self, row: int, col: int, prompt_tokens: int) -> dict[str, float]:
        """The terms behind one cell, for debug headers, logs and the demo's "why"."""
        if row == 0:
            wait, prefill, uncached = (
                self.local_wait_s[col],
                self.local_prefill_s[col],
                self.local_uncached[col],
            )
            transfer, interference = 0.0, self.interference_s[col]
        else:
            p = self.prefill_of[row, col]
            wait, prefill, uncached = self.prefill_wait_s[p], self.prefill_s[p], self.prefill_uncached[p]
            transfer, interference = self.transfer_s[row - 1, col], self.prefill_stall_s[p]
        return {
            "cost": float(self.cost[row, col]),
            "ttft_s": float(self.ttft_s[row, col]),
            "tpot_s": float(self.tpot_s[col]),
            "queue_wait_s": float(wait),
            "prefill_s": float(prefill),
            "transfer_s": float(transfer),
            "interference_s": float(interference),
            "kv_penalty": float(self.kv_penalty[col]),
            "cached_tokens": float(prompt_tokens - uncached),
            "uncached_tokens": float(uncached),
        }

    def prefill_order(self, col: int, exclude: int) -> np.ndarray:
        """Prefill candidates ordered by pair cost with decode column ``col`` (``exclude`` left out)."""
        pair = (
            self.prefill_cost_s
            + self.link_weight * self.transfer_s[self.prefill_class, col]
            + self.tpot_s[col]
        )
        pair[exclude] = np.inf
        order = np.argsort(pair, kind="stable")
        return order[np.isfinite(pair[order])]


def pair_costs(prefill: Candidates, decode: Candidates, ctx: RequestCtx, params: CostParams) -> PairCosts:
    w = params.weights
    model = params.model
    kd = len(decode)

    # Decode-side terms, shape (kd,).
    used = kv_headroom.used_tokens(decode)
    need = kv_headroom.need_tokens(decode, ctx)
    batch = load.batch_size(decode)
    tpot = load.tpot_s(model, used + need, batch)
    kv_pen = kv_headroom.penalty(decode, used, need, params.kv_soft_threshold)
    column = w.load * tpot / params.tpot_slo_s + w.kv * kv_pen
    column[~kv_headroom.fits(decode, need)] = np.inf

    # Row 0: the decode pod prefills locally.
    local_wait = queue.wait_s(decode, ctx, model)
    local_uncached = prefix.uncached_tokens(
        decode, ctx, prefix.fairness_trust(local_wait, w.prefix, params.max_wait_skew_s)
    )
    local_prefill = local_uncached / model.prefill_tokens_per_s
    interference = params.local_prefill_interference * local_prefill * batch
    local_ttft = w.queue * local_wait + local_prefill + interference
    if not params.allow_local_prefill and len(prefill):
        local_ttft = np.full(kd, np.inf)

    # Prefill pods, reduced to their link classes.
    p_wait = queue.wait_s(prefill, ctx, model)
    p_uncached = prefix.uncached_tokens(
        prefill, ctx, prefix.fairness_trust(p_wait, w.prefix, params.max_wait_skew_s)
    )
    p_prefill = p_uncached / model.prefill_tokens_per_s
    p_stall = (
        params.local_prefill_interference
        * p_prefill
        * np.where(prefill.decodes, load.batch_size(prefill), 0.0)
    )
    p_cost = w.queue * p_wait + p_prefill + p_stall
    classes, p_class, best, second = _best_two_per_class(p_cost, prefill.link_index)
    transfer = link.transfer_s(params.links, classes, decode, ctx, model)
    # Where a class's cheapest prefill pod is the decode pod itself (a prefill-decode pod in both
    # sets), the pair uses the class's runner-up instead.
    same_pod = prefill.slots[best][:, None] == decode.slots[None, :]
    chosen = np.where(same_pod, second[:, None], best[:, None])
    with np.errstate(invalid="ignore"):
        pair_ttft = np.where(chosen >= 0, p_cost[chosen] + w.link * transfer + tpot, np.inf)

    ttft = np.vstack([local_ttft[None, :], pair_ttft])
    return PairCosts(
        cost=ttft / params.ttft_slo_s + column,
        ttft_s=ttft,
        prefill_of=np.vstack([np.full((1, kd), -1), chosen]),
        tpot_s=tpot,
        kv_penalty=kv_pen,
        kv_need=need,
        local_wait_s=local_wait,
        local_prefill_s=local_prefill,
        local_uncached=local_uncached,
        interference_s=interference,
        prefill_cost_s=p_cost,
        prefill_stall_s=p_stall,
        prefill_wait_s=p_wait,
        prefill_s=p_prefill,
        prefill_uncached=p_uncached,
        prefill_class=p_class,
        transfer_s=transfer,
        link_weight=w.link,
    )


def _best_two_per_class(
    cost: np.ndarray, labels: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per distinct label: (labels, class of each item, cheapest item, runner-up item or -1)."""
    if cost.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty, empty
    order = np.lexsort((cost, labels))
    sorted_labels = labels[order]
    boundary = np.empty(len(order), dtype=bool)
    boundary[0] = True
    np.not_equal(sorted_labels[1:], sorted_labels[:-1], out=boundary[1:])
    starts = np.flatnonzero(boundary)
    classes = sorted_labels[starts]
    best = order[starts]
    ends = np.append(starts[1:], len(order))
    second = np.where(ends - starts > 1, order[np.minimum(starts + 1, len(order) - 1)], -1)
    item_class = np.searchsorted(classes, labels)
    return classes, item_class, best, second
