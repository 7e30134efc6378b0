"""Pair pickers: how the (prefill, decode) choice is made from one pick's ``PairCosts``.

``JointArgmin`` is pd-router's: one argmin over the whole cost matrix, so "skip the prefill leg"
and every pair compete in one unit. The others are the baselines the benchmarks compare against
(and that an operator may select with ``picker.policy``). They choose the prefill pod and the
decode pod each by its own key, separately: that is what makes them baselines.

* ``RoundRobin`` — decode pods (and prefill pods) in turn.
* ``LeastLoaded`` — fewest running+waiting on decode, fewest queued tokens on prefill.
* ``IndependentChoice`` — best prefill pod alone (queue wait + uncached prefill) and best decode
  pod alone (decode-side terms), no link term: pd-router's own prices, chosen one leg at a time.
* ``CacheAware`` — the SGLang and vLLM routers' default (``cache_aware``): the pod holding the
  longest prefix when it covers enough of the prompt, the least loaded otherwise or when the pool
  is imbalanced.
* ``WeightedScore`` — the llm-d router's default scoring profile: prefix match 3, queue 2, free KV
  2, highest total wins.

Baselines pair only dedicated prefill pods (they never split a request across two
``prefill-decode`` pods: that is a pd-router-only move) and always pair when such pods exist and
the decode pod can take a pair (``PairCosts.pairable``).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import numpy as np

from router.scheduling.costmodel import compiled as compiled_costs
from router.scheduling.costmodel.matrix import PairCosts, smallest
from router.scheduling.costmodel.terms import queue
from router.scheduling.costmodel.view import fill_unknown

# Relative jitter that only breaks exact ties (an idle pool) without reordering real differences.
_TIE_JITTER = 1e-9
# Tie-break scale for least-loaded: far below one request or one token of difference.
_TIE = 1e-6
_NONE = np.empty(0, dtype=np.int64)


class PairChoice(NamedTuple):
    """A choice over one ``PairCosts``: ``prefill`` is a candidate position (-1: no prefill leg),
    ``decode`` a column of the matrix (``costs.decode[decode]`` is the candidate position).
    Fallbacks, best first, in the same units, without the chosen ones. (A named tuple: immutable,
    and made on every pick at a fraction of a frozen dataclass's cost.)"""

    prefill: int
    decode: int
    prefill_fallbacks: np.ndarray
    decode_fallbacks: np.ndarray


class PairPicker(Protocol):
    """Chooses the route for one request from its cost matrix.

    Contract, checked by ``router.scheduling.picker.Picker``: returns ``None`` when no route is feasible
    (the runner answers 503), else a ``PairChoice`` whose ``decode`` is a column of ``costs``,
    whose ``prefill`` is -1 or one of ``costs.prefill`` other than the decode pod (always -1 on a
    column that is not ``costs.pairable``), and with at most ``fallbacks`` entries per fallback
    list. Never reserves, never awaits; may keep its own state (a round-robin pointer) because one
    picker serves one pool.
    """

    name: str

    def choose(self, costs: PairCosts, fallbacks: int) -> PairChoice | None: ...


class Draws:
    """``rng.random(n)`` call after call, the same numbers, drawn thousands at a time: a
    Generator call costs more than the dozens of numbers a pick takes."""

    def __init__(self, rng: np.random.Generator, batch: int = 4096) -> None:
        self._rng = rng
        self._batch = batch
        self._buffer = np.empty(0)
        self._at = 0

    def take(self, n: int) -> np.ndarray:
        at = self._at
        if at + n > len(self._buffer):
            # The unread rest first: the stream continues exactly where it was.
            fresh = self._rng.random(max(self._batch, n))
            self._buffer = np.concatenate((self._buffer[at:], fresh))
            at = 0
        self._at = at + n
        return self._buffer[at : at + n]


class JointArgmin:
    """The joint P×D choice: one argmin over the matrix; exact ties broken at random."""

    name = "joint"

    def __init__(self, seed: int | None = None, *, compiled: bool = True) -> None:
        """``compiled``: choose in ``compiled.joint_choice`` when numba is installed (the same
        choice, a fraction of the calls)."""
        self._draws = Draws(np.random.default_rng(seed))
        self._compiled = compiled and compiled_costs.installed()

    def choose(self, costs: PairCosts, fallbacks: int) -> PairChoice | None:
        rows, cols = costs.cost.shape
        if cols == 0:
            return None
        if self._compiled:
            prefill, col, prefill_fallbacks, decode_fallbacks = compiled_costs.joint_choice(
                costs.cost,
                self._draws.take(rows + cols),
                _TIE_JITTER,
                costs.prefill_of,
                costs.route_s,
                costs.prefill,
                costs.prefill_class,
                costs.transfer_s,
                costs.decode,
                costs.link_weight,
                fallbacks,
            )
            return None if col < 0 else PairChoice(prefill, col, prefill_fallbacks, decode_fallbacks)
        # Jitter per row and per column (not per cell: cheap at any size) breaks exact ties only.
        jitter = self._draws.take(rows + cols) * _TIE_JITTER
        noisy = costs.cost * (1.0 + jitter[:rows, None] + jitter[None, rows:])
        row, col = divmod(int(noisy.argmin()), cols)
        if not math.isfinite(noisy[row, col]):
            return None
        prefill = int(costs.prefill_of[row, col])
        if fallbacks == 0:
            return PairChoice(prefill, col, _NONE, _NONE)
        column_best = np.minimum.reduce(noisy, axis=0)  # .min(axis=0) without its Python wrapper
        column_best[col] = np.inf
        decode_fallbacks = smallest(column_best, fallbacks)
        prefill_fallbacks = _NONE if prefill < 0 else costs.prefill_order(col, prefill, fallbacks)
        return PairChoice(prefill, col, prefill_fallbacks, decode_fallbacks)


class _Separable:
    """A baseline: a key per dedicated prefill pod and a key per decode pod, lower is better."""

    name = "baseline"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = np.random.default_rng(seed)

    def choose(self, costs: PairCosts, fallbacks: int) -> PairChoice | None:
        cand = costs.view.cand
        prefill = costs.prefill[~cand.can_decode[costs.prefill]]
        pairs = costs.pairable & (prefill.size > 0)
        d_key = self.decode_key(costs, pairs)
        d_order = np.argsort(d_key, kind="stable")
        d_order = d_order[np.isfinite(d_key[d_order])]
        if d_order.size == 0:
            return None
        p_order = _NONE
        if prefill.size and pairs[d_order[0]]:
            p_order = prefill[np.argsort(self.prefill_key(costs, prefill), kind="stable")]
        self.advance()
        chosen_p = int(p_order[0]) if p_order.size else -1
        return PairChoice(chosen_p, int(d_order[0]), p_order[1 : fallbacks + 1], d_order[1 : fallbacks + 1])

    def prefill_key(self, costs: PairCosts, prefill: np.ndarray) -> np.ndarray:
        """One value per position in ``prefill`` (dedicated prefill pods)."""
        raise NotImplementedError

    def decode_key(self, costs: PairCosts, pairs: np.ndarray) -> np.ndarray:
        """One value per column (``costs.decode``); +inf = not a candidate. ``pairs``, per column:
        a prefill pod will compute the prompt."""
        raise NotImplementedError

    def advance(self) -> None:
        """Called once per successful choice (round-robin moves its pointers)."""


class RoundRobin(_Separable):
    """Decode pods in turn, and prefill pods in turn."""

    name = "round-robin"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self._next_decode = 0
        self._next_prefill = 0

    @staticmethod
    def _rank(n: int, start: int) -> np.ndarray:
        # Distance from the pointer: 0 for the pod whose turn it is, then the next ones (fallbacks).
        return ((np.arange(n) - start) % n).astype(np.float64)

    def prefill_key(self, costs: PairCosts, prefill: np.ndarray) -> np.ndarray:
        return self._rank(len(prefill), self._next_prefill % len(prefill))

    def decode_key(self, costs: PairCosts, pairs: np.ndarray) -> np.ndarray:
        n = len(costs.decode)
        return self._rank(n, self._next_decode % n)

    def advance(self) -> None:
        self._next_decode += 1
        self._next_prefill += 1


class LeastLoaded(_Separable):
    """Fewest requests on decode (scraped running+waiting or our in-flight); fewest queued prefill tokens."""

    name = "least-loaded"

    def prefill_key(self, costs: PairCosts, prefill: np.ndarray) -> np.ndarray:
        # The queue term's notion of queued tokens: ours, or scraped waiting × typical prompt.
        tokens = queue.queued_tokens(costs.view.cand, costs.view.ctx)[prefill]
        return tokens + _TIE * self._rng.random(len(prefill))

    def decode_key(self, costs: PairCosts, pairs: np.ndarray) -> np.ndarray:
        cand = costs.view.cand
        scraped = fill_unknown(cand.running, worst=0.0) + fill_unknown(cand.waiting, worst=0.0)
        requests = np.maximum(scraped, cand.inflight_requests)[costs.decode]
        return requests + _TIE * self._rng.random(len(costs.decode))


class IndependentChoice(_Separable):
    """Best prefill pod alone and best decode pod alone, no link term: pd-router's prices, leg by leg.

    Prefill: pd-router's prefill-side terms (queue wait + uncached prefill, locality and fairness
    cap included). Decode: pd-router's decode-side terms (+inf where the request would not fit);
    on a pool without dedicated prefill pods the pod also prefills, so its prefill-side terms count.
    """

    name = "independent"

    def prefill_key(self, costs: PairCosts, prefill: np.ndarray) -> np.ndarray:
        return costs.route_s[prefill]

    def decode_key(self, costs: PairCosts, pairs: np.ndarray) -> np.ndarray:
        key = costs.column_s[costs.decode]
        return np.where(pairs, key, key + costs.route_s[costs.decode])


def _prefix_share(costs: PairCosts) -> np.ndarray:
    """Per candidate: the share of the prompt its cached prefix covers (the index's guess)."""
    return costs.view.cached / max(costs.view.ctx.prompt_tokens, 1)


class CacheAware(_Separable):
    """The SGLang and vLLM routers' default policy (``cache_aware``), on this router's index and
    in-flight counts. The pool is *imbalanced* when the busiest pod has more than
    ``BALANCE_ABS`` requests over the idlest and more than ``BALANCE_REL`` times as many: then the
    least loaded pod. Otherwise the pod whose cached prefix covers the largest share of the prompt
    when that share is above ``CACHE_THRESHOLD``, else the least loaded (where the older routers
    took the pod with the smallest prefix tree). Load is requests in flight through the router, as
    theirs counts. Prefill and decode are chosen alike and apart (their P/D mode runs one policy
    per role); the decode leg of a pair has no prompt to match, so it is the least loaded."""

    name = "cache-aware"
    # The routers' command-line defaults (their library structs ship others: 0.5, 32, 1.1).
    CACHE_THRESHOLD = 0.3
    BALANCE_ABS = 64
    BALANCE_REL = 1.5

    def prefill_key(self, costs: PairCosts, prefill: np.ndarray) -> np.ndarray:
        return self._key(costs, prefill)

    def decode_key(self, costs: PairCosts, pairs: np.ndarray) -> np.ndarray:
        decode = costs.decode
        local = self._key(costs, decode)
        load = costs.view.cand.inflight_requests[decode].astype(np.float64)
        return np.where(pairs, load + _TIE * self._rng.random(len(decode)), local)

    def _key(self, costs: PairCosts, positions: np.ndarray) -> np.ndarray:
        load = costs.view.cand.inflight_requests[positions].astype(np.float64)
        jitter = _TIE * self._rng.random(len(positions))
        most, least = float(load.max()), float(load.min())
        imbalanced = most - least > self.BALANCE_ABS and most > self.BALANCE_REL * least
        share = _prefix_share(costs)[positions]
        if imbalanced or float(share.max()) <= self.CACHE_THRESHOLD:
            return load + jitter
        # The longest match first; among equal matches, the less loaded (lower key wins).
        return -share + _TIE * (load + jitter)


class WeightedScore(_Separable):
    """The llm-d router's default scoring profile, on this router's index and scrapes: each pod
    scores ``PREFIX × matched share of the prompt + QUEUE × queue score + KV × (1 − KV usage)``,
    the highest total wins. The queue score is ``(most − waiting) / (most − least)`` over the
    candidates' scraped waiting requests, 1 when they all wait alike; an unknown scrape reads as
    the worst known (``fill_unknown``). A pair's decode pod is scored without the prefix (it
    computes no prompt), as the llm-d P/D profile does."""

    name = "weighted-score"
    PREFIX, QUEUE, KV = 3.0, 2.0, 2.0

    def prefill_key(self, costs: PairCosts, prefill: np.ndarray) -> np.ndarray:
        return -(self._load_score(costs, prefill) + self.PREFIX * _prefix_share(costs)[prefill])

    def decode_key(self, costs: PairCosts, pairs: np.ndarray) -> np.ndarray:
        decode = costs.decode
        prefix = np.where(pairs, 0.0, self.PREFIX * _prefix_share(costs)[decode])
        return -(self._load_score(costs, decode) + prefix)

    def _load_score(self, costs: PairCosts, positions: np.ndarray) -> np.ndarray:
        """``QUEUE × queue score + KV × free KV`` (and a tie-break), per position."""
        cand = costs.view.cand
        waiting = fill_unknown(cand.waiting[positions], worst=0.0)
        most, least = float(waiting.max()), float(waiting.min())
        queue_score = (most - waiting) / (most - least) if most > least else np.ones(len(positions))
        usage = fill_unknown(cand.kv_usage[positions], worst=1.0)
        kv_score = 1.0 - np.clip(usage, 0.0, 1.0)
        return self.QUEUE * queue_score + self.KV * kv_score + _TIE * self._rng.random(len(positions))


# The pair pickers by name: ``picker.policy`` accepts exactly these keys (router/server/config.py).
POLICIES: dict[str, type[JointArgmin] | type[_Separable]] = {
    "joint": JointArgmin,
    "round-robin": RoundRobin,
    "least-loaded": LeastLoaded,
    "independent": IndependentChoice,
    "cache-aware": CacheAware,
    "weighted-score": WeightedScore,
}
