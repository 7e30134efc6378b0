"""The cost model: every term combined into one cost matrix over (route, decode pod), in seconds.

Row 0 is "no prefill leg" (decode pod d computes the prompt itself). The other rows are prefill
link classes. With ``route(X)`` the weighted sum of the prefill-side terms on pod X (by default
``queue`` wait + ``prefill`` compute + ``interference`` stall + a prefill pod's own ``step``) and
``column(D)`` the weighted sum of
the decode-side terms on D (by default ``load`` and ``kv``), a pair (P, D) predicts::

    ttft = route(P) + w_link * transfer(link(P) -> D) + 2 * tpot(D) + step_base + leg overhead

and the local row ``ttft = route(D)``. With continuous batching a request that reaches an engine
mid-step waits about half a step before it joins; a pair reaches D twice (the decode leg, then the
arrived KV) and its first token needs one more D step, hence ``2 * tpot(D)`` where the local route
pays it inside its own wait and step. ``step_base`` is one more of D's (the KV lands while a step
runs and is computed from the step after it); the wait for P's step is P's ``step`` term, on a pod
that decodes only by role the ``interference`` term. The leg overhead is the extra HTTP exchange and
the second tokenisation of the prompt. With
``pair_waits_for_decode_queue`` a pair also waits for what is left of D's queued prompts when its
KV arrives (D's queue drains while P computes)::

    + max(0, wait(D) - (wait(P) + prefill(P)) - transfer)

(the class reduction below still takes each class's cheapest ``route(P)``: the best pair unless a
pod that computes sooner pays a larger stall term).

Then::

    cost = (ttft + column(D)) / ttft_slo

The P×D matrix is reduced *exactly*: a pair's cost is ``a[P] + T[link(P), D] + c[D]``, so for each
decode pod the best prefill pod of a link class is the class's cheapest ``a[P]`` (or its runner-up
when the cheapest is that same pod). One row per class instead of one per pod keeps 512 endpoints
at a (1 + classes) × 256 matrix. A decode pod the request could never fit on, and a pair without a
distinct prefill pod, cost +inf. One argmin compares "skip the prefill leg" with every pair.

``pair_costs`` is the runner of the cost terms and enforces their contract (``view.CostTerm``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from router.scheduling.costmodel import link, prefix
from router.scheduling.costmodel.link import LinkCosts, LinkTable
from router.scheduling.costmodel.terms import kv, load, queue
from router.scheduling.costmodel.view import Candidates, CostTerm, EngineModel, Objectives, RequestCtx, View

_ZEROS = np.float64(0.0)  # the empty sum; adding a (k,) array to it gives a new (k,) array
_INF = np.array([np.inf])
# The ufuncs' own reductions: ``array.sum()``/``.min()`` reach the same ones through a Python
# wrapper that costs as much as the reduction itself on a pick's small arrays.
_sum = np.add.reduce
_max = np.maximum.reduce


class TermContractError(RuntimeError):
    """A cost term broke its contract (wrong shape, NaN): a bug in that term, named here."""


@dataclass(frozen=True, slots=True)
class WeightedTerm:
    term: CostTerm
    weight: float


@dataclass(frozen=True, slots=True)
class CostModel:
    """Everything a pick's costs depend on besides the candidates and the request."""

    objectives: Objectives
    model: EngineModel
    links: LinkCosts
    terms: tuple[WeightedTerm, ...]
    link_weight: float = 1.0
    allow_local_prefill: bool = True
    prefill_may_decode: bool = False  # prefill pods may serve whole requests (kv_both)
    # A pair's decode leg joins D's queue when the KV arrives: price what is left of it then.
    pair_waits_for_decode_queue: bool = True
    prefill_side: frozenset[str] = field(init=False)  # names of the prefill-side terms

    def __post_init__(self) -> None:
        names = frozenset(w.term.name for w in self.terms if w.term.side != "decode")
        object.__setattr__(self, "prefill_side", names)


