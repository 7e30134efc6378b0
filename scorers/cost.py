"""The weighting: every scorer's term combined into one cost matrix over (route, decode pod).

Row 0 is "no prefill leg" (decode pod d computes the prompt itself). The other rows are prefill
link classes: for a pair (P, D)::

    ttft = w_queue * wait(P) + prefill(uncached on P) + stall(P) + w_link * transfer(link(P) -> D)
           + 2 * step(D) + step_base + leg overhead

and for the local row::

    ttft = w_queue * wait(D) + prefill(uncached on D) + stall(D)

``stall(X) = interference * prefill(X) * batch(X)``: a prefill on a pod that also decodes (role
``prefill-decode``, or D itself) stalls each of its running decodes for as long as it takes, and
those user-seconds count against the choice; prefill-only pods have no decodes to stall. With
continuous batching a request that reaches an engine mid-step waits about half a step before it
joins; a pair reaches D twice (the decode leg, then the arrived KV) and its first token needs one
more D step, hence ``2 * step(D)`` (predicted TPOT) where the local route pays it inside ``wait(D)``
and its own step. ``step_base`` is P's own engine step; the leg overhead the extra HTTP exchange
and the second tokenisation of the prompt.
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
    """The matrix and the per-candidate terms behind it.

    Per-candidate vectors have shape (k,) over *all* candidates; ``prefill``/``decode`` are the
    positions of the prefill-capable and decode-capable ones (a ``prefill-decode`` pod is in both).
    """

    cost: np.ndarray  # (1 + L, kd), +inf where infeasible
    ttft_s: np.ndarray  # (1 + L, kd)
    prefill_of: np.ndarray  # (1 + L, kd) candidate position of the pair's prefill pod; -1 = none
    prefill: np.ndarray  # (kp,) candidate positions
    decode: np.ndarray  # (kd,) candidate positions
    prefill_class: np.ndarray  # (kp,) row - 1 of each prefill pod's link class
    transfer_s: np.ndarray  # (L, kd)
    route_s: np.ndarray  # (k,) w_queue * wait + prefill + stall, with this pod doing the prefill
    wait_s: np.ndarray  # (k,)
    prefill_s: np.ndarray  # (k,)
    stall_s: np.ndarray  # (k,)
    uncached: np.ndarray  # (k,)
    tpot_s: np.ndarray  # (k,)
    kv_penalty: np.ndarray  # (k,)
    kv_need: np.ndarray  # (k,) new KV tokens the request would allocate there
    link_weight: float

    def breakdown(self, row: int, col: int, prompt_tokens: int) -> dict[str, float]:
        """The terms behind one cell, for debug headers, logs and the demo's "why"."""
        d = self.decode[col]
        p = d if row == 0 else self.prefill_of[row, col]
        return {
            "cost": float(self.cost[row, col]),
            "ttft_s": float(self.ttft_s[row, col]),
            "tpot_s": float(self.tpot_s[d]),
            "queue_wait_s": float(self.wait_s[p]),
            "prefill_s": float(self.prefill_s[p]),
            "transfer_s": 0.0 if row == 0 else float(self.transfer_s[row - 1, col]),
            "interference_s": float(self.stall_s[p]),
            "kv_penalty": float(self.kv_penalty[d]),
            "cached_tokens": float(prompt_tokens - self.uncached[p]),
            "uncached_tokens": float(self.uncached[p]),
        }

    def prefill_order(self, col: int, exclude: int) -> np.ndarray:
        """Candidate positions of prefill pods by pair cost with decode column ``col``, best first.

        ``exclude`` (a candidate position: the chosen prefill pod) and the decode pod itself are
        left out.
        """
        pair = self.route_s[self.prefill] + self.link_weight * self.transfer_s[self.prefill_class, col]
        pair[(self.prefill == exclude) | (self.prefill == self.decode[col])] = np.inf
        order = np.argsort(pair, kind="stable")
        return self.prefill[order[np.isfinite(pair[order])]]