def derive(cand: Candidates, ctx: RequestCtx, cm: CostModel) -> View:
    """The quantities every term shares, computed once per pick."""
    o, model = cm.objectives, cm.model
    cached = prefix.cached_tokens(cand, ctx)
    slow = cand.slowness  # per engine, 1 = as the pool's model says
    wait = queue.wait_s(cand, ctx, model) * slow
    uncached = prefix.uncached_tokens(
        cached, ctx, prefix.fairness_trust(wait, o.prefix_trust, o.max_wait_skew_s)
    )
    batch = load.batch_size(cand)
    used = kv.used_tokens(cand)
    need = kv.need_tokens(cached, ctx)
    return View(
        cand=cand,
        ctx=ctx,
        model=model,
        objectives=o,
        cached=cached,
        wait_s=wait,
        uncached=uncached,
        prefill_s=uncached / model.prefill_tokens_per_s * slow,
        batch=batch,
        used_kv=used,
        need_kv=need,
        tpot_s=load.tpot_s(model, used + need, batch) * slow,
    )


class Prediction(NamedTuple):
    """What the cost model predicted for a chosen route, and the features it predicted from: what
    learning compares each answer with (``router/flow/flight.py``, ``router/signals/``). Seconds and
    tokens. (A named tuple: immutable, and made on every pick at a fraction of a frozen
    dataclass's cost.)"""

    ttft_s: float
    tpot_s: float  # the decode step stretched by the pod's prompts (``terms/load.py`` ``stretched``)
    uncached_tokens: float  # the prompt's tokens the computing pod must compute (reserved there)
    queued_tokens: float  # prefill work queued ahead of it on that pod, at the pick
    held_tokens: float  # the prompt's tokens the index said that pod held (before the trust cap)
    # Prompts were still being computed on that pod: a low cached count in its answer may be one
    # of them not done yet rather than an eviction (router/signals/calibration.py).
    prefilling_there: bool
    batch: float  # the decode pod's batch, this request included
    kv_tokens: float  # the decode pod's KV tokens in use, this request's included
    transfer_bytes: float  # a pair's KV bytes to the decode pod (0: no prefill leg)
    after_transfer_s: float  # a pair's decode leg after the transfer (0: no prefill leg)


@dataclass(slots=True)
class PairCosts:
    """The matrix and the per-candidate terms behind it.

    Per-candidate vectors have shape (k,) over *all* candidates; ``prefill``/``decode`` are the
    positions of the prefill-capable and decode-capable ones (a ``prefill-decode`` pod is in both).
    """

    view: View
    cost: np.ndarray  # (1 + L, kd), +inf where infeasible
    ttft_s: np.ndarray  # (1 + L, kd)
    prefill_of: np.ndarray  # (1 + L, kd) candidate position of the pair's prefill pod; -1 = none
    prefill: np.ndarray  # (kp,) candidate positions
    decode: np.ndarray  # (kd,) candidate positions
    is_prefill_mask: np.ndarray  # (k,) bool: may compute the prompt for a pair
    pairable: np.ndarray  # (kd,) bool: a pair may end on this column (``pair_costs``' pairs_into)
    prefill_class: np.ndarray  # (kp,) row - 1 of each prefill pod's link class
    class_of: np.ndarray  # (k,) the same by candidate position; -1 where not a prefill pod
    transfer_s: np.ndarray  # (L, kd)
    transfer_bytes: np.ndarray  # (kd,) KV bytes a pair sends to each decode pod
    after_transfer_s: np.ndarray  # (kd,) from the KV's arrival on D to the first token
    route_s: np.ndarray  # (k,) weighted prefill-side terms, with this pod doing the prefill
    column_s: np.ndarray  # (k,) weighted decode-side terms, with this pod decoding
    terms: dict[str, np.ndarray]  # name -> (k,) weighted seconds
    prefill_side: frozenset[str]  # names of the prefill-side terms
    link_weight: float
    ttft_slo_s: float
    decode_queue: bool = False  # pairs wait for what is left of D's queue (``CostModel``)

    @classmethod
    def of(
        cls,
        view: View,
        cm: CostModel,
        layout: Layout,
        *,
        cost: np.ndarray,
        ttft_s: np.ndarray,
        prefill_of: np.ndarray,
        transfer_s: np.ndarray,
        transfer_bytes: np.ndarray,
        after_transfer_s: np.ndarray,
        route_s: np.ndarray,
        column_s: np.ndarray,
        terms: dict[str, np.ndarray],
    ) -> PairCosts:
        """One pick's matrix and terms, with what its layout and cost model fix."""
        return cls(
            view=view,
            cost=cost,
            ttft_s=ttft_s,
            prefill_of=prefill_of,
            prefill=layout.prefill,
            decode=layout.decode,
            is_prefill_mask=layout.is_prefill,
            pairable=layout.pairable,
            prefill_class=layout.prefill_class,
            class_of=layout.class_of,
            transfer_s=transfer_s,
            transfer_bytes=transfer_bytes,
            after_transfer_s=after_transfer_s,
            route_s=route_s,
            column_s=column_s,
            terms=terms,
            prefill_side=cm.prefill_side,
            link_weight=cm.link_weight,
            ttft_slo_s=cm.objectives.ttft_slo_s,
            decode_queue=cm.pair_waits_for_decode_queue,
        )

    def ttft(self, prefill: int, col: int) -> float:
        """Predicted TTFT of prefill position ``prefill`` (-1: none) with decode column ``col``."""
        return self._ttft(prefill, col, self._transfer(prefill, col))

    def _ttft(self, prefill: int, col: int, transfer_s: float) -> float:
        if prefill < 0:
            return float(self.route_s[self.decode[col]])
        ttft = float(self.route_s[prefill]) + self.link_weight * transfer_s
        ttft += float(self.after_transfer_s[col])
        if self.decode_queue:
            view = self.view
            computed = float(view.wait_s[prefill] + view.prefill_s[prefill]) + transfer_s
            ttft += max(0.0, float(view.wait_s[self.decode[col]]) - computed)
        return ttft

    def _transfer(self, prefill: int, col: int) -> float:
        if prefill < 0:
            return 0.0
        return float(self.transfer_s[self.class_of[prefill], col])

    def prediction(self, prefill: int, col: int) -> Prediction:
        """What is predicted for prefill position ``prefill`` (-1: none) with decode column ``col``."""
        d = int(self.decode[col])
        p = d if prefill < 0 else prefill
        view = self.view
        cand = view.cand
        pair = prefill >= 0
        slowness_d = cand.value("slowness", d)
        share = load.share_of_time(cand.value("prefill_rate", d), slowness_d, view.model.prefill_tokens_per_s)
        return Prediction(
            ttft_s=self._ttft(prefill, col, self._transfer(prefill, col)),
            tpot_s=float(load.stretched(float(view.tpot_s[d]), share)),
            uncached_tokens=float(view.uncached[p]),
            # What the performance model learns against (``router/signals/perf.py``).
            queued_tokens=float(view.wait_s[p]) / cand.value("slowness", p) * view.model.prefill_tokens_per_s,
            held_tokens=float(view.cached[p]),  # cached there, before the trust cap
            # NaN > 0 is False: an unknown waiting count is no evidence of prefill in progress.
            prefilling_there=cand.value("queued_prefill_tokens", p) > 0 or cand.value("waiting", p) > 0,
            batch=float(view.batch[d]) + 1.0,
            kv_tokens=float(view.used_kv[d]) + float(view.need_kv[d]),
            # What a pair's decode leg adds to the transfer: learning links reads both.
            transfer_bytes=float(self.transfer_bytes[col]) if pair else 0.0,
            after_transfer_s=float(self.after_transfer_s[col]) if pair else 0.0,
        )

    def breakdown(self, prefill: int, col: int, prediction: Prediction | None = None) -> dict[str, float]:
        """The terms behind one choice, for debug headers, traces, logs and the demo's "why": the
        ``prediction`` (made here when not given) and every term's seconds."""
        made = self.prediction(prefill, col) if prediction is None else prediction
        d = int(self.decode[col])
        p = d if prefill < 0 else prefill
        out = made._asdict()
        out["prefilling_there"] = float(made.prefilling_there)
        out["cost"] = (made.ttft_s + float(self.column_s[d])) / self.ttft_slo_s
        out["transfer_s"] = self._transfer(prefill, col)
        out["cached_tokens"] = self.view.ctx.prompt_tokens - made.uncached_tokens
        out["slowness_p"] = float(self.view.cand.slowness[p])
        out["slowness_d"] = float(self.view.cand.slowness[d])
        prefill_side = self.prefill_side
        for name, values in self.terms.items():
            out[name + "_s"] = float(values[p if name in prefill_side else d])
        return out

    def is_prefill(self, position: int) -> bool:
        """Whether candidate ``position`` may compute the prompt for a pair in this matrix."""
        return 0 <= position < len(self.is_prefill_mask) and bool(self.is_prefill_mask[position])

    def prefill_order(self, col: int, exclude: int, limit: int | None = None) -> np.ndarray:
        """Candidate positions of prefill pods by pair cost with decode column ``col``, best first
        (the first ``limit``; None: all).

        ``exclude`` (a candidate position: the chosen prefill pod) and the decode pod itself are
        left out.
        """
        pair = self.route_s[self.prefill] + self.link_weight * self.transfer_s[self.prefill_class, col]
        pair[(self.prefill == exclude) | (self.prefill == self.decode[col])] = np.inf
        return self.prefill[smallest(pair, len(pair) if limit is None else limit)]