def pair_costs(
    cand: Candidates, is_prefill: np.ndarray, is_decode: np.ndarray, ctx: RequestCtx, params: CostParams
) -> PairCosts:
    """Every term once over all k candidates, then the (1 + L, kd) matrix from slices of them."""
    w = params.weights
    model = params.model

    # What it costs for each pod to compute this prompt: queue, uncached prefill, and the stall it
    # inflicts on the pod's own running decodes (zero on prefill-only pods).
    cached = prefix.cached_tokens(cand, ctx)
    wait = queue.wait_s(cand, ctx, model)
    uncached = prefix.uncached_tokens(
        cached, ctx, prefix.fairness_trust(wait, w.prefix, params.max_wait_skew_s)
    )
    prefill_time = uncached / model.prefill_tokens_per_s
    batch = load.batch_size(cand)
    stall = params.local_prefill_interference * prefill_time * np.where(cand.decodes, batch, 0.0)
    route = w.queue * wait + prefill_time + stall

    # What it costs for each pod to decode it: TPOT with it added, KV headroom.
    used = kv_headroom.used_tokens(cand)
    need = kv_headroom.need_tokens(cached, ctx)
    tpot = load.tpot_s(model, used + need, batch)
    kv_pen = kv_headroom.penalty(cand, used, need, params.kv_soft_threshold)
    column_all = w.load * tpot / params.tpot_slo_s + w.kv * kv_pen
    column_all[~kv_headroom.fits(cand, need)] = np.inf

    decode = np.flatnonzero(is_decode)
    prefill = np.flatnonzero(is_prefill)
    kd = len(decode)
    column = column_all[decode]
    d_tpot = tpot[decode]

    # Row 0: the decode pod prefills itself.
    local_ttft = route[decode]
    if not params.allow_local_prefill and len(prefill):
        local_ttft = np.full(kd, np.inf)

    # Pairs, reduced to the prefill pods' link classes.
    p_route = route[prefill]
    after_transfer = 2.0 * d_tpot + (model.decode_step_base_s + model.pd_leg_overhead_s)
    classes, p_class, best, second = _best_two_per_class(p_route, cand.link_index[prefill])
    decode_bytes = link.transfer_bytes(cached[decode], ctx, model)
    transfer = link.transfer_s(params.links, classes, cand.link_index[decode], decode_bytes)
    # Where a class's cheapest prefill pod is the decode pod itself (a prefill-decode pod in both
    # sets), the pair uses the class's runner-up instead.
    same_pod = prefill[best][:, None] == decode[None, :]
    chosen = np.where(same_pod, second[:, None], best[:, None])
    with np.errstate(invalid="ignore"):
        pair_ttft = np.where(chosen >= 0, p_route[chosen] + w.link * transfer + after_transfer, np.inf)
    chosen = np.where(chosen >= 0, prefill[chosen], -1)

    ttft = np.empty((1 + len(classes), kd))
    ttft[0] = local_ttft
    ttft[1:] = pair_ttft
    prefill_of = np.full((1 + len(classes), kd), -1)
    prefill_of[1:] = chosen
    return PairCosts(
        cost=ttft / params.ttft_slo_s + column,
        ttft_s=ttft,
        prefill_of=prefill_of,
        prefill=prefill,
        decode=decode,
        prefill_class=p_class,
        transfer_s=transfer,
        route_s=route,
        wait_s=wait,
        prefill_s=prefill_time,
        stall_s=stall,
        uncached=uncached,
        tpot_s=tpot,
        kv_penalty=kv_pen,
        kv_need=need,
        link_weight=w.link,
    )


def _best_two_per_class(
    cost: np.ndarray, labels: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per distinct label: (labels, class of each item, cheapest item, runner-up item or -1)."""
    n = cost.size
    if n == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty, empty
    if n == 1 or labels.min() == labels.max():  # one link class: the common case, no sort needed
        first = labels[:1]
        if n == 1:
            return first, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), np.full(1, -1)
        two = np.argpartition(cost, 1)[:2]
        if cost[two[1]] < cost[two[0]]:
            two = two[::-1]
        return first, np.zeros(n, dtype=np.int64), two[:1], two[1:]
    order = np.lexsort((cost, labels))
    sorted_labels = labels[order]
    boundary = np.empty(n, dtype=bool)
    boundary[0] = True
    np.not_equal(sorted_labels[1:], sorted_labels[:-1], out=boundary[1:])
    starts = np.flatnonzero(boundary)
    classes = sorted_labels[starts]
    best = order[starts]
    ends = np.append(starts[1:], n)
    second = np.where(ends - starts > 1, order[np.minimum(starts + 1, n - 1)], -1)
    item_class = np.searchsorted(classes, labels)
    return classes, item_class, best, second