@dataclass(frozen=True, slots=True)
class Layout:
    """The parts of a pick's matrix that depend only on who the candidates are (roles, link
    labels, sidecars) and on the link table, not on their load or the prompt: built once and
    reused while the candidate set stays the same (``Picker`` keys it on those arrays)."""

    is_prefill: np.ndarray  # (k,) bool: may compute the prompt for a pair
    prefill: np.ndarray  # (kp,) candidate positions that may compute a pair's prompt
    decode: np.ndarray  # (kd,) candidate positions that may decode
    no_pairs: np.ndarray  # (kd,) bool: a column only ever computes its prompt itself
    pairable: np.ndarray  # (kd,) ~no_pairs
    classes: np.ndarray  # (L,) link labels of the prefill pods
    prefill_class: np.ndarray  # (kp,) row - 1 of each prefill pod's class
    class_of: np.ndarray  # (k,) the same by candidate position; -1 where not a prefill pod
    members: ClassMembers | None  # the prefill pods of each class; None with one class
    latency_s: np.ndarray  # (L, kd) from each class to each decode pod
    bytes_per_s: np.ndarray  # (L, kd)

    @classmethod
    def of(
        cls,
        cand: Candidates,
        is_prefill: np.ndarray,
        is_decode: np.ndarray,
        links: LinkTable,
        pairs_into: np.ndarray | None = None,
    ) -> Layout:
        decode = np.flatnonzero(is_decode)
        prefill = np.flatnonzero(is_prefill)
        no_pairs = ~cand.can_decode[decode]
        if pairs_into is not None:
            no_pairs |= ~pairs_into[decode]
        labels = cand.link_index[prefill]
        classes, prefill_class = np.unique(labels, return_inverse=True)
        members = class_members(prefill_class) if len(classes) > 1 else None
        d_links = cand.link_index[decode]
        class_of = np.full(len(cand), -1)
        class_of[prefill] = prefill_class
        return cls(
            is_prefill=is_prefill,
            prefill=prefill,
            decode=decode,
            no_pairs=no_pairs,
            pairable=~no_pairs,
            classes=classes,
            prefill_class=prefill_class.astype(np.int64),
            class_of=class_of,
            members=members,
            # Row-major, as the compiled loops take them (fancy indexing leaves these column-major).
            latency_s=np.ascontiguousarray(links.latency_s[classes][:, d_links]),
            bytes_per_s=np.ascontiguousarray(links.bytes_per_s[classes][:, d_links]),
        )


def pair_costs(
    view: View,
    is_prefill: np.ndarray,
    is_decode: np.ndarray,
    cm: CostModel,
    links: LinkTable,
    pairs_into: np.ndarray | None = None,
) -> PairCosts:
    """Every term once over all k candidates, then the (1 + L, kd) matrix from slices of them.

    ``links``: ``cm.links`` laid over the pool's link labels (rebuilt only when labels change).
    ``pairs_into``: (k,) bool, the decode pods a pair may end on (behind a gateway, those a P/D
    sidecar fronts); the others only compute their prompts themselves. None: every decode pod."""
    return costs_over(view, cm, Layout.of(view.cand, is_prefill, is_decode, links, pairs_into))


def costs_over(view: View, cm: CostModel, layout: Layout) -> PairCosts:
    """``pair_costs`` with its layout kept from an earlier pick over the same candidates."""
    cand, ctx, model = view.cand, view.ctx, cm.model
    k = len(cand)
    route = column = both = _ZEROS
    values: dict[str, np.ndarray] = {}
    for weighted in cm.terms:
        term = weighted.term
        seconds = term.seconds(view)
        if not isinstance(seconds, np.ndarray) or seconds.shape != (k,):
            raise TermContractError(
                f"cost term {term.name!r} must return {k} seconds, got "
                f"{getattr(seconds, 'shape', type(seconds).__name__)}"
            )
        # inf * 0 is NaN: a zero-weighted term still filters where it says +inf.
        if weighted.weight != 1.0:
            with np.errstate(invalid="ignore"):
                seconds = np.where(np.isinf(seconds), seconds, seconds * weighted.weight)
        values[term.name] = seconds
        # New arrays, never in place: a term may return a View array as it is.
        if term.side == "decode":
            column = column + seconds
        else:
            route = route + seconds
            if term.side == "both":  # a pair's decode pod pays it too (``view.CostTerm``)
                both = both + seconds
    # NaN survives addition (and terms never return -inf), so one sum covers every term and
    # every candidate; only a failure looks for the culprit.
    if math.isnan(_sum(route) + _sum(column)):
        culprit = next(name for name, v in values.items() if np.isnan(v).any())
        raise TermContractError(f"cost term {culprit!r} returned NaN")

    decode, prefill, no_pairs = layout.decode, layout.prefill, layout.no_pairs
    kd = len(decode)
    d_tpot = view.tpot_s[decode]

    # Row 0: the decode pod prefills itself. A prefill pod in a decode column (role-flexible
    # P/D) only ever serves the whole request itself: its column has no pairs; nor has a decode
    # pod nothing would run a pair's prefill leg for. Such a column keeps its local route even
    # without allow_local_prefill: it is the only thing that can happen there.
    local_ttft = route[decode]
    if not cm.allow_local_prefill and len(prefill):
        local_ttft = np.where(no_pairs, local_ttft, np.inf)

    # Pairs, reduced to the prefill pods' link classes.
    p_route = route[prefill]
    after_transfer = 2.0 * d_tpot + (model.decode_step_base_s + model.pd_leg_overhead_s)
    if both is not _ZEROS:
        after_transfer = after_transfer + both[decode]
    best, second = best_two_per_class(p_route, layout.members)
    decode_bytes = link.transfer_bytes(view.cached[decode], ctx, model)
    transfer = link.seconds(layout.latency_s, layout.bytes_per_s, decode_bytes)
    # Where a class's cheapest prefill pod is the decode pod itself (a prefill-decode pod in both
    # sets), the pair uses the class's runner-up instead.
    same_pod = prefill[best][:, None] == decode[None, :]
    chosen = np.where(same_pod, second[:, None], best[:, None])
    pair_ttft = p_route[chosen] + cm.link_weight * transfer + after_transfer
    if cm.pair_waits_for_decode_queue:
        computed = (view.wait_s + view.prefill_s)[prefill][chosen] + transfer
        pair_ttft += np.maximum(0.0, view.wait_s[decode][None, :] - computed)
    pair_ttft = np.where((chosen >= 0) & layout.pairable, pair_ttft, np.inf)
    chosen = np.where(chosen >= 0, prefill[chosen], -1)

    rows = 1 + len(layout.classes)
    ttft = np.empty((rows, kd))
    ttft[0] = local_ttft
    ttft[1:] = pair_ttft
    prefill_of = np.full((rows, kd), -1)
    prefill_of[1:] = chosen
    return PairCosts.of(
        view,
        cm,
        layout,
        cost=(ttft + column[decode]) / cm.objectives.ttft_slo_s,
        ttft_s=ttft,
        prefill_of=prefill_of,
        transfer_s=transfer,
        transfer_bytes=decode_bytes,
        after_transfer_s=after_transfer,
        route_s=route,
        column_s=column,
        terms=values,
    )


@dataclass(frozen=True, slots=True)
class ClassMembers:
    """Each class's items as a row, ascending, for ``best_two_per_class``."""

    index: np.ndarray  # (classes, m) item positions, padded with the item count (an extra +inf)
    flat: np.ndarray  # (classes * m,) the same positions, padded with -1 (no such item)
    starts: np.ndarray  # (classes,) where each row starts in ``flat``


def class_members(item_class: np.ndarray) -> ClassMembers:
    """The rows of ``item_class`` (each item's class, 0..classes-1)."""
    n = len(item_class)
    width = max(int(np.bincount(item_class).max()), 2)  # a runner-up column even if none
    index = np.full((int(item_class.max()) + 1, width), n)
    for row in range(len(index)):
        at = np.flatnonzero(item_class == row)
        index[row, : len(at)] = at
    flat = np.where(index == n, -1, index).ravel()
    return ClassMembers(index, flat, np.arange(0, flat.size, width))


def smallest(values: np.ndarray, limit: int) -> np.ndarray:
    """Positions of the ``limit`` smallest finite ``values``, ascending, ties to the lower position
    (a stable argsort's first finite entries). Overwrites ``values``."""
    if limit >= 8:  # beyond a few, one sort beats repeated scans
        order = np.argsort(values, kind="stable")
        return order[np.isfinite(values[order])][:limit]
    # Fallbacks want two or three: as many argmin scans cost far less than a sort.
    found: list[int] = []
    for _ in range(min(limit, len(values))):
        at = int(values.argmin())  # the first of equal minima, or the first NaN if any
        if not math.isfinite(values[at]):
            if math.isnan(values[at]):  # only the first scan can meet one (nothing changed yet)
                return smallest(np.where(np.isnan(values), np.inf, values), limit)
            break
        found.append(at)
        values[at] = np.inf
    return np.array(found, dtype=np.int64)


def best_two_per_class(cost: np.ndarray, members: ClassMembers | None) -> tuple[np.ndarray, np.ndarray]:
    """Per class (``class_members``; None: one class): the cheapest item and the runner-up (-1 if
    none), ties to the lower position."""
    n = cost.size
    if n == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    if members is None:  # one link class: the common case, no sort needed
        if n == 1:
            return np.zeros(1, dtype=np.int64), np.full(1, -1)
        # Two argmins, not np.argpartition: its order among equal costs depends on the CPU (a
        # SIMD selection where AVX-512 is there), and idle pods tie exactly.
        first = int(cost.argmin())
        rest = cost.copy()
        rest[first] = np.inf
        second = int(rest.argmin())
        if second == first:  # every other item is +inf too: the lowest other position
            second = 0 if first else 1
        return np.array([first]), np.array([second])
    # Each class's row of costs, +inf past its members. argmin takes the first of equal minima,
    # as a stable sort does; two of them cost far less than sorting the rows.
    padded = np.concatenate((cost, _INF))[members.index]
    flat = padded.ravel()
    first = padded.argmin(axis=1) + members.starts
    flat[first] = np.inf
    second = padded.argmin(axis=1) + members.starts
    if math.isinf(_max(flat[second])):
        # Some class has no finite runner-up: a sort tells a real +inf member from the padding.
        order = np.argsort(np.concatenate((cost, _INF))[members.index], axis=1, kind="stable")
        first, second = order[:, 0] + members.starts, order[:, 1] + members.starts
    return members.flat[first], members.flat[second]
